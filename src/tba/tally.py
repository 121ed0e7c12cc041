"""What a run has trained on and how its trainer spent its time, added up step after step: the
staleness and make-up of every batch (in each step's record and in eval.json), and the trainer's
seconds after warm-up. A checkpoint keeps the totals, so a resumed run reports the whole run."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from tba.core import Batch
from tba.trainer import Trainer, distinct_context


class Tally:
    """Per trained sample, how stale it was: in weight versions, and in optimizer steps since its
    weights were published. Per group, whether it was fresh, reused (every sample trained on
    before) or repeated (identical to one of the batch before); whole batches repeated. And the
    trainer's seconds waiting for data, syncing weights, evaluating, and in all."""

    def __init__(self) -> None:
        self.staleness: Counter[int] = Counter()
        self.staleness_steps: Counter[int] = Counter()
        self.groups: Counter[str] = Counter()
        self.seconds: Counter[str] = Counter()

    def batch(self, batch: Batch, trainer: Trainer) -> dict[str, float]:
        """Count a batch before the trainer steps on it; its staleness and make-up."""
        samples = [s for group in batch.groups for s in group]
        lags = [trainer.version - s.version for s in samples]
        lags_steps = [trainer.steps_behind(s.version) for s in samples]
        self.staleness.update(lags)
        self.staleness_steps.update(lags_steps)
        self.groups.update(trained=len(batch.groups), fresh=batch.fresh, reused=batch.reused,
                           repeated=batch.repeated,
                           identical_batches=batch.repeated == len(batch.groups))  # fmt: skip
        return {
            "staleness_mean": float(np.mean(lags)),
            "staleness_max": max(lags),
            "staleness_steps_mean": float(np.mean(lags_steps)),
            "staleness_steps_max": max(lags_steps),
            "fresh_groups": batch.fresh,
            "reused_groups": batch.reused,
            "repeated_groups": batch.repeated,
            # Samples that entered their group's statistics only (`train.group_baseline`),
            # each once: groups of a prompt drawn together share their generation's others.
            **({"context_samples": len(distinct_context([s for c in batch.context for s in c],
                                                        samples))} if batch.context else {}),
        }

    def time(self, **seconds: float) -> float:
        """Add a step's seconds (`wait`, `sync`, `eval`, `total`); the share of all the trainer's
        time so far spent waiting for data or syncing weights."""
        self.seconds.update(seconds)
        return (self.seconds["wait"] + self.seconds["sync"]) / self.seconds["total"]

    def summary(self) -> dict[str, Any]:
        """The totals, for eval.json."""
        total = max(self.seconds["total"], 1e-9)
        return {
            # Of the trainer's time after warm-up (evaluation included): waiting and syncing.
            "trainer_wait_frac": (self.seconds["wait"] + self.seconds["sync"]) / total,
            "trainer_sync_frac": self.seconds["sync"] / total,
            "eval_frac": self.seconds["eval"] / total,
            "staleness_histogram": _histogram(self.staleness),
            "staleness_steps_histogram": _histogram(self.staleness_steps),
            "staleness_steps_mean": _mean(self.staleness_steps),
            # Groups of fresh samples, groups whose every sample was trained on before, groups
            # identical to one of the step before, and whole batches trained twice in a row.
            "groups_trained": self.groups["trained"],
            "groups_fresh": self.groups["fresh"],
            "groups_reused": self.groups["reused"],
            "groups_repeated": self.groups["repeated"],
            "identical_batches": self.groups["identical_batches"],
        }

    def state_dict(self) -> dict[str, Any]:
        return {
            "staleness": _histogram(self.staleness),
            "staleness_steps": _histogram(self.staleness_steps),
            "groups": dict(self.groups),
            "seconds": dict(self.seconds),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.staleness = Counter({int(lag): n for lag, n in state["staleness"].items()})
        self.staleness_steps = Counter({int(lag): n for lag, n in state["staleness_steps"].items()})
        self.groups = Counter(state["groups"])
        self.seconds = Counter(state["seconds"])


def _histogram(counts: Counter[int]) -> dict[str, int]:
    """{lag: count} with JSON's string keys, in order of lag."""
    return {str(lag): n for lag, n in sorted(counts.items())}


def _mean(histogram: Counter[int]) -> float:
    total = sum(histogram.values())
    return sum(k * n for k, n in histogram.items()) / total if total else 0.0
