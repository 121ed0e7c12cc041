"""Beta, the KL coefficient / reward temperature of the TB target, over a run: constant or
linearly annealed."""

from __future__ import annotations

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

