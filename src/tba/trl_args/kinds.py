"""The three kinds of entry of the argument table, and the builders the table is written with.

An argument is mapped (it means tba settings), without effect (accepted, named once when the run
starts) or refused (one line saying why), never quietly dropped: a script that asks for
something tba does not do must hear it, rather than train something else.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Mapped:
    """A TRL argument with a tba equivalent: `convert(value)` gives the tba settings."""

    keys: str  # the tba settings it sets, for the docs
    convert: Callable[[Any], dict[str, Any]]
    why: str = ""  # what the docs add: where the meaning is not one setting's
    # A boolean argument without which this one has no effect in TRL (`use_vllm` for vLLM's
    # settings): without it, the argument is accepted without effect here too.
    only_with: str | None = None


@dataclass(frozen=True)
class Ignored:
    """Accepted, without effect; `reason` says why."""

    reason: str


@dataclass(frozen=True)
class Refused:
    """No equivalent; `reason` says why. `unless(value)`: values that are accepted (defaults)."""

    reason: str
    unless: Callable[[Any], bool] = lambda value: False


def to(key: str, check: Callable[[Any], bool] | None = None, what: str = "") -> Mapped:
    """The value as it is, for `key` (`check`: what it must satisfy, `what` says it); None
    (TRL's "not set") sets nothing."""

    def convert(value: Any) -> dict[str, Any]:
        if value is None:
            return {}
        if check is not None and not check(value):
            raise ValueError(what)
        return {key: value}

    return Mapped(key, convert)


def hub(what: str, key: str) -> Mapped:
    """The Hub upload's settings: kept with the config (as `hub.<key>`, which the config does not
    have) for `TBATrainer.push_to_hub`."""
    return Mapped("", lambda value: {f"hub.{key}": value},
                  f"{what} of the upload with `huggingface_hub` (`trainer.push_to_hub()`)")


def same(expected: Any) -> Callable[[Any], bool]:
    """`Refused`'s `unless`: only TRL's default is accepted."""
    return lambda value: value == expected


def none_or_empty(value: Any) -> bool:
    """`Refused`'s `unless` for a mapping or list of options: accepted while it asks nothing."""
    return not value
