"""`python -m benchmarks.microbatches --small`: padded micro-batches against a token budget on
sampled responses, in one process (slow: it builds the built-in policy and samples)."""

from __future__ import annotations

import pytest

from benchmarks import microbatches


@pytest.mark.slow
def test_the_small_run_times_padded_and_budgeted_steps(capsys):
    rows = microbatches.main(["--small"])
    assert [row["budget"] is None for row in rows] == [True, False]
    assert all(row["micro_batches"] == 1 and 0 <= row["padded_frac"] < 1 for row in rows)
    assert rows[1]["budget"] == rows[0]["tokens"]  # the batch's own tokens: one micro-batch
    assert all(row["tokens_per_s"] > 0 and len(row["seconds"]) == 1 for row in rows)
    out = capsys.readouterr().out
    assert "| padded (before) | null | 1 |" in out and "| token budget (after) |" in out
