"""End to end on Ray, each run in its own `tba train` process (as a user runs it): the asynchronous
mode learns with two searchers, goes on past a searcher killed with SIGKILL, stops cleanly on
Ctrl-C, and leaves no process behind in any of these cases."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tba.run_dir import read_metrics

pytestmark = pytest.mark.slow

# A barely pretrained policy rarely ends its answer within 12 tokens; truncated answers get -1 and
# finished ones 0 or 1, so "learning" here is first of all learning to stop.
TINY = [
    "pretrain.num_examples=64",
    "pretrain.steps=4",
    "pretrain.batch_size=16",
    "task.num_train=64",
    "task.num_eval=8",
    "task.num_eval_pass_k=4",
    "eval.pass_k=2",
    "eval.every=1000",
    "train.num_prompts=4",
    "train.group_size=4",
    "policy.max_new_tokens=12",
    "policy.num_threads=1",
    "searchers.num_cpus=1",
]


def start_run(tmp_path: Path, *overrides: str) -> tuple[subprocess.Popen, Path]:
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "tba.cli", "train", *TINY, *overrides,
               f"pretrain.cache_dir={tmp_path / 'cache'}", f"output_dir={run_dir}"]  # fmt: skip
    # A session of its own: every process the run starts (Ray's included) carries its id.
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    return process, run_dir


def finish(process: subprocess.Popen, timeout: float = 240) -> str:
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        raise
    return output


def processes_in_session(session_id: int) -> list[str]:
    """Live processes of a session (zombies excluded), as 'pid command'."""
    found = []
    for stat_path in Path("/proc").glob("[0-9]*/stat"):
        try:
            stat = stat_path.read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "
        state, session = fields[0], int(fields[3])
        if session == session_id and state != "Z":
            found.append(f"{stat_path.parent.name} {stat[: stat.rindex(')') + 1]}")
    return found


def assert_no_process_left(session_id: int) -> None:
    deadline = time.time() + 15
    while processes_in_session(session_id) and time.time() < deadline:
        time.sleep(0.5)
    assert processes_in_session(session_id) == []


def wait_for(condition, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, "timed out"
        time.sleep(0.2)


def events(run_dir: Path) -> list[dict]:
    path = run_dir / "events.jsonl"
    return read_metrics(path) if path.exists() else []


def steps(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [r for r in read_metrics(path) if "loss" in r] if path.exists() else []


def test_async_run_with_two_searchers_learns(tmp_path):
    process, run_dir = start_run(
        tmp_path, "train.mode=async", "searchers.count=2", "train.max_steps=60",
        "train.max_minutes=null", "train.learning_rate=2e-3", "buffer.recent_prob=0.9",
        "train.sync_every=2",
    )  # fmt: skip
    output = finish(process)
    assert process.returncode == 0, output
    assert_no_process_left(process.pid)

    records = steps(run_dir)
    assert [r["step"] for r in records] == list(range(1, 61))
    rewards = np.array([r["reward_mean"] for r in records])
    # The first steps train on the base policy's samples; learning to stop takes a few steps more.
    assert rewards[-15:].mean() > rewards[:5].mean() + 0.2, rewards.round(2)
    # Both searchers delivered, with their own rates and weight-version lag.
    for i in (0, 1):
        assert any(r.get(f"searcher{i}/samples_per_s", 0) > 0 for r in records)
        assert all(r.get(f"searcher{i}/version_lag", 0) >= 0 for r in records)
    ready = [e["searcher"] for e in events(run_dir) if e["event"] == "searcher_ready"]
    assert sorted(ready) == [0, 1]
    summary = json.loads((run_dir / "eval.json").read_text())
    assert summary["mode"] == "async" and summary["searcher_restarts"] == 0
    # Off-policy: some of the trained samples came from weights older than the trainer's.
    assert sum(n for lag, n in summary["staleness_histogram"].items() if int(lag) > 0) > 0
    assert 0 <= summary["trainer_wait_frac"] < 0.5


def test_killed_searcher_is_restarted_and_the_run_goes_on(tmp_path):
    process, run_dir = start_run(
        tmp_path, "train.mode=async", "searchers.count=2", "train.max_steps=100000",
        "train.max_minutes=10",
    )  # fmt: skip

    def ready(incarnation: int) -> list[dict]:
        return [e for e in events(run_dir) if e["event"] == "searcher_ready"
                and e["searcher"] == 1 and e.get("incarnation", 0) == incarnation]  # fmt: skip

    wait_for(lambda: (ready(0) and len(steps(run_dir)) >= 3) or process.poll() is not None)
    assert process.poll() is None, finish(process)
    (victim,) = ready(0)
    os.kill(victim["pid"], signal.SIGKILL)
    killed_at_step = len(steps(run_dir))
    # Stopped (as `timeout` would) once the replacement is up and the trainer went on: on a busy
    # machine that takes what it takes, and a fixed run length would either wait or cut it short.
    wait_for(lambda: (ready(1) and len(steps(run_dir)) > killed_at_step + 5)
             or process.poll() is not None)  # fmt: skip
    os.kill(process.pid, signal.SIGTERM)
    output = finish(process)
    assert process.returncode == 143, output
    assert_no_process_left(process.pid)

    log = events(run_dir)
    restarted = [e for e in log if e["event"] == "searcher_restarted"]
    assert [e["searcher"] for e in restarted] == [1]
    assert ready(1)[0]["pid"] != victim["pid"]
    assert "searcher_restarted" in output  # said on the console too
    assert steps(run_dir)[-1]["searcher_restarts"] == 1
    assert json.loads((run_dir / "eval.json").read_text())["searcher_restarts"] == 1


def test_ctrl_c_stops_cleanly_and_leaves_no_process(tmp_path):
    process, run_dir = start_run(
        tmp_path, "train.mode=async", "searchers.count=1", "train.max_steps=100000",
        "train.max_minutes=10",
    )  # fmt: skip
    wait_for(lambda: len(steps(run_dir)) >= 3 or process.poll() is not None)
    os.killpg(process.pid, signal.SIGINT)  # what a terminal sends to the foreground group
    output = finish(process, timeout=120)
    assert process.returncode == 130, output
    assert_no_process_left(process.pid)

    summary = json.loads((run_dir / "eval.json").read_text())
    assert summary["interrupted"] is True
    assert summary["train_minutes"] < 5
    assert "eval_pass@1" in summary["final"]
    final = read_metrics(run_dir / "metrics.jsonl")[-1]
    assert final["step"] == summary["steps"] and "eval_pass@1" in final
    assert any(e["event"] == "interrupted" for e in events(run_dir))
    assert (run_dir / "final" / "config.json").exists()


def test_sigterm_saves_the_run_and_leaves_no_process(tmp_path):
    """What `timeout`, Docker and SLURM send: handled as the first Ctrl-C."""
    process, run_dir = start_run(
        tmp_path, "train.mode=async", "searchers.count=1", "train.max_steps=100000",
        "train.max_minutes=10",
    )  # fmt: skip
    wait_for(lambda: len(steps(run_dir)) >= 3 or process.poll() is not None)
    os.kill(process.pid, signal.SIGTERM)  # the trainer alone, as `timeout` sends it
    output = finish(process, timeout=120)
    assert process.returncode == 143, output
    assert_no_process_left(process.pid)
    summary = json.loads((run_dir / "eval.json").read_text())
    assert summary["interrupted"] is True and summary["stopped_by"] == "SIGTERM"
    assert (run_dir / "final" / "config.json").exists() and (run_dir / "checkpoints").is_dir()


def test_a_killed_trainer_leaves_no_process_behind(tmp_path):
    """kill -9 of the trainer alone (an OOM killer): Ray's agents would outlive it by a minute."""
    process, run_dir = start_run(
        tmp_path, "train.mode=async", "searchers.count=1", "train.max_steps=100000",
        "train.max_minutes=10",
    )  # fmt: skip
    wait_for(lambda: len(steps(run_dir)) >= 2 or process.poll() is not None)
    os.kill(process.pid, signal.SIGKILL)
    finish(process, timeout=60)
    assert_no_process_left(process.pid)


