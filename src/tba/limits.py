"""A run's limits and its end: the step at which it stops (TRL's rule: a step limit given wins
over an epoch count; the time limit applies beside either), the line that says so at its start,
and what a resumed run that reached its limit has left to do."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

from tba.checkpoint import Checkpoint
from tba.config import ConfigError, RunConfig, TrainConfig
from tba.run_dir import run_ended


def check_unfinished(
    run_dir: Path, checkpoint: Checkpoint, config: RunConfig, num_prompts: int,
    log: Callable[[str], None] = print,
) -> bool:  # fmt: skip
    """Whether a resumed run has only its end left: it reached its limit, but its final
    evaluation and save were cut short (a kill, a full disk); `log` says it is evaluated and saved
    without training. A run that ended at its limit, resumed with that same limit, would train
    nothing and be evaluated again: one line saying which limit it reached and how to go further.
    A run that stopped before its limit (interrupted, or failed after its last checkpoint) goes
    on."""
    tc, step = config.train, checkpoint.step
    last = step_limit(tc, num_prompts)
    minutes = checkpoint.state["loop"]["elapsed"] / 60
    if last is not None and step >= last and step_limit_key(tc) == "train.max_steps":
        key, value = "train.max_steps", tc.max_steps
        reached, further = f"{key}={value} (step {step})", f"{step + value}"
    elif last is not None and step >= last:
        key, value = "train.num_epochs", tc.num_epochs
        done = step * prompts_per_step(tc) / num_prompts
        reached = f"{key}={value:g} (step {step}, {done:.3g} epochs)"
        further = f"{_rounded_up(done + value):g}"
    elif tc.max_minutes is not None and minutes >= tc.max_minutes:
        key, value = "train.max_minutes", tc.max_minutes
        reached = f"{key}={value:g} ({minutes:.1f} minutes)"
        further = f"{_rounded_up(minutes + value):g}"
    else:
        return False
    if not run_ended(run_dir):
        log(f"run {run_dir} reached its limit, {reached}, but its end was not saved: evaluating "
            "and saving it, without training")  # fmt: skip
        return True
    # A limit counts from the run's start: `value` more than the run has done, as a new limit.
    raise ConfigError(f"run {run_dir} already reached its limit, {reached}: to train it further, "
                      f"resume with a higher {key}, e.g. `tba train --resume {run_dir} "
                      f"{key}={further}`")  # fmt: skip


def _rounded_up(value: float) -> float:
    """`value` rounded up to 2 decimals: a limit shown short that is still past `value` (its
    float error, 2.0000000000000004 for 2, rounded away first)."""
    return math.ceil(round(value * 100, 6)) / 100


def step_limit(train: TrainConfig, num_prompts: int) -> int | None:
    """The run's last optimizer step, by TRL's rule: `train.max_steps` when it is given, whatever
    `train.num_epochs` says; else, with `train.num_epochs`, that many passes over the
    `num_prompts` training prompts, `train.num_prompts` groups per step (a group is `group_size`
    of the `samples_per_prompt` completions of its prompt); else None (the run ends by time)."""
    if train.max_steps is not None or train.num_epochs is None:
        return train.max_steps
    return max(1, math.ceil(train.num_epochs * num_prompts / prompts_per_step(train)))


def prompts_per_step(train: TrainConfig) -> float:
    """Training prompts a step takes: `train.num_prompts` groups, each `group_size` of the
    `samples_per_prompt` completions of its prompt (a fraction of a prompt when fewer)."""
    return train.num_prompts * train.group_size / (train.samples_per_prompt or train.group_size)


def step_limit_key(train: TrainConfig) -> str | None:
    """The setting `step_limit` reads: `train.max_steps`, `train.num_epochs` or None."""
    if train.max_steps is not None:
        return "train.max_steps"
    return None if train.num_epochs is None else "train.num_epochs"


def limits_line(train: TrainConfig, num_prompts: int) -> str:
    """The run's limits as they apply, for the start of a run: e.g. `stops at step 3
    (train.max_steps; train.num_epochs=3 ignored) or after 10 minutes, whichever comes first`."""
    last, key = step_limit(train, num_prompts), step_limit_key(train)
    parts = []
    if key == "train.max_steps":
        epochs = train.num_epochs
        ignored = "" if epochs is None else f"; train.num_epochs={epochs:g} ignored"
        parts.append(f"at step {last} (train.max_steps{ignored})")
    elif key == "train.num_epochs":
        parts.append(f"at step {last} (train.num_epochs={train.num_epochs:g} over {num_prompts} "
                     "training prompts)")  # fmt: skip
    if train.max_minutes is not None:
        parts.append(f"after {train.max_minutes:g} minutes")
    whichever = ", whichever comes first" if len(parts) > 1 else ""
    return "stops " + " or ".join(parts) + whichever + " (or at Ctrl-C)"
