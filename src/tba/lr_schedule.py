"""The learning rate over a run: warmup, then constant, linear or cosine decay (`LRSchedule`,
the optimizer's scheduler)."""

from __future__ import annotations

import math
from typing import Any

import torch

LR_SCHEDULES = ("constant", "linear", "cosine")


def warmup_steps_for(total_steps: int | None, warmup_steps: int, warmup_ratio: float) -> int:
    """The warmup's length in optimizer steps: `warmup_steps` when given (> 0), else
    ``ceil(warmup_ratio * total_steps)`` (as transformers rounds it; 0 without a step limit)."""
    if warmup_steps > 0 or total_steps is None:
        return warmup_steps
    return math.ceil(warmup_ratio * total_steps)


def lr_factor(
    step: int, schedule: str, warmup_steps: int, total_steps: int | None,
    decay_from: tuple[int, float] | None = None,
) -> float:  # fmt: skip
    """The learning rate's multiplier for optimizer step ``step + 1`` (``step`` updates taken).

    With ``w = warmup_steps``, ``T = total_steps`` and ``p = clamp((step - w) / (T - w), 0, 1)``:

        warmup (step < w):  (step + 1) / (w + 1)        (never 0: the first update counts)
        constant:           1
        linear:             1 - p                       (0 at step T)
        cosine:             (1 + cos(pi * p)) / 2

    After the warmup these are transformers' `linear` and `cosine` schedules; its warmup starts
    at 0 (a first update that does nothing), this one at 1 / (w + 1).

    `decay_from = (a, f)`: the decay starts at step ``a`` from ``f`` instead of at ``w`` from 1
    (``p = clamp((step - a) / (T - a), 0, 1)``, the factor ``f`` times the above): a run resumed
    with another step limit goes on from the rate of its last step down to 0 at its new last
    step (`LRSchedule`).
    """
    if schedule not in LR_SCHEDULES:
        raise ValueError(f"unknown learning-rate schedule {schedule!r}; "
                         f"available: {', '.join(LR_SCHEDULES)}")  # fmt: skip
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    if schedule == "constant":
        return 1.0
    if total_steps is None:
        raise ValueError(f"the {schedule} schedule decays over the run's steps: it needs a step "
                         "limit")  # fmt: skip
    start, scale = decay_from if decay_from is not None else (warmup_steps, 1.0)
    progress = min(max((step - start) / max(1, total_steps - start), 0.0), 1.0)
    if schedule == "linear":
        return scale * (1.0 - progress)
    return scale * 0.5 * (1.0 + math.cos(math.pi * progress))


class LRSchedule(torch.optim.lr_scheduler.LambdaLR):
    """The learning rate by `lr_factor`, for `optimizer`'s groups, kept in a checkpoint with the
    step limit and warmup it was made for (`state_dict`).

    A run resumed with the limit it was made for goes on exactly as it would have. One resumed
    with another limit (a finished run given a higher `train.max_steps`, as the refusal of a
    finished run suggests) keeps its warmup and, once its decay began, decays from the rate of
    its last step to 0 at its new last step (`decay_from`): the rate never jumps up and no step
    trains at 0. Recomputing the decay over the new limit instead would jump up (a linear decay
    at step 4 of 8 is at 1/2, where it ended a run of 4 at 1/4, and its next rate was 0).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, schedule: str, warmup_steps: int,
                 total_steps: int | None) -> None:  # fmt: skip
        lr_factor(0, schedule, warmup_steps, total_steps)  # an unknown schedule fails here
        # Attributes before the base class's first step (which reads them), saved by its
        # `state_dict` (every attribute but the optimizer and the lambdas).
        self.lr_schedule, self.warmup_steps, self.total_steps = schedule, warmup_steps, total_steps
        self.decay_from: list | None = None  # [step, factor]: lists, as JSON gives them back
        super().__init__(optimizer, self.factor)

    def factor(self, step: int) -> float:
        """The multiplier of the learning rate for optimizer step ``step + 1``."""
        return lr_factor(step, self.lr_schedule, self.warmup_steps, self.total_steps,
                         tuple(self.decay_from) if self.decay_from else None)  # fmt: skip

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["lr_lambdas"] = [None] * len(self.lr_lambdas)  # code: nothing of it is saved
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue the schedule of `state_dict`, extended to this one's step limit (or changed
        to this one's `lr_schedule`) if it was made for another (the class's docstring). A
        checkpoint written before the schedule kept its limit is taken to have ended its decay at
        the step it was saved at when its rate was 0 there, else to have had this limit."""
        schedule, total = self.lr_schedule, self.total_steps  # this run's; the warmup stays
        state = {key: value for key, value in state_dict.items() if key != "lr_lambdas"}
        super().load_state_dict({**state, "lr_lambdas": [None] * len(self.lr_lambdas)})
        step = self.last_epoch
        if "total_steps" not in state and schedule != "constant" and total is not None:
            rate = (state.get("_last_lr") or [None])[0]
            if step > 0 and rate == 0.0 and self.factor(step) > 0.0:  # ended at its limit
                self.total_steps = step
        if (self.lr_schedule, self.total_steps) == (schedule, total):
            return
        last = step - 1  # the last step taken: the decay goes on from its rate
        if last >= self.warmup_steps and (self.total_steps or self.lr_schedule == "constant"):
            self.decay_from = [last, self.factor(last)]
        self.lr_schedule, self.total_steps = schedule, total
        rates = [base * self.factor(step) for base in self.base_lrs]
        for group, rate in zip(self.optimizer.param_groups, rates):
            group["lr"] = rate
        self._last_lr = rates
