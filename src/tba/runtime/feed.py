"""How fresh samples reach the trainer's buffer: the one place the two training modes differ.

- **async** (TBA, `AsyncFeed`): publish the first weights and start the searchers once; they
  generate without pause, each with the latest weights it has adopted. The trainer starts once the
  buffer holds `train.initial_buffer_samples`. Then, every step, merge whatever the searchers made
  since the step before (a non-blocking call: samples reach the buffer as soon as they exist, not
  only at syncs), and every `train.sync_every` steps publish the current weights. The trainer
  never waits on a generation in flight: only while the buffer is empty (before the first batch,
  or after the staleness bound evicted everything) or, with `train.fresh_wait_s`, briefly for
  fresh prompts.
- **sync** (on-policy baseline, same components, `SyncFeed`): every step, publish the weights
  (every `sync_every` steps) and have the searchers generate B prompts with them; the trainer
  waits for that batch (with the default `recent_prob=1` and `sync_every=1` it trains on exactly
  the samples just made).

Both enforce the buffer's `max_staleness`, in optimizer steps: samples of weights published more
than that many steps ago are evicted as they become too old (the newest published weights are
always kept, so a bound below `sync_every` cannot starve the trainer).

Every sample is named by (searcher, incarnation, seq), and each searcher process numbers its
samples 0, 1, 2, ...; the feed checks that numbering as it merges, so a sample handed over twice
is dropped and counted as a duplicate, and one never handed over is counted as lost. Both must
stay 0; `state_dict()` keeps the numbering across a checkpoint.
"""

from __future__ import annotations

import math
import os
import threading
import time
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from tba.buffer import ReplayBuffer
from tba.config import RunConfig
from tba.core import EventLogger, Sample
from tba.runtime.ray_cluster import cluster_address
from tba.runtime.searchers import AsyncSearchers, Searchers
from tba.trainer import Trainer


class Feed(ABC):
    """What both modes share: merging with the numbering checks, the staleness bound, reward
    faults, and the state a checkpoint keeps."""

    MAX_FAULT_KINDS_LOGGED = 20

    def __init__(
        self,
        config: RunConfig,
        searchers: Searchers,
        trainer: Trainer,
        buffer: ReplayBuffer,
        log_event: EventLogger = lambda kind, **fields: None,
    ):
        self.config = config
        self.searchers = searchers
        self.trainer = trainer
        self.buffer = buffer
        self.log_event = log_event
        self.counts: Counter[str] = Counter()
        self.reward_faults: Counter[str] = Counter()  # "function: reason" -> completions dropped
        self.next_seq: dict[tuple[int, int], int] = {}  # (searcher, incarnation) -> next seq
        self.sync_next = False  # a resumed run syncs weights at its first step, whatever k
        self.resumed = False
        self.on_merge: list[Callable[[list[Sample]], None]] = []  # see every new sample

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
        self.sync_next = True
        self.resumed = True

    @staticmethod
    def trainer_threads(config: RunConfig) -> int | None:
        """Torch threads for the trainer (None: torch's default, every core)."""
        return None

    def start(self, stop: threading.Event) -> float:
        """Get ready to train; returns the seconds spent waiting for data."""
        return 0.0

    @abstractmethod
    def before_step(self, step: int, stop: threading.Event) -> dict[str, float] | None:
        """Bring new samples in for this step; metrics of what it took, or None when `stop`
        came before the step had anything to train on."""

    def _sync_point(self, step: int) -> bool:
        return (step - 1) % self.config.train.sync_every == 0

    def _sync_weights(self) -> None:
        """The trainer's weights as a new version for every searcher (`Searchers.publish`:
        through the weight transports, a copy, or nothing where they sample with the trainer's
        own module)."""
        self.searchers.publish(self.trainer)
        self.sync_next = False

    def _merge(self, samples: list[Sample], stats: dict[str, float]) -> list[Sample]:
        """Add the samples not merged before; returns them."""
        fresh = [s for s in samples if self._first_time(s)]
        for listener in self.on_merge if fresh else ():
            listener(fresh)
        self.counts["merged"] += len(fresh)
        self.counts["rollouts"] += sum(s.rollouts for s in fresh)  # VinePPO's value estimates
        self.counts["capacity_evicted"] += self.buffer.add(fresh)
        self._evict_stale()
        self._note_reward_faults(stats)
        return fresh

    def _evict_stale(self) -> None:
        if self.buffer.max_staleness is not None:
            oldest = self.trainer.oldest_version_within(self.buffer.max_staleness)
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
        unscored = int(stats.get("reward_unscored", 0))
        if unscored and not self.counts["reward_unscored"]:  # said once, as TRL warns
            self.log_event("reward_unscored", completions=unscored,
                           why="every reward function returned None for them: they are dropped; "
                           "the count goes on in eval.json (reward_unscored)")  # fmt: skip
        self.counts["reward_unscored"] += unscored
        for name, reason, dropped in self.searchers.take_reward_faults():
            kind = f"{name}: {reason}"
            new_kind = kind not in self.reward_faults
            if new_kind and len(self.reward_faults) < self.MAX_FAULT_KINDS_LOGGED:
                self.log_event("reward_fault", function=name, reason=reason, dropped=dropped)
            self.reward_faults[kind] += dropped


