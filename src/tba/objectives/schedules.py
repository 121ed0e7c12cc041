"""Schedules: beta, the KL coefficient / reward temperature of the TB target, and the learning
rate (warmup, then constant, linear or cosine decay)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class BetaSchedule:
    """Constant or linearly annealed beta as a function of training progress in [0, 1].

    With ``p = clamp(progress, 0, 1)``, ``p0 = start_frac`` and ``p1 = end_frac``:

        beta(p) = start                                        if end is None or p <= p0
                = end                                          if p >= p1
                = start + (p - p0) / (p1 - p0) * (end - start) otherwise

    E.g. the paper's GSM8K setting anneals 0.012 -> 0.004: ``BetaSchedule(0.012, 0.004)``.
    """

    start: float
    end: float | None = None
    start_frac: float = 0.0
    end_frac: float = 1.0

    def __post_init__(self) -> None:
        if not self.start > 0:
            raise ValueError(f"beta start must be > 0, got {self.start}")
        if self.end is not None and not self.end > 0:
            raise ValueError(f"beta end must be > 0, got {self.end}")
        if not 0.0 <= self.start_frac <= self.end_frac <= 1.0:
            raise ValueError(
                "need 0 <= start_frac <= end_frac <= 1, "
                f"got start_frac={self.start_frac}, end_frac={self.end_frac}"
            )

    def __call__(self, progress: float) -> float:
        """Beta at ``progress = step / total_steps`` (clamped to [0, 1])."""
        p = min(max(progress, 0.0), 1.0)
        if self.end is None or p <= self.start_frac:
            return self.start
        if p >= self.end_frac:
            return self.end
        t = (p - self.start_frac) / (self.end_frac - self.start_frac)
        return self.start + t * (self.end - self.start)


LR_SCHEDULES = ("constant", "linear", "cosine")


def warmup_steps_for(total_steps: int | None, warmup_steps: int, warmup_ratio: float) -> int:
    """The warmup's length in optimizer steps: `warmup_steps` when given (> 0), else
    ``ceil(warmup_ratio * total_steps)`` (as transformers rounds it; 0 without a step limit)."""
    if warmup_steps > 0 or total_steps is None:
        return warmup_steps
    return math.ceil(warmup_ratio * total_steps)


def lr_factor(step: int, schedule: str, warmup_steps: int, total_steps: int | None) -> float:
    """The learning rate's multiplier for optimizer step ``step + 1`` (``step`` updates taken).

    With ``w = warmup_steps``, ``T = total_steps`` and ``p = clamp((step - w) / (T - w), 0, 1)``:

        warmup (step < w):  (step + 1) / (w + 1)        (never 0: the first update counts)
        constant:           1
        linear:             1 - p                       (0 at step T)
        cosine:             (1 + cos(pi * p)) / 2

    After the warmup these are transformers' `linear` and `cosine` schedules; its warmup starts
    at 0 (a first update that does nothing), this one at 1 / (w + 1).
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
    progress = min(max((step - warmup_steps) / max(1, total_steps - warmup_steps), 0.0), 1.0)
    if schedule == "linear":
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))
