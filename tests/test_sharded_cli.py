"""`tba train trainer.world_size=2` end to end, each run its own process: the ranks are Ray
actors sharding the tiny policy with FSDP2 over gloo. A synchronous run stopped and resumed from
its sharded checkpoint logs the same metrics as one that was not; an asynchronous run whose rank
is killed ends in one line naming it, keeps its checkpoint and leaves no process behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from test_async_e2e import (
    TINY,
    assert_no_process_left,
    events,
    finish,
    start_run,
    steps,
    wait_for,
)
from test_resume import COMPARED, step_records

from tba.checkpoint import latest_checkpoint

pytestmark = pytest.mark.slow

SHARDED = ["trainer.world_size=2", "checkpoint.every=2", "train.max_minutes=null"]


def tba(*arguments: str) -> tuple[int, str]:
    done = subprocess.run([sys.executable, "-m", "tba.cli", *arguments], capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    return done.returncode, done.stdout + done.stderr


def test_sharded_sync_run_resumed_matches_an_uninterrupted_one(tmp_path):
    common = [*TINY, *SHARDED, "train.mode=sync", "searchers.count=0", "eval.every=2",
              f"pretrain.cache_dir={tmp_path / 'cache'}"]  # fmt: skip
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    code, output = tba("train", *common, "train.max_steps=4", f"output_dir={straight}")
    assert code == 0, output
    code, output = tba("train", *common, "train.max_steps=2", f"output_dir={stopped}")
    assert code == 0, output
    assert (latest_checkpoint(stopped).path / "trainer" / ".metadata").is_file()
    (ready,) = [e for e in events(stopped) if e["event"] == "trainer_ranks_ready"]
    assert ready["world_size"] == 2 and len({rank["pid"] for rank in ready["ranks"]}) == 2

    code, output = tba("train", "--resume", str(stopped), "trainer.world_size=1")
    assert code == 2 and "trainer.world_size=2" in output, output
    code, output = tba("train", "--resume", str(stopped), "train.max_steps=4")
    assert code == 0, output
    a, b = step_records(straight), step_records(stopped)
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    for step in a:
        assert {k: a[step].get(k) for k in COMPARED} == {k: b[step].get(k) for k in COMPARED}
    assert (stopped / "final" / "model.safetensors").is_file()


def test_a_killed_rank_ends_an_async_run_in_one_line_and_leaves_no_process(tmp_path):
    process, run_dir = start_run(tmp_path, *SHARDED, "train.mode=async", "searchers.count=1",
                                 "train.max_steps=100000")  # fmt: skip

    def ranks() -> list[dict]:
        return [rank for e in events(run_dir) if e["event"] == "trainer_ranks_ready"
                for rank in e["ranks"]]  # fmt: skip

    wait_for(lambda: len(steps(run_dir)) >= 3 or process.poll() is not None, timeout=240)
    assert process.poll() is None, finish(process)
    os.kill(ranks()[1]["pid"], signal.SIGKILL)
    output = finish(process, timeout=180)
    assert process.returncode == 1, output
    (line,) = [line for line in output.splitlines() if line.startswith("tba: error:")]
    assert "trainer rank 1 died" in line, line
    assert_no_process_left(process.pid)
    assert latest_checkpoint(run_dir).step >= 2  # written before the failure, and intact
