"""End to end in this process: `tba train` builds a (tiny) base policy, trains synchronously with
the searcher in-process (no Ray), and writes its run directory."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import load_file

from tba.cli import main
from tba.config import load_config
from tba.policy.model import load_model
from tba.run_dir import read_metrics
from tba.tasks.math.build import cached_dir

FAST = [
    "train.mode=sync",
    "searchers.count=0",  # the searcher in this process: no Ray here
    "pretrain.num_examples=64",
    "pretrain.steps=4",
    "pretrain.batch_size=16",
    "task.num_train=32",
    "task.num_eval=8",
    "task.num_eval_pass_k=4",
    "eval.pass_k=2",
    "eval.every=2",
    "train.num_prompts=2",
    "train.group_size=4",
    "train.max_steps=3",
    "policy.max_new_tokens=12",
    "policy.num_threads=1",
]


@pytest.fixture
def fast_overrides(tmp_path):
    return FAST + [f"pretrain.cache_dir={tmp_path / 'cache'}"]


def test_train_writes_a_complete_run_directory(tmp_path, fast_overrides):
    run_dir = tmp_path / "run"
    assert main(["train", *fast_overrides, f"output_dir={run_dir}"]) == 0

    assert (run_dir / "config.yaml").exists()
    assert load_config(run_dir / "config.yaml").train.max_steps == 3  # the resolved config reloads
    records = read_metrics(run_dir / "metrics.jsonl")
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    expected = {"time", "loss", "reward_mean", "beta", "buffer_size", "staleness_mean"}
    assert expected <= set(steps[0])
    assert "gen_tokens_per_s" in steps[0] and "train_tokens_per_s" in steps[0]
    assert all(r["peak_memory_mib"] > 0 for r in steps)  # this process's peak RSS, per step
    assert steps[-1]["buffer_size"] == 3 * 2 * 4
    # Synchronous on-policy mode: every batch comes from the weights just published.
    assert all(r["staleness_max"] == 0 for r in steps)
    assert "eval_pass@1" in steps[1]  # eval.every=2
    summary = json.loads((run_dir / "eval.json").read_text())
    assert {"eval_pass@1", "pass@2", "sampled_pass@1"} <= set(summary["base"])
    assert summary["steps"] == 3
    assert summary["peak_memory_mib"] == max(r["peak_memory_mib"] for r in steps)
    assert (run_dir / "curves.png").stat().st_size > 0
    assert (run_dir / "final" / "config.json").exists()


def test_base_policy_is_built_once_and_cached(tmp_path, fast_overrides):
    config = load_config(None, fast_overrides)
    cached = cached_dir(config.pretrain, config.seed)
    assert main(["pretrain", *fast_overrides]) == 0
    assert (cached / "config.json").exists()
    built_at = (cached / "model.safetensors").stat().st_mtime
    assert main(["train", *fast_overrides, f"output_dir={tmp_path / 'run'}"]) == 0
    assert (cached / "model.safetensors").stat().st_mtime == built_at


def test_existing_run_directory_is_refused(tmp_path, fast_overrides, capsys):
    run_dir = tmp_path / "run"
    assert main(["train", *fast_overrides, f"output_dir={run_dir}"]) == 0
    capsys.readouterr()
    assert main(["train", *fast_overrides, f"output_dir={run_dir}"]) == 2
    assert "already holds a run" in capsys.readouterr().err


@pytest.mark.parametrize("loss", ["dr_grpo", "grpo", "rloo", "proximal_rloo", "online_dpo"])
def test_every_baseline_trains_through_the_same_pipeline(tmp_path, fast_overrides, loss):
    run_dir = tmp_path / "run"
    assert main(["train", *fast_overrides, f"train.loss={loss}", f"output_dir={run_dir}"]) == 0
    steps = [r for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]
    assert len(steps) == 3 and all(np.isfinite(r["loss"]) for r in steps)
    assert "log_z" not in steps[0]  # TB's own metric
    assert load_config(run_dir / "config.yaml").train.loss == loss


def test_snapshots_are_saved_for_evaluation_after_the_run(tmp_path, fast_overrides):
    run_dir = tmp_path / "run"
    overrides = [*fast_overrides, "eval.snapshot_minutes=0.0001", f"output_dir={run_dir}"]
    assert main(["train", *overrides]) == 0
    snapshots = [r for r in read_metrics(run_dir / "metrics.jsonl") if "snapshot" in r]
    assert [r["step"] for r in snapshots] == [1, 2, 3, 3]  # every step, and at the end
    assert all((run_dir / r["snapshot"]).exists() for r in snapshots)
    final = load_model(str(run_dir / "final"), "cpu").state_dict()
    last = load_file(run_dir / snapshots[-1]["snapshot"])
    assert all(np.array_equal(last[name], tensor.numpy()) for name, tensor in final.items())
