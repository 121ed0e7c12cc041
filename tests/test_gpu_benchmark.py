"""`python -m benchmarks.gpu --small`: every part of the GPU benchmark runs on a CPU with tiny
shapes, writes its table and figures, and prints the table last."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import gpu
from tba.policy.tokenizer import build_char_tokenizer

ROOT = Path(__file__).parent.parent


def test_the_parts_run_small_and_the_table_comes_last(tmp_path):
    # Shorter runs than --small's own, and not the asynchronous part, whose Ray start-up alone
    # takes ~30 s here (tests/test_async_e2e.py runs that mode): the suite's time is short.
    command = [sys.executable, "-m", "benchmarks.gpu", "--small", "--minutes", "0.02",
               "--parts", "sync,model,sampling,handoff", "--out", str(tmp_path)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads((tmp_path / "gpu.json").read_text())
    assert "failed" not in results
    sync = results["sync"]
    assert sync["steps"] >= 1 and sync["samples_lost"] == 0
    # Evaluated at the start, every tenth of the run (by time) and at the end.
    assert len(sync["curve"]) > 2
    assert {"step_seconds", "wait_seconds", "train_seconds"} <= set(sync["step"])
    assert results["model"]["step"]["train_tokens_per_s"] > 0
    assert results["model"]["parameters"] > 0 and results["model"]["peak_memory_gib"] > 0
    for method in ("loop", "static", "hf"):  # on a CPU; on a GPU also the compiled ones
        assert results["sampling"][method]["tokens_per_s"] > 0
    assert results["sampling"]["roofline"]["tokens_per_s"] > 0
    handoff = results["handoff"]
    assert handoff["handoff_seconds"] > 0 and handoff["copy_seconds"] > 0
    assert handoff["bucket_publish_seconds"] > 0 and handoff["ipc"] is False
    assert handoff["in_process_shares_module"] is True
    table = (tmp_path / "gpu.md").read_text()
    assert done.stdout.rstrip().endswith(table.rstrip())
    rows = [line for line in table.splitlines() if line.startswith("| ") and "|---" not in line]
    for what in ("embedded math", "TBATrainer", "sampling", "hand-off"):
        assert any(what in row for row in rows), what


@pytest.mark.slow
def test_the_asynchronous_model_part_runs_small_beside_the_synchronous_one(tmp_path):
    command = [sys.executable, "-m", "benchmarks.gpu", "--small", "--parts", "model,model-async",
               "--out", str(tmp_path)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=400, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads((tmp_path / "gpu.json").read_text())
    sync, run = results["model"], results["model-async"]
    assert sync["mode"] == "sync" and run["mode"] == "async"
    assert run["steps_averaged"] >= 1 and run["samples_per_s"] > 0
    assert 0 <= run["idle_share"] <= 1 and run["staleness_steps_mean"] is not None
    table = (tmp_path / "gpu.md").read_text()
    assert "asynchronous, 2 searchers (Ray actors) on the trainer's device" in table
    assert "synchronous: " in table


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
