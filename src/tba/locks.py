"""Exclusive locks on files, for what two processes must not do at once: run in one run directory,
or build one cached model.

A lock is `fcntl.flock` on a lock file: the kernel releases it when its holder exits, however it
exits (kill -9 included), so a lock left by a dead process is never mistaken for a live one. The
file holds its holder's pid, host, start time and command, to name it to whoever is refused. The
holder deletes the file as it lets go; a process that opened it just before checks that what it
locked is still the file at that path, and tries again if not.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any


class Locked(Exception):
    """The lock is held by another process; `holder` is what it wrote into the lock file."""

    def __init__(self, path: Path, holder: dict[str, Any]) -> None:
        super().__init__(f"{path} is locked by {describe_holder(holder)}")
        self.path, self.holder = path, holder


class FileLock:
    """An exclusive lock on `path` (a file created for it), held from `acquire` to `release`."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.descriptor: int | None = None

    def acquire(self, wait: bool = False) -> None:
        """Take the lock: at once or `Locked`, or with `wait`, once its holder lets go. Raises
        `OSError` where the lock file cannot be created (a read-only directory, say)."""
        while self.descriptor is None:
            descriptor = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(descriptor, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
            except BlockingIOError:
                holder = _read_holder(descriptor)
                os.close(descriptor)
                raise Locked(self.path, holder) from None
            if _same_file(descriptor, self.path):
                self.descriptor = descriptor
            else:  # its holder deleted it while we waited: lock the file at the path now
                os.close(descriptor)
        holder = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time(),
                  "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])}  # fmt: skip
        os.ftruncate(self.descriptor, 0)
        os.pwrite(self.descriptor, json.dumps(holder).encode(), 0)

    def release(self) -> None:
        if self.descriptor is None:
            return
        with contextlib.suppress(OSError):  # removed with its directory, say
            self.path.unlink()
        os.close(self.descriptor)  # closing lets go of the lock
        self.descriptor = None

    def __enter__(self) -> FileLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _same_file(descriptor: int, path: Path) -> bool:
    try:
        return os.path.samestat(os.fstat(descriptor), os.stat(path))
    except FileNotFoundError:
        return False


def _read_holder(descriptor: int) -> dict[str, Any]:
    try:
        holder = json.loads(os.pread(descriptor, 4096, 0) or b"{}")
    except (OSError, ValueError):  # written as we read it: nothing to name it by
        return {}
    return holder if isinstance(holder, dict) else {}


def describe_holder(holder: dict[str, Any]) -> str:
    """`process 123 on host, since 14:02:11 (tba train ...)`, as much of it as is known."""
    if "pid" not in holder:
        return "another process"
    text = f"process {holder['pid']}"
    if holder.get("host") and holder["host"] != socket.gethostname():
        text += f" on {holder['host']}"
    if isinstance(holder.get("since"), int | float):
        text += f", since {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(holder['since']))}"
    command = str(holder.get("command") or "")
    if command:
        text += f" ({command if len(command) <= 80 else command[:77] + '...'})"
    return text
