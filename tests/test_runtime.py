"""The trainer's side of the runtime without Ray: when weights go out and samples come in, the
staleness bound, and the defaults that keep searchers and trainer from starving each other."""

from __future__ import annotations

import json
import os
import threading
import time

import numpy as np
import pytest

from tba.buffer import ReplayBuffer
from tba.config import load_config
from tba.core import Sample
from tba.run import trainer_threads
from tba.runtime.feed import make_feed
from tba.runtime.ray_actor import SearcherActor
from tba.runtime.ray_pool import searcher_seed
from tba.runtime.transfer import Offer
from tba.searcher import Searcher
from tba.trainer import Trainer


def sample(prompt_id: int, version: int, seq: int = 0, incarnation: int = 0) -> Sample:
    return Sample(
        prompt_id=prompt_id, prompt_ids=[1, 2], response_ids=[3], reward=1.0, ref_logp=-1.0,
        behaviour_logp=-1.0, version=version, searcher_id=0, created_at=0.0, truncated=False,
        incarnation=incarnation, seq=seq,
    )  # fmt: skip


class FakeTrainer(Trainer):
    """Versions and step counting of the real trainer, without a model."""

    def __init__(self) -> None:
        self.version, self.step_count, self.publish_steps = 0, 0, [0]

    def weights(self):
        return {"w": np.zeros(1)}


class FakeSearchers:
    """Makes one group of samples per call, with the version it was last given."""

    def __init__(self, group_size: int = 2) -> None:
        self.group_size = group_size
        self.published: list[int] = []
        self.collected_at: list[int] = []  # trainer version at each collect
        self.started = False
        self.prompt = 0
        self.seq = 0

    def publish(self, trainer) -> None:
        version, _ = trainer.publish()
        self.published.append(version)

    def start(self) -> None:
        self.started = True

    def _make(self, num_prompts: int) -> list[Sample]:
        made = []
        for _ in range(num_prompts):
            for _ in range(self.group_size):
                made.append(sample(self.prompt, self.published[-1], self.seq))
                self.seq += 1
            self.prompt += 1
        return made

    def take_reward_faults(self):
        return []

    def generate(self, num_prompts: int):
        return self._make(num_prompts), {"gen_tokens": 1}

    def collect(self, trainer_version: int):
        self.collected_at.append(trainer_version)
        return self._make(1), {"searcher0/version_lag": 0}


def versions(buffer: ReplayBuffer) -> set[int]:
    """The weight versions of the samples in the buffer."""
    return {s["version"] for _, entries in buffer.state_dict()["prompts"] for _, s in entries}


def feed_for(*overrides: str):
    config = load_config(None, ["train.num_prompts=1", "train.group_size=2", *overrides])
    trainer, searchers = FakeTrainer(), FakeSearchers()
    buffer = ReplayBuffer.from_config(config.buffer)
    return make_feed(config, searchers, trainer, buffer), trainer, searchers, buffer


def test_async_feed_merges_every_step_and_publishes_every_k_steps():
    feed, trainer, searchers, buffer = feed_for("train.mode=async", "train.sync_every=3")
    stop = threading.Event()
    feed.start(stop)
    assert searchers.started and searchers.published == [1] and len(buffer) == 8  # 4 batches
    for step in range(1, 8):
        stats = feed.before_step(step, stop)
        assert stats["wait_seconds"] < 0.05  # data is there: the trainer does not wait
        assert stats["samples_in"] == 2  # what the searcher made since the last step
        trainer.step_count += 1
    # Steps 1, 4 and 7 are sync points; the first weights went out at the start.
    assert searchers.published == [1, 2, 3]
    assert searchers.collected_at[-7:] == [1, 1, 1, 2, 2, 2, 3]
    assert max(versions(buffer)) == 3
    assert trainer.publish_steps == [0, 0, 3, 6]


