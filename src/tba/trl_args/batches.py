"""The batch mapping: TRL's batch arguments, read together, as tba's batch settings.

TRL spreads one batch over six arguments whose meanings depend on each other (a generation's
size defaults to a step's, a step's to a pass's times the passes), so they are mapped together,
never one by one.
"""

from __future__ import annotations

import math
from typing import Any

from tba.errors import ConfigError

BATCH_ARGUMENTS = ("per_device_train_batch_size", "gradient_accumulation_steps",
                   "num_generations", "generation_batch_size", "steps_per_generation",
                   "num_iterations")  # fmt: skip

# The tba settings `batch_settings` gives, for the docs.
BATCH_KEYS = ("train.group_size, train.samples_per_prompt, train.num_prompts, "
              "train.micro_batch_groups, train.group_baseline, searchers.prompts_per_batch, "
              "train.sync_generate=when_needed, buffer.fresh_uses")  # fmt: skip


def batch_settings(arguments: dict[str, Any]) -> dict[str, Any]:
    """TRL's batch as tba's.

    TRL: an optimizer step trains on per_device_train_batch_size (P) completions a pass, times
    gradient_accumulation_steps (A) passes; a generation makes generation_batch_size completions
    (P * steps_per_generation; default P * A, one generation a step), num_generations (G) for
    each of its prompts, and serves the steps that follow until its completions are used up (each
    num_iterations times).

    tba: a step trains on train.num_prompts groups of train.group_size completions of one
    prompt, groups kept whole in the loss (each group's log Z, or baseline, comes from all of
    its members). So the trained part of a group is the largest that divides both P * A and G,
    K = gcd(P * A, G): G when P * A is a multiple of G, else a part of a prompt's G completions
    (train.samples_per_prompt = G; K = 1 when P * A and G share no factor), the other parts
    trained at the same or the next steps; as in TRL, the group's statistics still come from
    all G (train.group_baseline = generation: the G completions not trained on at a step enter
    its log Z or baseline without gradient, each once). B = P * A / K groups a step,
    max(1, P // K) a pass;
    searchers.prompts_per_batch = generation_batch_size / G prompts a generation, and in the
    synchronous mode a generation only when the buffer holds fewer fresh groups than a step
    takes (train.sync_generate=when_needed), so that every step trains on fresh completions, as
    many as TRL's. num_iterations > 1 reuses them as TRL does: each completion is trained on
    num_iterations times (buffer.fresh_uses), the least-used first, so that a generation serves
    num_iterations times as many steps."""
    get = _checked(arguments)
    per_pass = get["per_device_train_batch_size"] or 8
    passes = get["gradient_accumulation_steps"] or 1
    group = get["num_generations"] or 8
    generation = _generation_size(per_pass, passes, group, get["generation_batch_size"],
                                  get["steps_per_generation"])  # fmt: skip
    per_step = per_pass * passes
    size = math.gcd(per_step, group)
    groups = per_step // size
    per_micro_batch = max(1, per_pass // size)
    settings: dict[str, Any] = {
        "train.group_size": size,
        "train.samples_per_prompt": group if size < group else None,
        "train.group_baseline": "generation" if size < group else "trained",
        "train.num_prompts": groups,
        "train.micro_batch_groups": per_micro_batch if per_micro_batch < groups else None,
        "searchers.prompts_per_batch": generation // group,
        "train.sync_generate": "when_needed",
    }
    iterations = get["num_iterations"] or 1
    if iterations > 1:
        settings["buffer.fresh_uses"] = iterations
    return settings


def _checked(arguments: dict[str, Any]) -> dict[str, Any]:
    """Every batch argument (None where not given), each a whole number >= 1."""
    get = {name: arguments.get(name) for name in BATCH_ARGUMENTS}
    for name, value in get.items():
        if value is not None and not (isinstance(value, int) and value >= 1):
            raise ConfigError(f"{name}={value!r}: must be a whole number >= 1")
    if get["num_generations"] is not None and get["num_generations"] < 2:
        raise ConfigError(f"num_generations={get['num_generations']}: a group needs 2 or more "
                          "completions of a prompt (as in TRL)")  # fmt: skip
    return get


def _generation_size(per_pass: int, passes: int, group: int, generation: int | None,
                     steps: int | None) -> int:  # fmt: skip
    """Completions a generation, checked as TRL checks them: whole passes of whole groups."""
    if generation is not None and steps is not None:
        raise ConfigError(f"generation_batch_size={generation} and steps_per_generation={steps}: "
                          "set one of them (as in TRL)")  # fmt: skip
    if generation is None:
        generation = per_pass * (steps or passes)
    elif generation % per_pass:
        raise ConfigError(f"generation_batch_size={generation}: must be a multiple of "
                          f"per_device_train_batch_size={per_pass} (as in TRL)")  # fmt: skip
    if generation % group:
        raise ConfigError(f"generation_batch_size={generation} (per_device_train_batch_size * "
                          f"steps_per_generation when not given) must be a multiple of "
                          f"num_generations={group}: a generation makes whole groups (as in "
                          "TRL)")  # fmt: skip
    return generation
