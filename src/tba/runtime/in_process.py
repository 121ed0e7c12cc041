"""One searcher inside the trainer process: the synchronous mode without Ray
(`searchers.count=0`). Where it can, it samples with the trainer's own module
(`tba.runtime.placement`): one copy of the policy on the device, and nothing copied at a sync."""

from __future__ import annotations

from typing import Any

from tba.core import Sample
from tba.runtime.searchers import Searchers
from tba.searcher import PromptStream, Searcher
from tba.trainer import WeightVersions


class InProcessSearchers(Searchers):
    """One searcher in the trainer process: the synchronous mode without Ray."""

    def __init__(self, searcher: Searcher) -> None:
        self.searcher = searcher

    def publish(self, trainer: WeightVersions) -> None:
        """A copy of the weights into the searcher's own model; none where it samples with the
        trainer's module."""
        version, step = trainer.publish()
        if self.searcher.shares_trainer_model:
            self.searcher.adopt(version, step)
        else:
            self.searcher.set_weights(trainer.weights(), version, step)

    def generate(self, num_prompts: int) -> tuple[list[Sample], dict[str, float]]:
        return self.searcher.generate(num_prompts)

    def take_reward_faults(self) -> list[tuple[str, str, int]]:
        return self.searcher.take_reward_faults()

    def total_generated(self) -> int:
        return self.searcher.num_generated

    def state_dict(self) -> dict[str, Any]:
        """Stream position and sampling RNG: with them a resumed run draws the same samples."""
        searcher = self.searcher
        return {
            "stream_taken": searcher.stream.taken,
            "num_generated": searcher.num_generated,
            "engine": searcher.engine.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        searcher = self.searcher
        searcher.stream = PromptStream(searcher.stream.num_rows, searcher.stream.seed,
                                       state["stream_taken"])  # fmt: skip
        searcher.num_generated = state["num_generated"]
        # Checkpoints of earlier versions hold the built-in engine's generator as "generator".
        engine = state["engine"] if "engine" in state else {"generator": state["generator"]}
        searcher.engine.load_state_dict(engine)

    def close(self) -> None:
        """Nothing to release: the searcher lives and ends with this process."""
