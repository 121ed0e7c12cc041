"""How fresh samples reach the trainer's buffer: the one place the two training modes differ.

- `SyncFeed` (on-policy baseline): every step, publish the weights (every `sync_every` steps) and
  have the searchers generate B prompts with them; the trainer waits for that batch.
- `AsyncFeed` (TBA): publish the first weights and start the searchers once. Then, every step,
  merge whatever the searchers made since the last step (a non-blocking call: samples reach the
  buffer as soon as they exist, not only at syncs), and every `sync_every` steps publish the
  current weights. The trainer waits only while the buffer is empty (before the first batch, or
  after the staleness bound evicted everything) or, with `train.fresh_wait_s`, briefly for fresh
  prompts.

Both enforce `buffer.max_staleness`, in optimizer steps: samples of weights published more than
that many steps ago are evicted as they become too old (the newest published weights are always
kept, so a bound below `sync_every` cannot starve the trainer).

Every sample is named by (searcher, incarnation, seq), and each searcher process numbers its
samples 0, 1, 2, ...; the feed checks that numbering as it merges, so a sample handed over twice
is dropped and counted as a duplicate, and one never handed over is counted as lost. Both must
stay 0; `state_dict()` keeps the numbering across a checkpoint.
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from tba.buffer import ReplayBuffer, Sample
from tba.config import RunConfig
from tba.trainer import Trainer


class Feed:
    """What both modes share: merging with the numbering checks, the staleness bound, reward
    faults, and the state a checkpoint keeps."""

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
        self.on_merge: Callable[[list[Sample]], None] | None = None  # sees every new sample

    def state_dict(self) -> dict[str, Any]:
        return {
            "counts": dict(self.counts),
            "reward_faults": dict(self.reward_faults),
            "next_seq": [[sid, inc, seq] for (sid, inc), seq in self.next_seq.items()],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.counts = Counter(state["counts"])
        self.reward_faults = Counter(state["reward_faults"])
        self.next_seq = {(sid, inc): seq for sid, inc, seq in state["next_seq"]}
        self.publish_next = True

    def start(self, stop: threading.Event) -> float:
        """Get ready to train; returns the seconds spent waiting for data."""
        return 0.0

    def before_step(self, step: int, stop: threading.Event) -> dict[str, float]:
        """Bring new samples in for this step; metrics of what it took."""
        raise NotImplementedError

    def _sync_point(self, step: int) -> bool:
        return (step - 1) % self.config.train.sync_every == 0

    def _publish(self) -> None:
        self.searchers.publish(*self.trainer.publish())
        self.publish_next = False

    def _merge(self, samples: list[Sample], stats: dict[str, float]) -> list[Sample]:
        """Add the samples not merged before; returns them."""
        fresh = [s for s in samples if self._first_time(s)]
        if self.on_merge is not None and fresh:
            self.on_merge(fresh)
        self.counts["merged"] += len(fresh)
        self.counts["capacity_evicted"] += self.buffer.add(fresh)
        self._evict_stale()
        self._note_reward_faults(stats)
        return fresh

    def _evict_stale(self) -> None:
        max_staleness = self.config.buffer.max_staleness
        if max_staleness is None:
            return
        oldest = min(self.trainer.oldest_version_within(max_staleness), self.trainer.version)
        self.counts["stale_evicted"] += self.buffer.evict_older_than(oldest)

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


class SyncFeed(Feed):
    """Generate B prompts (`searchers.prompts_per_batch` if set) with the weights just
    published, wait, and train on them."""

    def before_step(self, step: int, stop: threading.Event) -> dict[str, float]:
        start = time.time()
        if self._sync_point(step) or self.publish_next:
            self._publish()
        synced = time.time()
        per_step = self.config.searchers.prompts_per_batch or self.config.train.num_prompts
        samples, stats = self.searchers.generate(per_step)
        merged = self._merge(samples, stats)
        return stats | _arrivals(merged) | {
            "sync_seconds": synced - start,
            "wait_seconds": time.time() - synced,
        }


class AsyncFeed(Feed):
    """Searchers generate without pause; samples are merged every step, weights published every
    `sync_every` steps; the trainer never waits on a generation in flight."""

    def start(self, stop: threading.Event) -> float:
        """Publish the first weights, start the searchers and fill the buffer to
        `train.initial_buffer_samples`."""
        tc = self.config.train
        self._publish()
        self.searchers.start()
        initial = tc.initial_buffer_samples or 4 * tc.num_prompts * tc.group_size
        return self._wait(lambda: len(self.buffer) >= initial, stop)[0]

    def before_step(self, step: int, stop: threading.Event) -> dict[str, float]:
        tc = self.config.train
        start = time.time()
        if self.publish_next or (step > 1 and self._sync_point(step)):
            self._publish()  # (the first weights went out in `start`)
        synced = time.time()
        stats, merged = self._collect()
        # Only when a staleness bound emptied the buffer.
        waited, more = self._wait(lambda: len(self.buffer) > 0, stop)
        if tc.fresh_wait_s > 0:
            needed = math.ceil(self.config.buffer.recent_prob * tc.num_prompts)

            def enough_fresh() -> bool:
                return self.buffer.fresh_prompts(tc.group_size) >= needed

            extra, more_fresh = self._wait(enough_fresh, stop, timeout=tc.fresh_wait_s)
            waited, more = waited + extra, more + more_fresh
        return stats | _arrivals(merged + more) | {
            "sync_seconds": synced - start,
            "wait_seconds": waited,
        }

    def _collect(self) -> tuple[dict[str, float], list[Sample]]:
        samples, stats = self.searchers.collect(self.trainer.version)
        return stats, self._merge(samples, stats)

    def _wait(
        self, ready: Callable[[], bool], stop: threading.Event, timeout: float = math.inf
    ) -> tuple[float, list[Sample]]:
        """Collect until `ready()` (or stop, or timeout); (seconds waited, samples merged)."""
        start = time.time()
        merged: list[Sample] = []
        while not ready() and not stop.is_set() and time.time() - start < timeout:
            time.sleep(0.02)
            merged += self._collect()[1]
        return time.time() - start, merged


def _arrivals(samples: list[Sample]) -> dict[str, float]:
    """How many new samples reached the buffer for this step, and their mean reward: what the
    searchers' current policy scores (the batch's own reward mixes in replayed samples)."""
    if not samples:
        return {"samples_in": 0}
    return {"samples_in": len(samples), "reward_in": sum(s.reward for s in samples) / len(samples)}


def make_feed(
    config: RunConfig,
    searchers,
    trainer: Trainer,
    buffer: ReplayBuffer,
    log_event: Callable[..., None] = lambda kind, **fields: None,
) -> Feed:
    feed = SyncFeed if config.train.mode == "sync" else AsyncFeed
    return feed(config, searchers, trainer, buffer, log_event)