def test_a_searcher_that_stops_answering_fails_the_run_with_a_clear_error(tmp_path):
    # The timeout bounds the healthy searcher too, until it is frozen: its answers to the trainer
    # and its weight fetches. A few seconds is within what a loaded machine takes, and the run
    # then fails on its own before the freeze: the margin must be wide, and the freeze early.
    process, run_dir = start_run(
        tmp_path, "train.mode=async", "searchers.count=1", "train.max_steps=100000",
        "train.max_minutes=10", "ray.sync_timeout_s=15",
    )  # fmt: skip
    def ready() -> list[dict]:
        return [e for e in events(run_dir) if e["event"] == "searcher_ready"]

    # Up (it answered): from now on only an answer can be late.
    wait_for(lambda: ready() or process.poll() is not None)
    assert process.poll() is None, finish(process)
    searcher = ready()[-1]  # the process up now (one that died on the way was replaced)
    os.kill(searcher["pid"], signal.SIGSTOP)  # alive, but frozen: no answer, no death
    output = finish(process, timeout=120)
    assert process.returncode == 1, output
    (line,) = [line for line in output.splitlines() if line.startswith("tba: error:")]
    assert "searcher 0 has not answered for" in line and "ray.sync_timeout_s=15" in line
    assert_no_process_left(process.pid)
