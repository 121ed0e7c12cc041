"""Renamed settings: `ALIASES`, the one table of old names and new, which docs/configuration.md
lists. An old name keeps working, with a one-line notice on stderr (once per name and process):
in YAML files and `key=value` overrides (`TrainConfig` moves it to its new place as it is
validated), and as an attribute of a `TrainConfig`. An override of either name replaces the
value the file gives the other; both names in one file, or in one list of overrides, is an
error naming them (`rename_old_keys`, `tba.config.loading.apply_overrides`): which one was meant
is not for tba to guess.

An old name of a setting of another objective than `train.loss`'s (`train.value_coef` in a TB
run) is dropped, as it always had no effect: config files and run directories written before
the rename load as they did. Its new name there is an error (`TrainConfig`'s
`_objective_settings_match_the_loss`)."""

from __future__ import annotations

import sys
from typing import Any

from tba.keys import has_key, pop_key, set_key
from tba.objectives import objective_settings

ALIASES: dict[str, str] = {
    "train.trust_region": "train.tb.trust_region",
    "train.log_z": "train.tb.log_z",
    "train.log_z_lr": "train.tb.log_z_lr",
    "train.value_model": "train.ppo.value_model",
    "train.value_lr": "train.ppo.value_lr",
    "train.gae_lambda": "train.ppo.gae_lambda",
    "train.value_clip": "train.ppo.value_clip",
    "train.value_coef": "train.ppo.value_coef",
    "train.vineppo_rollouts": "train.vineppo.rollouts",
    "train.vineppo_max_states": "train.vineppo.max_states",
    "train.vineppo_delimiter": "train.vineppo.delimiter",
    **{f"searchers.vllm.{name}": f"searchers.engine.{name}" for name in (
        "gpu_memory_utilization", "kv_cache_gb", "max_model_len", "dtype", "tensor_parallel_size",
        "enforce_eager")},
}  # fmt: skip

# `TrainConfig` attributes under their old names: name -> (section, field).
TRAIN_ATTRIBUTES: dict[str, tuple[str, str]] = {
    old.removeprefix("train."): tuple(new.removeprefix("train.").split("."))  # type: ignore[misc]
    for old, new in ALIASES.items()
    if old.startswith("train.")
}

_OLD_NAMES = {new: old for old, new in ALIASES.items()}

_noticed: set[str] = set()


def notice_renamed(old: str) -> None:
    """`notice: OLD is now NEW` on stderr, the first time this process meets `old`."""
    if old not in _noticed:
        _noticed.add(old)
        print(f"notice: {old} is now {ALIASES[old]}", file=sys.stderr)


def other_name(dotted: str) -> str | None:
    """The other name of a renamed setting: the new one of an old name, the old one of a new
    name; None for a setting never renamed."""
    return ALIASES.get(dotted) or _OLD_NAMES.get(dotted)


def objective_of(dotted: str) -> str | None:
    """The `train.loss` that a setting applies to alone (`train.ppo.value_coef`: ppo), else
    None (it applies to every loss). An objective's own section bears its name (its entry in
    the registry names the section's class: `objective_settings`)."""
    parts = dotted.split(".")
    if len(parts) == 3 and parts[0] == "train" and parts[1] in objective_settings():
        return parts[1]
    return None


def rename_old_keys(data: dict[str, Any], prefix: str = "") -> set[str]:
    """Move the old names given in `data` to their new places, in place (with the notice), and
    return the new names so set; `prefix`: where `data` sits ("": the whole config, `train.`:
    the train section). Both names of one setting given: ValueError."""
    renamed = set()
    for old, new in ALIASES.items():
        if not old.startswith(prefix) or not has_key(data, old.removeprefix(prefix)):
            continue
        notice_renamed(old)
        if has_key(data, new.removeprefix(prefix)):
            raise ValueError(f"{old} and {new} are one setting (renamed): give it once, as {new}")
        set_key(data, new.removeprefix(prefix), pop_key(data, old.removeprefix(prefix)))
        renamed.add(new)
    return renamed


def drop_inert(data: dict[str, Any], renamed: set[str], loss: Any, prefix: str = "") -> None:
    """Drop from `data` the settings in `renamed` (given by their old names) that apply to
    another objective than `loss`: they never had an effect there."""
    for new in renamed:
        objective = objective_of(new)
        if objective is not None and objective != loss and has_key(data, new.removeprefix(prefix)):
            pop_key(data, new.removeprefix(prefix))


def rename_engine_keys(data: dict[str, Any], engine: str) -> None:
    """Move the vLLM engine's settings given by their old names (`searchers.vllm.*`) in `data`
    (the searchers section, its `engine` a mapping; `SearchersConfig` calls this as it is
    validated) to the engine's section, in place (with the notice), where `engine` (its type) is
    vLLM. With another engine they are dropped, as `drop_inert` drops another objective's: they
    never had an effect there, and a run directory's config.yaml written before the rename lists
    them all. Both names of one setting given: ValueError."""
    renamed = rename_old_keys(data, prefix="searchers.")
    if engine != "vllm":
        for new in renamed:
            pop_key(data, new.removeprefix("searchers."))
    if data.get("vllm") == {}:
        del data["vllm"]