def test_sync_feed_generates_every_step_with_the_weights_just_published():
    feed, trainer, searchers, buffer = feed_for("train.mode=sync", "searchers.count=0")
    stop = threading.Event()
    assert feed.start(stop) == 0.0 and not searchers.started
    for step in (1, 2):
        feed.before_step(step, stop)
        assert max(versions(buffer)) == trainer.version == step
        trainer.step_count += 1
    assert len(buffer) == 2 * 2


def test_staleness_bound_in_steps_evicts_old_samples_at_merge():
    feed, trainer, searchers, buffer = feed_for(
        "train.mode=async", "train.sync_every=2", "buffer.max_staleness=3"
    )
    stop = threading.Event()
    feed.start(stop)
    for step in range(1, 10):
        feed.before_step(step, stop)
        assert all(trainer.steps_behind(v) <= 3 for v in versions(buffer))
        trainer.step_count += 1
    assert trainer.version == 5 and feed.counts["stale_evicted"] > 0


def test_staleness_bound_below_k_keeps_the_newest_weights():
    feed, trainer, searchers, buffer = feed_for(
        "train.mode=async", "train.sync_every=5", "buffer.max_staleness=0"
    )
    stop = threading.Event()
    feed.start(stop)
    for step in range(1, 5):
        assert feed.before_step(step, stop)["wait_seconds"] < 0.05
        assert len(buffer) > 0 and max(versions(buffer)) == trainer.version
        trainer.step_count += 1


def test_feed_drops_duplicates_and_counts_gaps():
    feed, trainer, searchers, buffer = feed_for("train.mode=sync", "searchers.count=0")
    trainer.publish()
    feed._merge([sample(0, 1, seq) for seq in (0, 1, 2)], {})
    feed._merge([sample(0, 1, seq) for seq in (2, 3, 6)], {})  # 2 again; 4 and 5 never arrived
    feed._merge([sample(1, 1, 0, incarnation=1)], {})  # a restarted searcher numbers from 0
    assert len(buffer) == 6
    assert feed.counts["merged"] == 6
    assert feed.counts["duplicates"] == 1 and feed.counts["lost"] == 2
    restored = feed_for("train.mode=sync", "searchers.count=0")[0]
    restored.load_state_dict(feed.state_dict())
    restored._merge([sample(0, 1, 6)], {})
    assert restored.counts["duplicates"] == 2


