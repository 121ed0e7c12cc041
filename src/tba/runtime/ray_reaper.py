"""Stops what is left of a run's local Ray instance once the run's process is gone, however it
went (kill -9 included): Ray's gcs_server and raylet end with their driver, but the agents they
started (the dashboard and runtime-env agents) outlive it for a minute or more, and a killed
searcher's worker can too.

Run as a script, not imported (it loads nothing but the standard library):

    python ray_reaper.py TRAINER_PID SESSION_DIR

Every process of that Ray instance keeps files of its session directory open (its logs, or the
raylet's it inherited); once TRAINER_PID has exited, each of them still running gets SIGKILL.
Linux only (it reads /proc).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def instance_processes(session_dir: str) -> list[int]:
    """Ray's processes with a file of the Ray session directory open (not, say, a `tail -f` of
    one of its logs)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            name = (entry / "comm").read_text().strip()
            command = (entry / "cmdline").read_bytes()
            links = [os.readlink(fd) for fd in (entry / "fd").iterdir()]
        except OSError:  # gone, or not ours to read
            continue
        ours = name.startswith("ray::") or name in ("raylet", "gcs_server") or (
            b"/site-packages/ray/" in command)  # fmt: skip
        if ours and any(link.startswith(session_dir) for link in links):
            found.append(int(entry.name))
    return found


def main() -> None:
    trainer, session_dir = int(sys.argv[1]), sys.argv[2].rstrip("/") + "/"
    while alive(trainer):
        time.sleep(1.0)
    time.sleep(2.0)  # a clean shutdown (ray.shutdown) has finished by now
    for pid in instance_processes(session_dir):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            continue


if __name__ == "__main__":
    main()
