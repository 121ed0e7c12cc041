"""The merge of TRL's arguments into a tba config: a `TBAConfig`'s keywords (tba's sections
beside TRL's names) as the nested data the config validates.

What the script wrote wins: a setting written twice (by TRL's name and in tba's section) is
refused, since one of them would be quietly dropped; TRL's defaults fill only what the script
left unset, and stay out of a group of settings the script set part of (`TOGETHER`). The config
itself is not imported here (`tba.config` is this package's sibling layer): the caller names its
sections, and validates the data.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from pydantic import BaseModel

from tba.errors import ConfigError
from tba.keys import get_key, has_key, set_key
from tba.objectives import DEFAULT_OBJECTIVE, OBJECTIVES
from tba.trl_args.converters import TRACKERS
from tba.trl_args.reading import TrlSettings, from_trl

# Settings that mean something only together (a decay needs the run's length): where a script
# sets one of them in tba's own sections, TRL's defaults leave all of them alone.
TOGETHER = (
    ("train.max_steps", "train.num_epochs", "train.max_minutes", "train.lr_schedule"),
    ("train.group_size", "train.samples_per_prompt", "train.num_prompts",
     "train.micro_batch_groups", "train.group_baseline", "searchers.prompts_per_batch",
     "train.sync_generate", "buffer.fresh_uses"),
    ("train.warmup_steps", "train.warmup_ratio"),
)  # fmt: skip


def merge_arguments(settings: dict[str, Any], sections: Collection[str],
                    ) -> tuple[dict[str, Any], TrlSettings, dict[str, Any]]:  # fmt: skip
    """`settings` (a TBAConfig's keywords; `sections`: the config's own top-level names) as the
    data to validate, what TRL's names set (`from_trl`, on TRL's defaults; its `sources` only for
    the keys taken) and the Hub upload's settings."""
    native = {name: value for name, value in settings.items()
              if name in sections and not trl_report_to(name, value)}  # fmt: skip
    trl = from_trl({name: value for name, value in settings.items() if name not in native})
    data = {name: value.model_dump() if isinstance(value, BaseModel) else value
            for name, value in native.items()}  # fmt: skip
    hub = merge_trl(data, trl)
    _check_single_completions(data, trl)
    return data, trl, hub


def _check_single_completions(data: dict[str, Any], trl: TrlSettings) -> None:
    """A TRL batch whose P * A shares no factor with G trains single completions of a prompt
    (K = 1, `batch_settings`): only a loss with group statistics can, from the generation's
    other completions. Said of the arguments the script wrote, not of the K they gave."""
    if trl.settings.get("train.group_size") != 1 or "train.group_size" not in trl.sources:
        return
    loss = get_key(data, "train.loss", DEFAULT_OBJECTIVE)
    objective = OBJECTIVES.get(loss)
    if objective is None or objective.needs.group_statistics:
        return
    able = ", ".join(name for name, o in OBJECTIVES.items() if o.needs.group_statistics)
    raise ConfigError(f"{trl.sources['train.group_size']}: per_device_train_batch_size * "
                      "gradient_accumulation_steps shares no factor with num_generations, so a "
                      f"step would train single completions of a prompt, which train.loss={loss} "
                      f"cannot (a loss with group statistics can: {able}); make "
                      "per_device_train_batch_size * gradient_accumulation_steps a multiple of "
                      "num_generations")  # fmt: skip


def trl_report_to(name: str, value: Any) -> bool:
    """TRL's way of writing report_to ("none", "all", one name): read by `from_trl`; a list of
    tba's trackers is tba's own setting."""
    return name == "report_to" and not (isinstance(value, list)
                                        and all(tracker in TRACKERS for tracker in value))


def merge_trl(data: dict[str, Any], trl: TrlSettings) -> dict[str, Any]:
    """TRL's settings into `data` (tba's sections, nested, as the script wrote them), in place;
    `trl.sources` keeps the keys taken. Returns the Hub upload's settings (`hub.*`), which are
    no config section."""
    hub: dict[str, Any] = {}
    taken = set()
    for dotted, value in trl.settings.items():
        if dotted.startswith("hub."):
            hub[dotted.removeprefix("hub.")] = value
        elif has_key(data, dotted):
            if dotted not in trl.defaulted:
                raise ConfigError(f"{dotted} is set twice: by {trl.sources[dotted]} and in "
                                  f"{dotted.split('.')[0]}")  # fmt: skip
        elif dotted not in trl.defaulted or not _set_beside(data, dotted):
            taken.add(dotted)
    for dotted in taken:  # after the loop: `_set_beside` asks what the script set
        set_key(data, dotted, trl.settings[dotted])
    trl.sources = {key: source for key, source in trl.sources.items() if key in taken}
    return hub


def _set_beside(data: dict[str, Any], dotted: str) -> bool:
    """Whether the script set a setting that means something only together with `dotted`
    (`TOGETHER`): then TRL's default for `dotted` stays out."""
    return any(has_key(data, other) for keys in TOGETHER if dotted in keys for other in keys)