def test_trainer_leaves_the_searchers_their_cores(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    assert trainer_threads(load_config(None, ["searchers.count=3"])) == 5
    assert trainer_threads(load_config(None, ["searchers.count=16"])) == 1
    assert trainer_threads(load_config(None, ["policy.num_threads=3"])) == 3
    # Synchronous: searchers idle while the trainer steps, so it takes every core.
    assert trainer_threads(load_config(None, ["train.mode=sync"])) is None
    # On a cluster the searchers are elsewhere.
    assert trainer_threads(load_config(None, ["ray.address=10.0.0.1:6379"])) is None


@pytest.mark.parametrize("seed", [0, 7])
def test_every_searcher_and_restart_has_its_own_stream(seed):
    seeds = {searcher_seed(seed, i, incarnation) for i in range(4) for incarnation in range(3)}
    assert len(seeds) == 12
    assert searcher_seed(seed, 1, 0) == searcher_seed(seed, 1, 0)


# --------------------------------------------------------------- the searcher process, in-process


def always_one(prompts, completions, **columns):
    return [1.0] * len(completions)


def test_a_searcher_samples_at_the_searchers_temperature_when_set(tiny_model, tokenizer):
    def sample_temperature(*overrides: str) -> float:
        config = load_config(None, ["policy.temperature=0.9", *overrides])
        return Searcher(tiny_model, tokenizer, [{"prompt": "Q\n"}], [always_one],
                        config).sample_temperature  # fmt: skip

    assert sample_temperature() == 0.9  # the policy's
    assert sample_temperature("searchers.temperature=1.5") == 1.5


@pytest.fixture
def worker(tmp_path, tiny_model, tokenizer):
    tiny_model.save_pretrained(tmp_path / "policy")
    tokenizer.save_pretrained(tmp_path / "policy")
    config = load_config(None, ["train.group_size=3", "policy.max_new_tokens=4",
                                "policy.dtype=float32"])  # fmt: skip
    rows = [{"prompt": f"Q{i}\n", "answer": str(i)} for i in range(5)]
    worker = SearcherActor(
        str(tmp_path / "policy"), rows, [always_one], config, searcher_id=1, seed=0,
        device="cpu", num_threads=1, weights_timeout_s=5,
    )  # fmt: skip
    yield worker
    worker.stop()


def test_searcher_loop_hands_over_each_sample_once_and_bounds_its_outbox(worker):
    # Version 0 is what the worker loaded, so nothing is fetched from an object store here.
    worker.start(prompts_per_batch=2, max_unsent=12, offer=Offer(0, 0))
    handed: list[Sample] = []
    deadline = time.time() + 30
    while len(handed) < 30 and time.time() < deadline:
        result = worker.collect()
        handed += result["samples"]
        assert result["pid"] == os.getpid() and result["version"] == 0
        time.sleep(0.01)
    assert len(handed) >= 30
    assert len({id(s) for s in handed}) == len(handed)  # nothing handed over twice
    assert [s.seq for s in handed] == list(range(len(handed)))  # numbered in order, no gaps
    assert result["stream_taken"] == len(handed) // 3  # prompts of the batches handed over
    assert all(s.searcher_id == 1 and len(s.response_ids) <= 4 for s in handed)
    # Nobody collects: the loop pauses once the outbox is full (one batch may be in flight).
    time.sleep(2.0)
    first = worker.collect()
    time.sleep(1.0)
    second = worker.collect()
    assert len(first["samples"]) <= 12 + 2 * 3
    assert first["idle_seconds"] + second.get("idle_seconds", 0) > 0.5


def test_a_closed_ledger_is_final_while_the_loop_goes_on(worker, tmp_path):
    """A searcher about to be killed writes no more batches in its ledger: the trainer reads what
    it made once, and counts the rest of it as handed over or discarded, never in neither."""
    ledger = tmp_path / "searcher1-0.json"
    worker.ledger_path = str(ledger)
    worker.start(prompts_per_batch=1, max_unsent=100, offer=Offer(0, 0))
    deadline = time.time() + 30
    while not ledger.exists() and time.time() < deadline:
        time.sleep(0.01)
    worker.close_ledger()
    final = json.loads(ledger.read_text())
    made = worker.searcher.num_generated
    while worker.searcher.num_generated < made + 6 and time.time() < deadline:
        time.sleep(0.01)
    assert worker.searcher.num_generated >= made + 6  # the loop went on ...
    assert json.loads(ledger.read_text()) == final  # ... and its ledger did not
    assert final["generated"] >= 3


def test_searcher_loop_failure_is_reported_by_collect(worker):
    def broken(prompts, completions, **columns):
        raise ValueError("reward server down")

    worker.searcher.scorer.reward_fns = [broken]
    worker.start(prompts_per_batch=1, max_unsent=10, offer=Offer(0, 0))
    deadline = time.time() + 30
    # Each failed call only drops its completions; five in a row stop the loop.
    match = "^RewardError: reward function 'broken' failed on its last 5 calls.*reward server down"
    with pytest.raises(RuntimeError, match=match):
        while time.time() < deadline:
            worker.collect()
            time.sleep(0.05)



@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_stop_before_the_step_has_data_gives_no_step(mode):
    """A SIGTERM between two steps: the next step has no samples and is not taken (in the
    synchronous mode nothing of the new weights; in the asynchronous one, an empty buffer)."""
    overrides = ["searchers.count=0"] if mode == "sync" else []
    feed, trainer, searchers, buffer = feed_for(f"train.mode={mode}", *overrides)
    stop = threading.Event()
    feed.start(stop)
    assert feed.before_step(1, stop) is not None
    trainer.step_count += 1
    stop.set()
    if mode == "async":
        searchers.collect = lambda version: ([], {})
        buffer.evict_older_than(trainer.version + 1)
    assert feed.before_step(2, stop) is None