class SyncFeed(Feed):
    """The synchronous mode: B prompts (`searchers.prompts_per_batch` if set) generated with the
    weights just published, every step. A generation that keeps no sample (its rewards failed,
    say) is followed by another one, on the next prompts: the step trains on samples of these
    weights. The searchers stop the run after `searchers.max_reward_failures` such generations
    in a row.

    With `train.sync_generate=when_needed`, a step generates only while the buffer holds fewer
    groups of fresh samples than the batch takes (m*B): a generation larger than a step's batch
    serves the next steps too (their samples are then a step or more behind), and one smaller
    is repeated until the batch is fresh, so that no group is replayed unless `recent_prob`
    asks for it (TRL's `generation_batch_size` and `num_iterations`)."""

    def before_step(self, step: int, stop: threading.Event) -> dict[str, float] | None:
        start = time.time()
        if self._sync_point(step) or self.sync_next:
            self._sync_weights()
        synced = time.time()
        per_step = self.config.searchers.prompts_per_batch or self.config.train.num_prompts
        merged: list[Sample] = []
        stats: dict[str, float] = {}
        generations = stalled = 0
        while self._wants_samples(merged, stalled):
            if stop.is_set():  # (a SIGTERM between two steps): no samples of these weights
                return None
            fresh = self.buffer.fresh_groups(self.config.train.group_size)
            samples, stats = self.searchers.generate(per_step)
            merged += self._merge(samples, stats)
            generations += 1
            grew = self.buffer.fresh_groups(self.config.train.group_size) > fresh
            stalled = 0 if grew else stalled + 1
        return stats | _arrivals(merged) | {
            "generations": generations,
            "sync_seconds": synced - start,
            "wait_seconds": time.time() - synced,
        }

    def _wants_samples(self, merged: list[Sample], stalled: int) -> bool:
        """`every_step`: until a generation kept a sample. `when_needed`: while the buffer holds
        fewer groups of fresh samples than the batch takes (m*B, `buffer.recent_prob` m);
        generations that add none (every sample a duplicate the buffer turns away) stop after
        `searchers.max_reward_failures` in a row, and the batch fills from replay."""
        tc = self.config.train
        if tc.sync_generate == "every_step":
            return not merged
        if stalled >= self.config.searchers.max_reward_failures:
            return False
        wanted = max(1, math.ceil(self.buffer.recent_prob * tc.num_prompts))
        return self.buffer.fresh_groups(tc.group_size) < wanted


