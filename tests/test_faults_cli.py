"""Every fault of `benchmarks.faults`, as a user meets it: `tba train` in a process of its own,
with a reward that never works, an evaluation function that hangs, a YAML file with a section
twice, infinite settings, a full disk (a real tmpfs, where this machine lets us mount one), a torn
metrics line, a damaged checkpoint, a broken or empty model directory, a SIGTERM, a second start
in a running run's directory, two base-policy builds into one cache at once, devices and output
directories that cannot be used; and at a run's edges (`benchmarks.fault_ends`): a finished run
replaced by one that fails, a kill during the final save, signals during the evaluations, a disk
that fills at the end, read-only places for `tba eval` and `tba plot`. Each ends with the exit
status it must, a message of at most two lines naming the problem, and what the run had saved
still there. The table of docs/faults.md is
`python -m benchmarks.faults`.

The bad-input cases (`Case.in_process`) run their `tba` commands in this process, through the
same `main` that `tba` runs: the same status and message, without starting Python and torch
again for each."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess

import pytest

from benchmarks import faults
from benchmarks.faults import CASES, run
from tba.cli import main


def can_mount_a_tmpfs(path) -> bool:
    if os.geteuid() != 0:
        return False
    path.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(path)],
                          capture_output=True)  # fmt: skip
    if done.returncode == 0:
        subprocess.run(["umount", str(path)], check=False)
    return done.returncode == 0


def tba_here(args: list[str], timeout: float = 300, env: dict | None = None) -> tuple[int, str]:
    """`tba ARGS` in this process: its exit status and what it wrote to stderr (a traceback
    would fail the test)."""
    assert not env
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        status = main(args)
    return status, stderr.getvalue()


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_a_fault_ends_as_it_should(case, tmp_path, monkeypatch):
    if case.name in ("full disk", "output_dir read-only") and os.geteuid() == 0 and \
            not can_mount_a_tmpfs(tmp_path / "probe"):  # fmt: skip
        pytest.skip("needs to mount a small tmpfs (root's writes ignore permissions)")
    if case.name == "full disk" and os.geteuid() != 0:
        pytest.skip("needs root to mount a small tmpfs")
    if case.mounts and (os.geteuid() != 0 or not can_mount_a_tmpfs(tmp_path / "probe")):
        pytest.skip("needs root to mount a tmpfs (a small or a read-only disk)")
    if case.in_process:
        monkeypatch.setattr(faults, "tba", tba_here)
    result = run(case, tmp_path)
    assert result.exit == case.exit, result
    assert len(result.message) <= 2, result.message
    assert case.message in " ".join(result.message)
    kept = case.kept if case.kept is not None else (
        ("final", "eval.json") if case.exit in (0, 130, 143) else ())  # fmt: skip
    for name in kept:  # the run ended, or was saved on its way out
        assert name in result.survived, result
