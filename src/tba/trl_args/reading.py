"""TRL-named arguments read as tba settings (dotted keys), with, for each key, what set it: the
argument as the script wrote it (for error lines) or only TRL's default (which a script's own
tba settings then win over, `tba.trl_args.merge`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tba.errors import ConfigError
from tba.trl_args.batches import BATCH_ARGUMENTS, batch_settings
from tba.trl_args.kinds import Ignored, Refused
from tba.trl_args.table import TRL_ARGUMENTS, TRL_DEFAULTS


@dataclass
class TrlSettings:
    """TRL's arguments as tba settings: `settings` (dotted keys), `sources` (for each key, the
    arguments that set it, as written), `defaulted` (keys only TRL's defaults set), and the
    arguments accepted without effect (`ignored`, said once when the run starts)."""

    settings: dict[str, Any] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)
    defaulted: set[str] = field(default_factory=set)
    ignored: list[str] = field(default_factory=list)


def from_trl(arguments: dict[str, Any], defaults: dict[str, Any] = TRL_DEFAULTS) -> TrlSettings:
    """TRL-named `arguments`, on top of TRL's `defaults`, as tba settings. ConfigError, one line
    naming the argument as written, for an unknown name or a value tba cannot honour."""
    result = TrlSettings()
    values = defaults | arguments
    for name, value in values.items():
        if name not in BATCH_ARGUMENTS:
            _read(result, name, value, given=name in arguments, values=values)
    batch = {name: values[name] for name in BATCH_ARGUMENTS if name in values}
    if batch:
        given = [f"{name}={value!r}" for name, value in batch.items() if name in arguments]
        _add(result, batch_settings(batch), ", ".join(given) or "TRL's batch defaults",
             given=bool(given))
    return result


def _read(result: TrlSettings, name: str, value: Any, given: bool,
          values: dict[str, Any]) -> None:  # fmt: skip
    """One argument (not a batch one) by its table entry: refused, ignored or converted (without
    the argument it takes effect only with, among `values`: ignored, as TRL ignores it)."""
    entry = TRL_ARGUMENTS.get(name)
    if entry is None:
        raise ConfigError(f"unknown setting {name!r}: not a tba section nor a GRPOConfig "
                          "argument (docs/trl.md lists them)")  # fmt: skip
    if isinstance(entry, Refused):
        if not entry.unless(value):
            raise ConfigError(f"{name}={_shown(value)} has no tba equivalent: {entry.reason}")
    elif isinstance(entry, Ignored):
        result.ignored.append(f"{name}={_shown(value)}")
    elif entry.only_with is not None and not values.get(entry.only_with):
        if given:
            result.ignored.append(f"{name}={_shown(value)} (without {entry.only_with}=True)")
    else:
        try:
            converted = entry.convert(value)
        except ValueError as error:
            raise ConfigError(f"{name}={_shown(value)}: {error}") from None
        _add(result, converted, f"{name}={_shown(value)}", given=given)


def _add(result: TrlSettings, settings: dict[str, Any], source: str, given: bool) -> None:
    for key, value in settings.items():
        if key == "policy.dtype" and value == "float32" and result.settings.get(key) == "bfloat16":
            # bf16 named by one argument wins over float32 named by another (bf16=True beside a
            # quantization config's float32 compute dtype), whichever the script wrote first.
            continue
        result.settings[key] = value
        result.sources[key] = source
        if given:
            result.defaulted.discard(key)
        else:
            result.defaulted.add(key)


def _shown(value: Any) -> str:
    """A value as the script wrote it, on one line (a quantization config prints on many)."""
    text = " ".join(repr(value).split())
    return text if len(text) <= 120 else text[:117] + "..."
