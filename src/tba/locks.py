"""Exclusive locks on files, for what two processes must not do at once: run in one run directory,
or build one cached model.

A lock is `fcntl.flock` on a lock file: the kernel releases it when its holder exits, however it
exits (kill -9 included), so a lock left by a dead process is never mistaken for a live one. The
file holds its holder's pid, host, start time and command, to name it to whoever is refused. The
holder deletes the file as it lets go; a process that opened it just before checks that what it
locked is still the file at that path, and tries again if not.

A user can delete a lock file while its holder runs: a lock resting on it alone would then let a
second process in. A run directory's lock (`directory=True`) is also `flock` on the directory
itself, which cannot be deleted while the run's files are in it; a process refused by it names
the holder from the lock file, or, where that was deleted, by the pid the kernel lists for the
directory's lock (/proc/locks). Where a filesystem cannot lock a directory (NFS), the lock file
alone is the lock.
"""

from __future__ import annotations

import contextlib
import errno
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
    """An exclusive lock on `path` (a file created for it), held from `acquire` to `release`;
    with `directory`, on the directory it is in too (the module's docstring)."""

    def __init__(self, path: Path, *, directory: bool = False) -> None:
        self.path = path
        self.directory = directory
        self.descriptor: int | None = None
        self.directory_descriptor: int | None = None

    def acquire(self, wait: bool = False) -> None:
        """Take the lock: at once or `Locked`, or with `wait`, once its holder lets go. Raises
        `OSError` where the lock file cannot be created (a read-only directory, say)."""
        if self.directory and self.directory_descriptor is None:
            try:
                self.directory_descriptor = _lock_directory(self.path.parent, wait)
            except BlockingIOError:
                raise Locked(self.path, self._holder_of_directory()) from None
        try:
            self._lock_file(wait)
        except BaseException:  # refused, or no file to lock: the directory is let go too
            self.release()
            raise

    def _lock_file(self, wait: bool) -> None:
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
        if self.descriptor is not None:
            with contextlib.suppress(OSError):  # removed with its directory, say
                self.path.unlink()
            os.close(self.descriptor)  # closing lets go of the lock
            self.descriptor = None
        if self.directory_descriptor is not None:
            os.close(self.directory_descriptor)
            self.directory_descriptor = None

    def holder(self) -> dict[str, Any] | None:
        """What the process that holds this lock wrote (`{}` when nothing names it), or None
        when no process holds it; takes nothing and creates nothing."""
        if self.directory:
            try:
                descriptor = os.open(self.path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            except OSError:
                return None
            try:
                fcntl.flock(descriptor, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return self._holder_of_directory()
            except OSError:  # a filesystem without locks on directories: the file tells
                pass
            finally:
                os.close(descriptor)  # closing lets go of the shared lock, if taken
        try:
            descriptor = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:  # no lock file: no holder
            return None
        try:
            fcntl.flock(descriptor, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _read_holder(descriptor)
        except OSError:
            return None
        finally:
            os.close(descriptor)
        return None

    def _holder_of_directory(self) -> dict[str, Any]:
        """Who holds the directory's lock: what it wrote into the lock file, or else (the file
        deleted) its pid and command as the kernel lists them."""
        with contextlib.suppress(OSError):
            descriptor = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                holder = _read_holder(descriptor)
            finally:
                os.close(descriptor)
            if holder:
                return holder
        pid = _flock_holder(self.path.parent)
        if pid is None:
            return {}
        holder: dict[str, Any] = {"pid": pid}
        with contextlib.suppress(OSError):
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
            words = [word for word in argv.split("\0") if word]
            if words:
                holder["command"] = " ".join([Path(words[0]).name, *words[1:]])
        return holder

    def __enter__(self) -> FileLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


# What `flock` on a directory raises where the filesystem cannot lock one (NFS emulates flock
# with locks that need a file open for writing).
NO_DIRECTORY_LOCKS = (errno.EBADF, errno.EINVAL, errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS)


def _lock_directory(directory: Path, wait: bool) -> int | None:
    """A descriptor of `directory` holding its exclusive `flock`, or None where its filesystem
    cannot lock a directory. `BlockingIOError` when another process holds it (without `wait`)."""
    descriptor = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
    except BlockingIOError:
        os.close(descriptor)
        raise
    except OSError as error:
        os.close(descriptor)
        if error.errno in NO_DIRECTORY_LOCKS:
            return None
        raise
    return descriptor


def _flock_holder(path: Path) -> int | None:
    """The pid the kernel lists for an exclusive `flock` on `path` (/proc/locks, Linux), or None
    where it lists none or cannot be read."""
    try:
        stat = os.stat(path)
        table = Path("/proc/locks").read_text()
    except OSError:
        return None
    where = f"{os.major(stat.st_dev):02x}:{os.minor(stat.st_dev):02x}:{stat.st_ino}"
    for line in table.splitlines():
        fields = line.split()
        # "1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF" (blocked waiters: "1: -> FLOCK ...")
        if len(fields) >= 6 and fields[1:4] == ["FLOCK", "ADVISORY", "WRITE"] and \
                fields[5] == where and fields[4].isdigit() and int(fields[4]) > 0:  # fmt: skip
            return int(fields[4])
    return None


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
    command = " ".join(str(holder.get("command") or "").split())  # one line
    if command:
        text += f" ({command if len(command) <= 80 else command[:77] + '...'})"
    return text
