"""How fresh samples reach the trainer's buffer: the one place the two training modes differ.

- sync: every step, publish the weights (every `sync_every` steps) and have the searchers generate
  B prompts with them; the trainer waits for that batch.
- async: publish the first weights and start the searchers once; then every `sync_every` steps
  publish the current weights and merge whatever the searchers made since the last sync, without
  waiting. The trainer only waits while the buffer is empty (before the first batch, or after a
  staleness bound evicted everything).
"""

from __future__ import annotations

import threading
import time

from tba.buffer import ReplayBuffer, Sample
from tba.config import RunConfig
from tba.trainer import Trainer


class DataFeed:
    """How the trainer gets fresh samples into its buffer: the one place the two modes differ."""

    def __init__(self, config: RunConfig, searchers, trainer: Trainer, buffer: ReplayBuffer):
        self.config = config
        self.searchers = searchers
        self.trainer = trainer
        self.buffer = buffer
        self.merged = 0
        self.stale_evicted = 0
        self.capacity_evicted = 0

    def start(self, stop: threading.Event) -> float:
        """Async: publish the first weights, start the searchers and fill the buffer to
        `initial_buffer_samples`. Returns the seconds spent waiting."""
        if self.config.train.mode == "sync":
            return 0.0
        tc = self.config.train
        self.searchers.publish(*self.trainer.publish())
        self.searchers.start()
        return self._wait_for(tc.initial_buffer_samples or tc.num_prompts * tc.group_size, stop)

    def before_step(self, step: int, stop: threading.Event) -> dict[str, float]:
        """Bring new samples in for this step; metrics of what it took."""
        tc = self.config.train
        sync_point = (step - 1) % tc.sync_every == 0
        start = time.time()
        if tc.mode == "sync":
            if sync_point:
                self.searchers.publish(*self.trainer.publish())
            synced = time.time()
            samples, stats = self.searchers.generate(tc.num_prompts)
            self._merge(samples)
            waited = time.time() - synced
            return stats | {"sync_seconds": synced - start, "wait_seconds": waited}
        stats: dict[str, float] = {}
        if sync_point and step > 1:  # the first weights went out in `start`
            self.searchers.publish(*self.trainer.publish())
        if sync_point:
            samples, stats = self.searchers.collect(self.trainer.version)
            self._merge(samples)
        synced = time.time()
        waited = self._wait_for(1, stop)  # only when a staleness bound emptied the buffer
        return stats | {"sync_seconds": synced - start, "wait_seconds": waited}

    def _wait_for(self, num_samples: int, stop: threading.Event) -> float:
        start = time.time()
        while len(self.buffer) < num_samples and not stop.is_set():
            time.sleep(0.05)
            self._merge(self.searchers.collect(self.trainer.version)[0])
        return time.time() - start

    def _merge(self, samples: list[Sample]) -> None:
        self.merged += len(samples)
        self.capacity_evicted += self.buffer.add(samples)
        max_staleness = self.config.buffer.max_staleness
        if max_staleness is not None:
            self.stale_evicted += self.buffer.evict_older_than(self.trainer.version - max_staleness)
