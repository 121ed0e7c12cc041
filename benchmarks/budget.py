"""Running a benchmark's parts within a time budget, so that one window of machine time brings
back what was measured even where it ran out, or a part hung.

- `Budget`: the seconds left of a budget, and whether a part's estimate still fits in them.
- `run_part`: one part in its own process, under its own timeout (at most what is left of the
  budget). The part runs in a session of its own, so that its whole process group (the runs,
  measurements and Ray instances it started) is stopped when it overruns, and it is killed by
  the kernel if this process is (`PR_SET_PDEATHSIG`): a killed benchmark leaves no part running.
- `write_atomically`: a result file replaced in one step, so that a benchmark killed while
  writing keeps the previous version whole.
- `commit`: the commit measured, where the working tree was copied without its `.git`: the
  `TBA_COMMIT` environment variable, else the file `benchmarks/.commit` written before the copy
  (`python -m benchmarks.gpu --write-commit`), else `git rev-parse HEAD`, else "unknown".
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMIT_FILE = Path("benchmarks/.commit")  # relative to the repository's root
COMMIT_VARIABLE = "TBA_COMMIT"
STOP_GRACE_S = 10.0  # a part told to stop gets this long to end its runs before it is killed
PR_SET_PDEATHSIG = 1  # linux/prctl.h


class Budget:
    """`seconds` from the moment it is made, on `clock`."""

    def __init__(self, seconds: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.seconds = seconds
        self.clock = clock
        self.start = clock()

    def spent(self) -> float:
        return self.clock() - self.start

    def left(self) -> float:
        return max(self.seconds - self.spent(), 0.0)

    def admits(self, estimate: float) -> bool:
        """Whether a part expected to take `estimate` seconds fits in what is left."""
        return estimate <= self.left()


@dataclass
class PartRun:
    """How a part's process ended: its exit status (None: stopped at its timeout), stdout, and
    the seconds it ran."""

    returncode: int | None
    stdout: str
    seconds: float


def _die_with_parent() -> None:
    """In the part's process before it starts: the kernel kills it when its parent dies."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def run_part(command: list[str], log: Path, timeout_s: float,
             started: Callable[[int], None] = lambda pid: None) -> PartRun:  # fmt: skip
    """`command` in a session of its own, its stderr into `log`, for at most `timeout_s`; then
    its process group is asked to stop (SIGTERM) and, `STOP_GRACE_S` later, killed. `started`
    is told the process id once it runs."""
    start = time.monotonic()
    with log.open("w") as sink:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=sink, text=True,
                                   cwd=ROOT, start_new_session=True,
                                   preexec_fn=_die_with_parent)  # fmt: skip
        started(process.pid)
        try:
            stdout, _ = process.communicate(timeout=timeout_s)
            returncode: int | None = process.returncode
        except subprocess.TimeoutExpired:
            stdout, returncode = _stop_group(process), None
        except BaseException:  # this benchmark is stopped: so is its part
            _stop_group(process)
            raise
    return PartRun(returncode, stdout or "", time.monotonic() - start)


def _stop_group(process: subprocess.Popen) -> str:
    """SIGTERM to the part's process group, SIGKILL to whatever of it is left after the grace
    (the part may be gone and its children not); the part's output so far."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        stdout, _ = process.communicate(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        stdout = None
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    if stdout is None:
        stdout, _ = process.communicate()
    return stdout or ""


def write_atomically(path: Path, text: str) -> None:
    """`path` holds `text`, or what it held before: never a part of it."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    os.replace(partial, path)


def commit(root: Path = ROOT, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The commit of the code measured, and where it was read: {"commit", "source"}."""
    if environ.get(COMMIT_VARIABLE, "").strip():
        return {"commit": environ[COMMIT_VARIABLE].strip(), "source": COMMIT_VARIABLE}
    written = root / COMMIT_FILE
    if written.is_file() and written.read_text().strip():
        return {"commit": written.read_text().strip(), "source": str(COMMIT_FILE)}
    if (root / ".git").exists():
        found = git_commit(root)
        if found:
            return {"commit": found, "source": "git"}
    return {"commit": "unknown", "source": "none"}


def git_commit(root: Path) -> str | None:
    """HEAD of the repository at `root`, with `+dirty` where tracked files differ from it."""
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()  # fmt: skip
        differs = subprocess.run(["git", "-C", str(root), "diff", "--quiet", "HEAD"],
                                 capture_output=True).returncode == 1  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+dirty" if differs else "")


def write_commit(root: Path = ROOT) -> str:
    """Write this repository's commit into `benchmarks/.commit`, for a copy without `.git`."""
    found = git_commit(root)
    if found is None:
        raise RuntimeError(f"no git repository at {root}: set {COMMIT_VARIABLE} instead")
    (root / COMMIT_FILE).write_text(found + "\n")
    return found
