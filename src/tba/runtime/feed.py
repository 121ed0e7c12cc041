"""How fresh samples reach the trainer's buffer: the one place the two training modes differ.

- sync: every step, publish the weights (every `sync_every` steps) and have the searchers generate
  B prompts with them; the trainer waits for that batch.
- async: publish the first weights and start the searchers once; then every `sync_every` steps
  publish the current weights and merge whatever the searchers made since the last sync, without
  waiting. The trainer only waits while the buffer is empty (before the first batch, or after a
  staleness bound evicted everything).

Every sample is named by (searcher, incarnation, seq), and each searcher process numbers its
samples 0, 1, 2, ...; the feed checks that numbering as it merges, so a sample handed over twice
is dropped and counted as a duplicate, and one never handed over is counted as lost. Both must
stay 0; `state()` keeps the numbering across a checkpoint.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from tba.buffer import ReplayBuffer, Sample
from tba.config import RunConfig
from tba.trainer import Trainer


class DataFeed:
    """How the trainer gets fresh samples into its buffer: the one place the two modes differ."""

    MAX_FAULT_KINDS_LOGGED = 20

    def __init__(
        self,
        config: RunConfig,
        searchers,
        trainer: Trainer,
        buffer: ReplayBuffer,
        log_event: Callable[..., None] = lambda kind, **fields: None,
    ):
        self.config = config
        self.searchers = searchers
        self.trainer = trainer
        self.buffer = buffer
        self.log_event = log_event
        self.counts: Counter[str] = Counter()
        self.reward_faults: Counter[str] = Counter()  # "function: reason" -> completions dropped
        self.next_seq: dict[tuple[int, int], int] = {}  # (searcher, incarnation) -> next seq
        self.publish_next = False  # a resumed run publishes at its first step, whatever k

    def state(self) -> dict[str, Any]:
        return {
            "counts": dict(self.counts),
            "reward_faults": dict(self.reward_faults),
            "next_seq": [[sid, inc, seq] for (sid, inc), seq in self.next_seq.items()],
        }

    def restore(self, state: dict[str, Any]) -> None:
        self.counts = Counter(state["counts"])
        self.reward_faults = Counter(state["reward_faults"])
        self.next_seq = {(sid, inc): seq for sid, inc, seq in state["next_seq"]}
        self.publish_next = True

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
        sync_point = (step - 1) % tc.sync_every == 0 or self.publish_next
        start = time.time()
        if tc.mode == "sync":
            if sync_point:
                self.searchers.publish(*self.trainer.publish())
                self.publish_next = False
            synced = time.time()
            samples, stats = self.searchers.generate(tc.num_prompts)
            self._merge(samples)
            self._note_reward_faults(stats)
            waited = time.time() - synced
            return stats | {"sync_seconds": synced - start, "wait_seconds": waited}
        stats: dict[str, float] = {}
        if sync_point and step > 1 and not self.publish_next:  # first weights went out in start
            self.searchers.publish(*self.trainer.publish())
        self.publish_next = False
        if sync_point:
            samples, stats = self.searchers.collect(self.trainer.version)
            self._merge(samples)
            self._note_reward_faults(stats)
        synced = time.time()
        waited = self._wait_for(1, stop)  # only when a staleness bound emptied the buffer
        return stats | {"sync_seconds": synced - start, "wait_seconds": waited}

    def _wait_for(self, num_samples: int, stop: threading.Event) -> float:
        start = time.time()
        while len(self.buffer) < num_samples and not stop.is_set():
            time.sleep(0.05)
            samples, stats = self.searchers.collect(self.trainer.version)
            self._merge(samples)
            self._note_reward_faults(stats)
        return time.time() - start

    def _merge(self, samples: list[Sample]) -> None:
        fresh = [s for s in samples if self._first_time(s)]
        self.counts["merged"] += len(fresh)
        self.counts["capacity_evicted"] += self.buffer.add(fresh)
        max_staleness = self.config.buffer.max_staleness
        if max_staleness is not None:
            evicted = self.buffer.evict_older_than(self.trainer.version - max_staleness)
            self.counts["stale_evicted"] += evicted

    def _first_time(self, sample: Sample) -> bool:
        """Check the sample's number against its searcher's sequence: a repeat is a duplicate
        (dropped), a jump means samples were lost on the way."""
        key = (sample.searcher_id, sample.incarnation)
        expected = self.next_seq.get(key, 0)
        if sample.seq < expected:
            self.counts["duplicates"] += 1
            return False
        self.counts["lost"] += sample.seq - expected
        self.next_seq[key] = sample.seq + 1
        return True

    def _note_reward_faults(self, stats: dict[str, float]) -> None:
        """Count reward-function faults; log the first of each kind (function and reason)."""
        self.counts["reward_dropped"] += int(stats.get("reward_dropped", 0))
        for name, reason, dropped in self.searchers.take_reward_faults():
            kind = f"{name}: {reason}"
            new_kind = kind not in self.reward_faults
            if new_kind and len(self.reward_faults) < self.MAX_FAULT_KINDS_LOGGED:
                self.log_event("reward_fault", function=name, reason=reason, dropped=dropped)
            self.reward_faults[kind] += dropped
