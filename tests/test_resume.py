"""Checkpoints and `tba train --resume`: a synchronous run killed with SIGKILL and resumed logs the
same metrics as one that was never interrupted; an asynchronous one continues with its replay
buffer restored, every sample merged before the checkpoint back and none twice."""

from __future__ import annotations

import json
import math
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from test_async_e2e import TINY
from test_train_e2e import FAST

from tba.buffer import ReplayBuffer
from tba.checkpoint import check_compatible, latest_checkpoint, list_checkpoints, save_checkpoint
from tba.cli import main
from tba.config import TrainConfig, load_config
from tba.core import Sample
from tba.errors import CheckpointError
from tba.policy.model import frozen_copy
from tba.rng import RandomState
from tba.run_dir import read_metrics
from tba.trainer import Trainer

# Values that must match between an uninterrupted and a resumed run (timings need not).
COMPARED = ("loss", "reward_mean", "grad_norm", "beta", "log_z", "kl", "buffer_size",
            "staleness_mean", "eval_pass@1", "response_length", "truncated_frac")  # fmt: skip


def step_records(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r}


def start(command: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "tba.cli", *command], stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip


def kill_after_checkpoint(process: subprocess.Popen, run_dir: Path, timeout: float = 180) -> int:
    """SIGKILL the run's whole process group once its first periodic checkpoint is complete."""
    deadline = time.time() + timeout
    while not list_checkpoints(run_dir):
        assert process.poll() is None, process.stdout.read()
        assert time.time() < deadline, "no checkpoint in time"
        time.sleep(0.02)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    return latest_checkpoint(run_dir).step


# -------------------------------------------------------------------------------- sync, exact


