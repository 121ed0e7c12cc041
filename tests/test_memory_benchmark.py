"""`python -m benchmarks.memory --suite qwen --small`: the GPU memory suite's rows, measured on a
CPU with narrow shapes (slow: a fresh process per row); and every benchmark imports."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from benchmarks import memory


@pytest.mark.slow
def test_the_qwen_suite_runs_small_every_tuning_of_a_shape(capsys):
    memory.main(["--suite", "qwen", "--small", "--device", "cpu", "--only", "qwen2.5-0.5b"])
    rows = [line for line in capsys.readouterr().out.splitlines()
            if line.startswith("| qwen2.5-0.5b")]  # fmt: skip
    tunings = [row.split(" | ")[2:4] for row in rows]
    # checkpointing as `auto` sets it on a CPU (off), and the full step once with it on
    assert tunings == [
        ["full", "False"], ["full", "True"], ["full, 8-bit Adam, no masters (Kahan)", "False"],
        ["LoRA r=16", "False"], ["QLoRA r=16, 4-bit base", "False"],
    ]
    assert not any("out of memory" in row for row in rows)
    assert all(row.count("MiB") == 0 and row.count("GiB") == 2 for row in rows)


def test_the_rows_cover_every_shape_and_tuning():
    args = type("Args", (), {"device": "cpu"})()
    rows = memory.qwen_rows(args)
    assert len(rows) == 4 * 4 + 1
    assert {row[0] for row in rows} == set(memory.QWEN_SHAPES)
    assert sum(row[:2] == ("qwen2.5-7b", 16) for row in rows) == 2  # LoRA and QLoRA


@pytest.mark.parametrize("name", sorted(
    path.stem for path in (Path(__file__).parent.parent / "benchmarks").glob("*.py")
    if path.stem not in ("__init__", "trl_grpo")  # (TRL's comparison needs tba[bench])
))  # fmt: skip
def test_every_benchmark_imports(name):
    """A benchmark that no test runs still imports: the names it takes from tba exist."""
    importlib.import_module(f"benchmarks.{name}")