class AsyncFeed(Feed):
    """The asynchronous mode: whatever the searchers made, merged every step."""

    searchers: AsyncSearchers

    @staticmethod
    def trainer_threads(config: RunConfig) -> int | None:
        """The cores the searchers do not reserve on this machine (else the trainer starves them
        and keeps stepping on ever staler samples). On a cluster, where they run is known once
        they report: see `start`."""
        if cluster_address(config) is not None:
            return None
        sc = config.searchers
        return max(1, (os.cpu_count() or 1) - math.ceil(sc.count * sc.num_cpus))

    def start(self, stop: threading.Event) -> float:
        """Publish the first weights, start the searchers and fill the buffer to
        `train.initial_buffer_samples`. A resumed run, whose buffer is already full, waits for a
        batch of new samples from its restarted searchers instead: training on the checkpoint's
        samples alone while they start would replay old samples for tens of steps, which the
        uninterrupted run, with new samples arriving every step, never did. On a cluster, the
        trainer then takes the cores that the searchers on its own machine do not reserve."""
        tc = self.config.train
        self._sync_weights()
        self.searchers.start()
        if self.resumed:
            target = self.counts["merged"] + tc.num_prompts * tc.group_size
            waited = self._wait(lambda: self.counts["merged"] >= target, stop)[0]
        else:
            initial = tc.initial_buffer_samples or 4 * tc.num_prompts * tc.group_size
            waited = self._wait(lambda: len(self.buffer) >= initial, stop)[0]
        if cluster_address(self.config) is not None and self.config.policy.num_threads is None:
            beside = math.ceil(self.searchers.cpus_beside_trainer())
            threads = max(1, (os.cpu_count() or 1) - beside)
            torch.set_num_threads(threads)
            self.log_event("trainer_threads", threads=threads, searcher_cpus_here=beside)
        return waited

    def before_step(self, step: int, stop: threading.Event) -> dict[str, float] | None:
        tc = self.config.train
        start = time.time()
        if self.sync_next or (step > 1 and self._sync_point(step)):
            self._sync_weights()  # (the first weights went out in `start`)
        synced = time.time()
        stats, merged = self._collect()
        # Only when a staleness bound emptied the buffer.
        waited, more = self._wait(lambda: len(self.buffer) > 0, stop)
        if len(self.buffer) == 0:  # stopped while waiting
            return None
        if tc.fresh_wait_s > 0:
            needed = math.ceil(self.buffer.recent_prob * tc.num_prompts)

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
    """How many new samples reached the buffer for this step, their mean reward (what the
    searchers' current policy scores; the batch's own reward mixes in replayed samples), and the
    mean and standard deviation of each reward function's values (`rewards/NAME/mean`, `/std`,
    as TRL names them), over the samples it scored, and the means of what reward functions
    logged with `log_metric`. With VinePPO, also the rollouts generated to estimate the values of
    their steps (`rollouts_in`): generated samples too."""
    if not samples:
        return {"samples_in": 0}
    mean_reward = sum(s.reward for s in samples) / len(samples)
    arrivals = {"samples_in": len(samples), "reward_in": mean_reward}
    if rollouts := sum(s.rollouts for s in samples):
        arrivals["rollouts_in"] = rollouts
    names = dict.fromkeys(name for s in samples for name in s.reward_parts)
    for name in names:
        values = [s.reward_parts[name] for s in samples if name in s.reward_parts]
        arrivals[f"rewards/{name}/mean"] = float(np.mean(values))
        arrivals[f"rewards/{name}/std"] = float(np.std(values))
    for name in dict.fromkeys(name for s in samples for name in s.reward_metrics):
        arrivals[name] = float(np.mean([s.reward_metrics[name] for s in samples
                                        if name in s.reward_metrics]))  # fmt: skip
    return arrivals


FEEDS: dict[str, type[Feed]] = {"sync": SyncFeed, "async": AsyncFeed}  # by `train.mode`


def make_feed(
    config: RunConfig,
    searchers: Searchers,
    trainer: Trainer,
    buffer: ReplayBuffer,
    log_event: EventLogger = lambda kind, **fields: None,
) -> Feed:
    return FEEDS[config.train.mode](config, searchers, trainer, buffer, log_event)