@pytest.mark.slow
def test_sync_run_killed_and_resumed_matches_an_uninterrupted_one(tmp_path):
    common = [*FAST, f"pretrain.cache_dir={tmp_path / 'cache'}", "train.max_steps=30",
              "train.max_minutes=null", "checkpoint.every=5", "eval.every=5",
              "train.beta_end=0.01"]  # fmt: skip
    reference, resumed = tmp_path / "reference", tmp_path / "resumed"
    assert main(["train", *common, f"output_dir={reference}"]) == 0

    process = start(["train", *common, f"output_dir={resumed}"])
    killed_at = kill_after_checkpoint(process, resumed)
    assert not (resumed / "eval.json").exists(), "the run ended before it could be killed"
    assert main(["train", "--resume", str(resumed)]) == 0

    expected, got = step_records(reference), step_records(resumed)
    assert sorted(got) == list(range(1, 31)) and killed_at < 30
    for step, record in expected.items():
        for key in COMPARED:
            if key in record:
                assert got[step][key] == pytest.approx(record[key], rel=1e-6, abs=1e-7), (step, key)
    summaries = [json.loads((d / "eval.json").read_text()) for d in (reference, resumed)]
    assert summaries[0]["final"] == summaries[1]["final"]
    assert summaries[1]["samples_merged"] == summaries[0]["samples_merged"]
    events = [json.loads(line) for line in (resumed / "events.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e["event"] == "resumed"] == [killed_at]


# ------------------------------------------------------------------------ async, buffer restored


@pytest.mark.slow
def test_async_run_resumes_with_its_buffer_and_no_sample_twice(tmp_path):
    run_dir = tmp_path / "run"
    common = [*TINY, f"pretrain.cache_dir={tmp_path / 'cache'}", f"output_dir={run_dir}",
              "train.mode=async", "searchers.count=1", "checkpoint.every=4",
              "train.max_minutes=null"]  # fmt: skip
    process = start(["train", *common, "train.max_steps=100000"])
    killed_at = kill_after_checkpoint(process, run_dir, timeout=240)
    checkpoint = latest_checkpoint(run_dir)
    before = {(s.searcher_id, s.incarnation, s.seq) for s in _samples(checkpoint.state["buffer"])}
    assert before and checkpoint.step == killed_at

    # The resumed trainer waits for a batch of new samples from its restarted searcher before
    # its first step, rather than replaying the checkpoint's samples alone.
    assert main(["train", "--resume", str(run_dir), f"train.max_steps={killed_at + 6}"]) == 0
    first = next(r for r in read_metrics(run_dir / "metrics.jsonl") if r["step"] == killed_at + 1)
    assert first["fresh_groups"] > 0 and first["staleness_steps_max"] <= 1
    summary = json.loads((run_dir / "eval.json").read_text())
    final = latest_checkpoint(run_dir)
    assert final.step == killed_at + 6 == summary["steps"]
    after = [(s.searcher_id, s.incarnation, s.seq) for s in _samples(final.state["buffer"])]
    assert len(after) == len(set(after)), "a sample was merged twice"
    assert before <= set(after), "a sample merged before the checkpoint is missing"
    new_incarnations = {inc for _, inc, _ in set(after) - before}
    assert new_incarnations and min(new_incarnations) > max(inc for _, inc, _ in before)
    assert summary["samples_duplicated"] == 0 and summary["samples_lost"] == 0
    # What the killed run's searchers made after the checkpoint is work lost, counted apart.
    assert summary["samples_generated"] == summary["samples_merged"] + summary[
        "samples_discarded_in_flight"
    ]
    assert summary["samples_discarded_in_flight"] > 0


def _samples(buffer_state: dict) -> list[Sample]:
    return [Sample.from_dict(sample) for _, entries in buffer_state["prompts"]
            for _, sample in entries]  # fmt: skip


# --------------------------------------------------------------------------- bad resumes


def test_resume_refuses_what_it_cannot_continue(tmp_path, capsys):
    assert main(["train", "--resume", str(tmp_path / "nothing")]) == 2
    assert "no run there" in capsys.readouterr().err

    run_dir = tmp_path / "run"
    common = [*FAST, f"pretrain.cache_dir={tmp_path / 'cache'}", f"output_dir={run_dir}"]
    assert main(["train", *common, "train.max_steps=2"]) == 0
    capsys.readouterr()
    # Resumed as it was, a finished run would train nothing: said in one line, nothing written.
    metrics = (run_dir / "metrics.jsonl").read_text()
    assert main(["train", "--resume", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert f"run {run_dir} already reached its limit, train.max_steps=2 (step 2)" in err
    assert f"tba train --resume {run_dir} train.max_steps=4" in err
    assert (run_dir / "metrics.jsonl").read_text() == metrics
    assert main(["train", "--resume", str(run_dir), "task.num_train=64"]) == 2
    err = capsys.readouterr().err
    assert "was written with task.num_train=32 (this run: 64)" in err and "num_eval" not in err
    assert main(["train", "--resume", str(run_dir), "seed=1"]) == 2
    assert "seed=0" in capsys.readouterr().err

    # A finished run can be continued for more steps.
    assert main(["train", "--resume", str(run_dir), "train.max_steps=4"]) == 0
    assert sorted(step_records(run_dir)) == [1, 2, 3, 4]

    for checkpoint in list_checkpoints(run_dir):
        (checkpoint / "model.safetensors").write_bytes(b"not a tensor file")
    assert main(["train", "--resume", str(run_dir), "train.max_steps=5"]) == 2
    assert "cannot read checkpoint" in capsys.readouterr().err


def test_check_compatible_names_the_setting():
    saved = {"seed": 0, "policy": {"model": "a"}, "task": {"name": "math"}}
    check_compatible(saved, saved, Path("ckpt"))
    changed = {**saved, "policy": {"model": "b"}}
    with pytest.raises(CheckpointError, match=r"policy.model='a' \(this run: 'b'\)"):
        check_compatible(saved, changed, Path("ckpt"))


def test_a_quantized_base_resumes_only_as_it_was_quantized():
    """A QLoRA checkpoint holds only adapters, trained on the quantized base: the same base
    again, and a run written before the quantization section was at full weights."""
    config = load_config(None, ["lora.r=8"]).model_dump()
    qlora = load_config(None, ["lora.r=8", "quantization.bits=4"]).model_dump()
    with pytest.raises(CheckpointError, match=r"quantization.bits=4 \(this run: 0\)"):
        check_compatible(qlora, config, Path("ckpt"))
    older = {key: value for key, value in config.items() if key != "quantization"}
    check_compatible(older, config, Path("ckpt"))
    with pytest.raises(CheckpointError, match=r"quantization.bits=0 \(this run: 4\)"):
        check_compatible(older, qlora, Path("ckpt"))


def test_check_compatible_names_only_the_task_settings_that_differ():
    task = load_config(None, []).model_dump()["task"]
    saved = {"seed": 0, "task": task}
    # How the run is measured may change: the held-out set's size, the reward models' batches.
    check_compatible(saved, {**saved, "task": {**task, "num_eval": 7, "num_eval_pass_k": 3,
                                               "reward_batch_size": 2}}, Path("ckpt"))  # fmt: skip
    changed = {**saved, "task": {**task, "num_train": 9, "num_eval": 7,
                                 "redteam": {**task["redteam"], "victim_samples": 2}}}  # fmt: skip
    with pytest.raises(CheckpointError) as error:
        check_compatible(saved, changed, Path("ckpt"))
    message = str(error.value)
    assert "task.num_train=5000 (this run: 9)" in message
    assert "task.redteam.victim_samples=5 (this run: 2)" in message
    assert "num_eval" not in message and len(message) < 400


# ------------------------------------------------------------------------ the pieces, exactly


def test_trainer_state_round_trips_exactly_through_a_checkpoint(tmp_path, tiny_model, tokenizer):
    prompt = tokenizer("Q\n")["input_ids"]
    group = [Sample(0, prompt, tokenizer(t, add_special_tokens=False)["input_ids"], reward=r,
                    ref_logp=-2.0, behaviour_logp=-2.0, version=0,
                    behaviour_token_logps=[-2.0 / len(t)] * len(t))
             for t, r in [("1", 1.0), ("22", 0.0)]]  # fmt: skip

    def trainer(model):
        return Trainer(model, TrainConfig(learning_rate=1e-2, max_grad_norm=1.0, warmup_steps=3),
                       pad_id=tokenizer.pad_token_id, temperature=1.0)  # fmt: skip

    first = trainer(frozen_copy(tiny_model).requires_grad_(True))
    first.step([group], beta=0.1)
    first.publish()
    state = {"trainer": first.state_dict(), "buffer": ReplayBuffer(1).state_dict()}
    save_checkpoint(tmp_path, 1, state, keep=1)  # the two trainers must share no tensor
    second = trainer(frozen_copy(tiny_model).requires_grad_(True))
    second.load_state_dict(latest_checkpoint(tmp_path).state["trainer"])
    assert (second.version, second.step_count) == (1, 1)
    assert second.schedule.get_last_lr() == first.schedule.get_last_lr()
    a, b = first.step([group], beta=0.1), second.step([group], beta=0.1)
    assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"]
    for p, q in zip(first.model.parameters(), second.model.parameters()):
        assert torch.equal(p, q)


def test_random_state_round_trips_through_json():
    state = RandomState(3)
    saved = json.loads(json.dumps(state.state_dict()))
    sampler = state.sampler
    expected = (sampler.random(), random.random(), np.random.rand(), torch.rand(1).item())
    state.load_state_dict(saved)
    assert (sampler.random(), random.random(), np.random.rand(), torch.rand(1).item()) == expected


def test_checkpoints_are_atomic_and_pruned(tmp_path):
    buffer = ReplayBuffer(10)
    buffer.add([Sample(1, [1], [2], reward=0.5, ref_logp=-1.0, behaviour_logp=-1.0, version=0)])
    trainer = {"model": {"w": torch.ones(2)}, "optimizer": {}, "version": 1}
    for step in (1, 2, 3):
        state = {"trainer": trainer, "buffer": buffer.state_dict(), "x": step}
        save_checkpoint(tmp_path, step, state, keep=2)
    (tmp_path / "checkpoints" / ".partial-step000004").mkdir()  # a write cut short
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step000002", "step000003"]
    latest = latest_checkpoint(tmp_path)
    assert latest.step == 3 and latest.state["x"] == 3
    assert latest.state["buffer"] == buffer.state_dict()
    assert latest.state["trainer"]["version"] == 1
    assert math.isclose(float(latest.state["trainer"]["model"]["w"][0]), 1.0)
