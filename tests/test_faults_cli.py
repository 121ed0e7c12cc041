"""Every fault of `benchmarks.faults`, as a user meets it: `tba train` in a process of its own,
with a reward that never works, an evaluation function that hangs, a YAML file with a section
twice, infinite settings, a full disk (a real tmpfs, where this machine lets us mount one), a torn
metrics line, a damaged checkpoint, a broken or empty model directory, a SIGTERM. Each ends with
the exit status it must, a message of at most two lines naming the problem, and what the run had
saved still there. The table of docs/faults.md is `python -m benchmarks.faults`."""

from __future__ import annotations

import os
import subprocess

import pytest

from benchmarks.faults import CASES, run


def can_mount_a_tmpfs(path) -> bool:
    if os.geteuid() != 0:
        return False
    path.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(path)],
                          capture_output=True)  # fmt: skip
    if done.returncode == 0:
        subprocess.run(["umount", str(path)], check=False)
    return done.returncode == 0


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_a_fault_ends_as_it_should(case, tmp_path):
    if case.name == "full disk" and not can_mount_a_tmpfs(tmp_path / "probe"):
        pytest.skip("needs root to mount a small tmpfs")
    result = run(case, tmp_path)
    assert result.exit == case.exit, result
    assert len(result.message) <= 2, result.message
    assert case.message in " ".join(result.message)
    if case.exit in (0, 143):  # the run ended, or was saved on its way out
        assert "final" in result.survived and "eval.json" in result.survived
