"""`python -m benchmarks.gpu`: its parts within a budget (which are skipped, the timeouts they get),
the commit it records, a part stopped with its process group; and, slow, every part with
`--small` on a CPU, a skip in one line, and a benchmark killed midway keeping what it measured."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from benchmarks import budget, gpu
from tba.policy.tokenizer import build_char_tokenizer

ROOT = Path(__file__).parent.parent


def test_help_lists_the_parts(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["benchmarks.gpu", "--help"])
    with pytest.raises(SystemExit):
        gpu.main()
    shown = capsys.readouterr().out
    for part in gpu.PARTS:
        assert f"  {part} " in shown


def test_an_unknown_part_is_refused_in_one_line(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["benchmarks.gpu", "--parts", "sync,nope"])
    with pytest.raises(SystemExit) as stopped:
        gpu.main()
    assert stopped.value.code == 2
    assert "--parts: unknown nope" in capsys.readouterr().err


def test_the_model_has_qwen25_05b_shape_and_its_decode_roofline():
    shape = gpu.SHAPES["qwen2.5-0.5b"]
    model = gpu.qwen_model(shape, build_char_tokenizer(), torch.device("meta"))  # no memory
    assert sum(p.numel() for p in model.parameters()) == 494_032_768  # Qwen2.5-0.5B's count
    # 128 sequences of a 298-token mean context: every step reads 0.99 GB of bf16 weights and
    # 0.47 GB of KV cache; at the H200's 4.8 TB/s, ~422k tokens/s (docs/results/gpu.md).
    prompts = [[0] * 170] * 128
    assert gpu.roofline(model, prompts, 256, 4.8e12) == pytest.approx(421_752, rel=1e-4)


# ------------------------------------------------------------------------------- the budget


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def budget_args(tmp_path: Path, seconds: float) -> argparse.Namespace:
    return argparse.Namespace(budget=seconds, small=True, minutes=0.25, out=tmp_path,
                              device="cpu")  # fmt: skip


def run_with(monkeypatch, tmp_path, seconds, estimates, durations):
    """`run_parts` over the parts of `estimates` (in their order of value), each taking its
    `durations` seconds on a fake clock: the results and what each part was given."""
    clock = FakeClock()
    given = {}

    def measure(part, args, timeout_s, spare_s, started):
        given[part] = (timeout_s, spare_s)
        clock.now += durations[part]
        return {"measured": part}

    writes = []
    monkeypatch.setattr(gpu, "part_estimate", lambda part, *rest: estimates[part])
    monkeypatch.setattr(gpu, "measure_in_process", measure)
    monkeypatch.setattr(gpu, "write_outputs", lambda results, args: writes.append(set(results)))
    results = gpu.run_parts(list(estimates), budget_args(tmp_path, seconds), clock)
    return results, given, writes


def test_a_part_whose_estimate_no_longer_fits_is_skipped_and_a_later_one_that_fits_runs(
    monkeypatch, tmp_path, capsys
):
    estimates = {"model": 30, "model-async": 50, "handoff": 20, "sampling": 40,
                 "memory-1.5b": 10, "memory-3b": 5}  # fmt: skip
    durations = {"model": 35, "model-async": 45, "handoff": 12, "memory-3b": 3}
    results, given, writes = run_with(monkeypatch, tmp_path, 100, estimates, durations)
    # 100 - 35 - 45 - 12 = 8 s left: sampling (40) and memory-1.5b (10) no longer fit.
    assert results["skipped"] == ["sampling", "memory-1.5b"]
    assert results["sampling"] == "skipped: its estimate, 40 s, exceeds the 8 s left of the " \
        "100 s budget"  # fmt: skip
    assert [p for p in estimates if results[p] == {"measured": p}] == [
        "model", "model-async", "handoff", "memory-3b"]  # fmt: skip
    assert "sampling: skipped: its estimate, 40 s" in capsys.readouterr().out
    # Each part may run for the rest of the budget; what it may spare beyond its estimate
    # leaves every later part its own.
    assert given["model"] == (100, 100 - 30 - (50 + 20 + 40 + 10 + 5))
    assert given["model-async"] == (65, 65 - 50 - (20 + 40 + 10 + 5))
    assert given["memory-3b"] == (8, 8 - 5)
    assert results["meta"]["part_seconds"] == durations
    assert results["meta"]["estimates"] == estimates
    # Written when each part starts (naming it) and after it, and after each skip.
    assert sum("running" in keys for keys in writes) >= 4
    assert "running" not in results and not results.get("failed")


def test_a_failed_part_is_kept_as_its_reason_and_the_next_part_runs(monkeypatch, tmp_path):
    clock = FakeClock()

    def measure(part, args, timeout_s, spare_s, started):
        clock.now += 5
        if part == "model":
            raise RuntimeError("CUDA out of memory (log: logs/model.log)")
        return {"measured": part}

    monkeypatch.setattr(gpu, "part_estimate", lambda part, *rest: 10)
    monkeypatch.setattr(gpu, "measure_in_process", measure)
    monkeypatch.setattr(gpu, "write_outputs", lambda results, args: None)
    results = gpu.run_parts(["model", "handoff"], budget_args(tmp_path, 100), clock)
    assert results["model"] == "failed: CUDA out of memory (log: logs/model.log)"
    assert results["failed"] == ["model"] and results["handoff"] == {"measured": "handoff"}


def test_parts_that_need_ray_are_skipped_without_it(monkeypatch, tmp_path):
    monkeypatch.setattr(gpu.importlib.util, "find_spec", lambda name: None)
    results, _, _ = run_with(monkeypatch, tmp_path, 1000, {"model-async": 10, "handoff": 10},
                             {"handoff": 1})  # fmt: skip
    assert results["model-async"] == "skipped: Ray is not installed (`pip install ray`)"
    assert results["handoff"] == {"measured": "handoff"}


def test_an_embedded_part_is_estimated_with_its_minutes_and_the_first_builds_the_base():
    run = gpu.PARTS["sync"].gpu_s + 2 * 60
    assert gpu.part_estimate("sync", False, 2.0, base_built=False) == \
        run + gpu.BASE_POLICY_S["gpu"]  # fmt: skip
    assert gpu.part_estimate("sync", False, 2.0, base_built=True) == run
    assert gpu.part_estimate("model", True, 2.0, base_built=False) == gpu.PARTS["model"].small_s


def test_the_second_split_is_tried_only_on_a_gpu_where_the_budget_spares_it():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert "nothing to split" in gpu.split_skip_reason(cpu, 0, 10_000)
    assert gpu.split_skip_reason(cuda, 100, 100 + gpu.SECOND_SPLIT.gpu_s) is None
    assert gpu.split_skip_reason(cuda, 100, 150) == (
        f"a second split (searchers.num_gpus={gpu.SECOND_SPLIT.num_gpus}, ~"
        f"{gpu.SECOND_SPLIT.gpu_s:.0f} s) did not fit the budget (50 s to spare)")


def test_the_memory_parts_take_the_rows_not_yet_measured():
    settings = gpu.memory_settings(torch.device("cpu"), small=True)
    assert settings.dtype == "float32" and settings.small
    for part, tunings in (("memory-1.5b", 4), ("memory-3b", 4)):
        rows = gpu.memory_rows(part, settings)
        assert len(rows) == tunings and {row[0] for row in rows} == {gpu.MEMORY_PARTS[part][0]}
    (qlora,) = gpu.memory_rows("memory-7b-qlora", settings)
    assert qlora[0] == "qwen2.5-7b" and qlora[1] == 16 and qlora[3] == 4


# ------------------------------------------------------------------------ the commit measured


def test_the_commit_comes_from_the_variable_then_the_file_then_git(tmp_path):
    assert budget.commit(tmp_path, {}) == {"commit": "unknown", "source": "none"}
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / budget.COMMIT_FILE).write_text("abc123\n")
    assert budget.commit(tmp_path, {}) == {"commit": "abc123", "source": "benchmarks/.commit"}
    assert budget.commit(tmp_path, {"TBA_COMMIT": "def456"}) == \
        {"commit": "def456", "source": "TBA_COMMIT"}  # fmt: skip


def test_without_variable_or_file_the_commit_is_git_head(tmp_path):
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    (tmp_path / "a.txt").write_text("a")
    subprocess.run([*git, "add", "a.txt"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "a"], check=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()  # fmt: skip
    assert budget.commit(tmp_path, {}) == {"commit": head, "source": "git"}
    (tmp_path / "a.txt").write_text("b")
    assert budget.commit(tmp_path, {})["commit"] == head + "+dirty"
    (tmp_path / "benchmarks").mkdir()
    assert budget.write_commit(tmp_path) == head + "+dirty"
    assert budget.commit(tmp_path, {})["source"] == "benchmarks/.commit"


# ------------------------------------------------------------------------ a part's process


def gone(pid: int) -> bool:
    """Whether process `pid` has ended (a zombie not yet reaped has)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def wait_until(condition, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return condition()


def test_a_part_past_its_timeout_is_stopped_with_the_processes_it_started(tmp_path):
    script = ("import subprocess, sys, time; child = subprocess.Popen(['sleep', '60']); "
              "print(child.pid, flush=True); time.sleep(60)")  # fmt: skip
    done = budget.run_part([sys.executable, "-c", script], tmp_path / "part.log", timeout_s=2)
    assert done.returncode is None and 2 <= done.seconds < 2 + budget.STOP_GRACE_S
    assert wait_until(lambda: gone(int(done.stdout.split()[0])), 5)


# ----------------------------------------------------------------------- end to end (slow)


def benchmark(tmp_path: Path, *options: str) -> list[str]:
    return [sys.executable, "-m", "benchmarks.gpu", "--small", "--out", str(tmp_path), *options]


def read_results(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


@pytest.mark.slow
def test_small_runs_every_part_and_writes_its_results_after_each(tmp_path):
    process = subprocess.Popen(benchmark(tmp_path, "--budget", "3600"), cwd=ROOT, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
    seen = []  # the parts finished, each time gpu.json changed
    while process.poll() is None:
        results = read_results(tmp_path / "gpu.json")
        finished = list(results["meta"]["part_seconds"]) if results else []
        if finished and (not seen or finished != seen[-1]):
            seen.append(finished)
        time.sleep(0.2)
    stdout = process.stdout.read()
    assert process.returncode == 0, stdout[-4000:]
    parts = list(gpu.PARTS)
    assert seen[-1] == parts
    assert [len(finished) for finished in seen] == list(range(1, len(parts) + 1)), seen
    results = json.loads((tmp_path / "gpu.json").read_text())
    assert all(isinstance(results[part], dict) for part in parts), results
    meta = results["meta"]
    assert meta["commit"] and meta["torch"] == torch.__version__ and meta["transformers"]
    assert set(meta["part_seconds"]) == set(meta["estimates"]) == set(parts)

    assert results["model"]["step"]["train_tokens_per_s"] > 0
    runs = results["model-async"]["runs"]
    assert [run["searchers"] for run in runs] == [2, 1]
    for run in runs:
        assert run["steps_averaged"] >= 1 and run["samples_per_s"] > 0
        assert 0 <= run["idle_share"] <= 1 and run["staleness_steps_mean"] is not None
        assert run["trainer_publish_seconds"] > 0 and run["searcher_weight_sync_s"] > 0
        assert run["weight_transfer"] == ["shared"] and run["gpu_share"] == 0
    assert "nothing to split" in results["model-async"]["split_not_tried"]
    handoff = results["handoff"]
    assert handoff["bucket_publish_seconds"] > 0 and handoff["bucket_read_seconds"] > 0
    assert handoff["ipc"] is False and handoff["in_process_shares_module"] is True
    for method in ("loop", "static", "hf"):  # on a CPU; on a GPU also the compiled ones
        assert results["sampling"][method]["tokens_per_s"] > 0
    for part, count in (("memory-1.5b", 4), ("memory-3b", 4), ("memory-7b-qlora", 1)):
        rows = results[part]["rows"]
        assert len(rows) == count and all(row.get("step_peak_mib", 0) > 0 for row in rows), rows
    assert results["sync"]["steps"] >= 1 and results["sync"]["samples_lost"] == 0
    assert len(results["sync"]["curve"]) > 2  # at the start, every tenth of the run, the end
    assert results["async"]["samples_lost"] == 0

    table = (tmp_path / "gpu.md").read_text()
    assert stdout.rstrip().endswith(table.rstrip())
    for what in ("TBATrainer", "2 searchers (Ray actors)", "1 searcher (a Ray actor)",
                 "split of the GPU", "hand-off", "sampling", "qwen2.5-3b", "embedded math",
                 "seconds per part"):  # fmt: skip
        assert what in table, what


@pytest.mark.slow
def test_a_budget_too_small_for_a_part_skips_it_in_one_line(tmp_path):
    done = subprocess.run(benchmark(tmp_path, "--parts", "async", "--budget", "10"), cwd=ROOT,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "async: skipped: its estimate, " in done.stdout
    assert "exceeds the 10 s left of the 10 s budget" in done.stdout
    results = json.loads((tmp_path / "gpu.json").read_text())
    assert results["skipped"] == ["async"] and results["async"].startswith("skipped: ")
    assert "skipped: its estimate" in (tmp_path / "gpu.md").read_text()


@pytest.mark.slow
def test_a_benchmark_killed_midway_keeps_the_parts_it_finished(tmp_path):
    process = subprocess.Popen(benchmark(tmp_path, "--parts", "handoff,sampling"), cwd=ROOT,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        def second_part_running() -> bool:
            results = read_results(tmp_path / "gpu.json") or {}
            return "pid" in results.get("running", {}) and "handoff" in results

        assert wait_until(second_part_running, 300)
        os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
    results = json.loads((tmp_path / "gpu.json").read_text())
    assert results["handoff"]["bucket_read_seconds"] > 0
    assert results["running"]["part"] == "sampling"
    assert "weight hand-off" in (tmp_path / "gpu.md").read_text()
    # The part's process dies with the benchmark (the kernel kills it).
    assert wait_until(lambda: gone(results["running"]["pid"]), 15)
