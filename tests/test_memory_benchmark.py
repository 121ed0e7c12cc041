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
    assert all(row.count("MiB") == 0 and row.count("GiB") == 3 for row in rows)


def test_the_rows_cover_every_shape_and_tuning():
    rows = memory.qwen_rows(memory.parse_args(["--suite", "qwen", "--device", "cpu"]))
    assert len(rows) == 4 * 4 + 1
    assert {row[0] for row in rows} == set(memory.QWEN_SHAPES)
    assert sum(row[:2] == ("qwen2.5-7b", 16) for row in rows) == 2  # LoRA and QLoRA
    assert [row[2] for row in rows] == [False, True] + [False] * 15  # auto: off on a CPU


@pytest.mark.parametrize("name", sorted(
    path.stem for path in (Path(__file__).parent.parent / "benchmarks").glob("*.py")
    if path.stem not in ("__init__", "trl_grpo")  # (TRL's comparison needs tba[bench])
))  # fmt: skip
def test_every_benchmark_imports(name):
    """A benchmark that no test runs still imports: the names it takes from tba exist."""
    importlib.import_module(f"benchmarks.{name}")


def test_a_row_is_measured_with_its_own_settings_and_labelled_as_the_table_says(monkeypatch):
    """`benchmarks.gpu` measures rows of the qwen suite through `measure_qwen_row`."""
    calls = []
    monkeypatch.setattr(memory, "run_step", lambda args, *config: calls.append(config) or {})
    args = memory.parse_args(["--suite", "qwen", "--small", "--device", "cpu"])
    assert (args.dtype, args.num_prompts, args.steps) == ("bfloat16", 2, 1)
    memory.measure_qwen_row(args, ("qwen2.5-3b", 16, True, 4, "adamw", "fp32"))
    assert calls == [("qwen2.5-3b", 16, True, "chunked", 4, "adamw", "fp32")]
    assert memory.tuning_label(16, 4, "adamw", "fp32") == "QLoRA r=16, 4-bit base"
    assert memory.tuning_label(0, 0, "adamw_8bit", "none") == \
        "full, 8-bit Adam, no masters (Kahan)"  # fmt: skip
