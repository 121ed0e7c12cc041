"""The trainer's view of its searchers, wherever they run: `Searchers` (publish weights, generate
now, hand over reward faults, checkpoint state) and `AsyncSearchers` (also generate without
pause and hand over what they made). `tba.runtime.in_process` runs one searcher inside the
trainer process; `tba.runtime.ray_pool` runs them as Ray actors; `tba.runtime.launch` picks."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from tba.core import Sample
from tba.trainer import WeightVersions


class Searchers(ABC):
    """What the trainer asks of its searchers, wherever they run."""

    restarts: int = 0  # searcher processes replaced after they died
    discarded_in_flight: int = 0  # samples made but never handed over: work lost, not data

    @abstractmethod
    def publish(self, trainer: WeightVersions) -> None:
        """The trainer's weights as they are now as a new version (`trainer.publish`), for every
        searcher's next generation."""

    @abstractmethod
    def generate(self, num_prompts: int) -> tuple[list[Sample], dict[str, float]]:
        """Generate for `num_prompts` prompts now with the published weights, and wait."""

    @abstractmethod
    def take_reward_faults(self) -> list[tuple[str, str, int]]:
        """(function, reason, completions dropped) of the reward faults since the last call."""

    @abstractmethod
    def total_generated(self) -> int | None:
        """Samples made over the whole run (None when unknown)."""

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of the searchers: where each is in its prompt stream."""

    @abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a checkpoint's `state_dict()` (before the first generation)."""

    @abstractmethod
    def close(self) -> None:
        """Stop every searcher."""


class AsyncSearchers(Searchers):
    """Searchers that can also generate without pause, for the asynchronous mode."""

    @abstractmethod
    def start(self) -> None:
        """Every searcher generates until closed, adopting weights as they are published."""

    @abstractmethod
    def collect(self, trainer_version: int) -> tuple[list[Sample], dict[str, float]]:
        """The samples made since the last call, without waiting on generation in flight."""

    @abstractmethod
    def cpus_beside_trainer(self) -> float:
        """CPUs the searchers reserve on the machine the trainer runs on."""
