"""The synchronous mode with its searcher in the trainer's process samples with the trainer's own
module: one copy of the policy, nothing copied through numpy at a sync, the same samples as a
separate copy loaded with the trainer's weights."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from tba.buffer import ReplayBuffer
from tba.config import TrainConfig, load_config
from tba.policy.engines import BuiltinEngine
from tba.policy.model import get_weights, load_policy, set_weights
from tba.runtime import placement
from tba.runtime.feed import make_feed
from tba.runtime.launch import open_searchers, open_trainer
from tba.runtime.placement import shares_trainer_model
from tba.tasks.math.task import math_task
from tba.trainer import Trainer

OVERRIDES = ["train.mode=sync", "searchers.count=0", "train.num_prompts=2",
             "train.group_size=4", "policy.max_new_tokens=8", "train.learning_rate=1e-3",
             "policy.device=cpu", "searchers.device=cpu"]  # fmt: skip


@pytest.fixture
def policy_dir(tiny_model, tokenizer, tmp_path):
    tiny_model.save_pretrained(tmp_path / "policy")
    tokenizer.save_pretrained(tmp_path / "policy")
    return tmp_path / "policy"


def run_steps(config, policy_dir, tokenizer, tmp_path, steps, on_searchers=None):
    task = math_task(num_train=16, num_eval=2, seed=0)
    log = lambda *args, **fields: None  # noqa: E731
    with (
        open_trainer(config, policy_dir, tokenizer.pad_token_id, log, steps + 1) as trainer,
        open_searchers(config, policy_dir, tokenizer, task, log, tmp_path, None,
                       trainer) as searchers,
    ):  # fmt: skip
        buffer = ReplayBuffer.from_config(config.buffer)
        feed = make_feed(config, searchers, trainer, buffer)
        stop, rng = threading.Event(), np.random.default_rng(0)
        for step in range(1, steps + 1):
            feed.before_step(step, stop)
            batch = buffer.sample(config.train.num_prompts, config.train.group_size, rng)
            trainer.step(batch.groups, beta=0.1)
        if on_searchers is not None:
            on_searchers(trainer, searchers, feed, buffer)
    return trainer, searchers


def test_the_searcher_samples_with_the_trainers_module_and_no_numpy(
    policy_dir, tokenizer, tmp_path, monkeypatch
):
    numpy_calls = []
    original = torch.Tensor.numpy

    def counted(self, *args, **kwargs):
        numpy_calls.append(tuple(self.shape))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "numpy", counted)
    config = load_config(None, OVERRIDES)
    trainer, searchers = run_steps(config, policy_dir, tokenizer, tmp_path, steps=3)
    assert searchers.searcher.policy is trainer.model and searchers.searcher.shares_trainer_model
    assert numpy_calls == []
    assert trainer.model.training  # the searcher left it as the trainer needs it
    assert all(p.requires_grad for p in trainer.model.parameters())
    assert trainer.version == 3 and searchers.searcher.version == 3


def test_after_three_steps_it_samples_what_a_fresh_copy_with_the_trainers_weights_does(
    policy_dir, tokenizer, tmp_path
):
    config = load_config(None, OVERRIDES)

    def compare(trainer, searchers, feed, buffer):
        searcher = searchers.searcher
        rng_state = searcher.engine.state_dict()
        newest = []
        feed.on_merge.append(newest.extend)
        assert feed.before_step(4, threading.Event()) is not None  # publishes, then samples
        assert {s.version for s in newest} == {4}
        fresh = load_policy(str(policy_dir), "cpu")
        set_weights(fresh, get_weights(trainer.model))
        engine = BuiltinEngine(fresh, tokenizer.eos_token_id, tokenizer.pad_token_id, seed=0)
        engine.load_state_dict(rng_state)
        out = engine.generate([s.prompt_ids for s in newest],
                              max_new_tokens=config.policy.max_new_tokens,
                              temperature=config.policy.temperature)  # fmt: skip
        assert out.response_ids == [s.response_ids for s in newest]
        assert out.logps == pytest.approx([s.behaviour_logp for s in newest], abs=1e-5)

    run_steps(config, policy_dir, tokenizer, tmp_path, steps=3, on_searchers=compare)


def test_it_keeps_its_own_copy_where_sharing_would_change_the_samples(tiny_model, monkeypatch):
    """Sharing needs the trainer in this process, on the searcher's device, and a publish before
    every generation."""
    trainer = Trainer(tiny_model.train(), TrainConfig(learning_rate=1e-3, max_grad_norm=1.0),
                      pad_id=0, temperature=1.0)  # fmt: skip
    config = load_config(None, OVERRIDES)
    assert shares_trainer_model(config, trainer)
    assert not shares_trainer_model(load_config(None, [*OVERRIDES, "train.sync_every=2"]), trainer)
    monkeypatch.setattr(placement, "searcher_device", lambda config: torch.device("meta"))
    assert not shares_trainer_model(config, trainer)  # the searcher's device is another
