"""A run set aside while another replaces it in its directory (`--overwrite`,
`TBATrainer.train()`): moved into `.replaced/` whole or not at all (`set_aside`), put back if the
new run stops before its first checkpoint and deleted once it has one (`Replacement`), and what a
kill in between left settled by the next process that starts in the directory or reads it
(`settle_replacement`, `settle_interrupted_replacement`)."""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Callable
from pathlib import Path

from tba.errors import ConfigError
from tba.run_dir.directory import RUN_FILES, holds_run, own_run_dir, remove_run

# Where a run being replaced waits while the run replacing it starts (`set_aside`): put back if
# that one stops before its first checkpoint, deleted once it has one. `.replacing` holds what
# belongs back in the run directory (a move aside or back that a kill cut short), `.replaced-old`
# what is being deleted.
REPLACED, MOVING, DELETING = ".replaced", ".replacing", ".replaced-old"


class Replacement:
    """A run set aside in `RUN_DIR/.replaced/` (`set_aside`) while a new run starts in its
    directory: `restore` puts it back (the new run stopped before its first checkpoint, having
    nothing to lose), `discard` deletes it (the new run has a checkpoint). Used as a context
    manager around the new run, it restores on the way out unless the new run has a checkpoint
    by then; a kill in between is settled by the next start (`settle_replacement`)."""

    def __init__(self, path: Path, what: str, log: Callable[[str], None]) -> None:
        self.path, self.what, self.log = path, what, log
        self.settled = False
        self.restored = False

    def discard(self) -> None:
        if self.settled:
            return
        self.settled = True
        _delete_set_aside(self.path)

    def restore(self) -> None:
        if self.settled:
            return
        self.settled = True
        remove_run(self.path)  # the new run's files, none of which the old run had
        (self.path / REPLACED).rename(self.path / MOVING)
        _move_back(self.path)
        self.restored = True
        self.log(f"kept {self.what}: the run meant to replace it stopped before its first "
                 "checkpoint")  # fmt: skip

    def __enter__(self) -> Replacement:
        return self

    def __exit__(self, *exc) -> None:
        if holds_run(self.path):  # the new run has a checkpoint (or ended): it replaces the old
            self.discard()
        else:
            self.restore()


def set_aside(path: Path, what: str, log: Callable[[str], None]) -> Replacement:
    """Move the run in `path` (its `RUN_FILES`) into `path/.replaced/`, whole or not at all."""
    moving = path / MOVING
    moving.mkdir()
    try:
        for name in RUN_FILES:
            if (path / name).exists():
                (path / name).rename(moving / name)
        moving.rename(path / REPLACED)
    except BaseException:  # a signal, a failed rename: the run stays as it was
        _move_back(path)
        raise
    return Replacement(path, what, log)


def settle_replacement(path: Path, log: Callable[[str], None]) -> None:
    """What a process killed while replacing the run in `path` left: a run it had set aside comes
    back unless the new run got as far as a checkpoint; a move it cut short is undone."""
    if (path / DELETING).exists():
        shutil.rmtree(path / DELETING)
    if (path / MOVING).exists():
        _move_back(path)
    if (path / REPLACED).exists():
        replacement = Replacement(path, f"the run in {path} that a killed start had set aside", log)
        replacement.__exit__(None, None, None)


def settle_interrupted_replacement(path: Path, log: Callable[[str], None]) -> None:
    """Before a command reads the run in `path` (`tba train --resume`, `tba eval`, `tba plot`):
    what a `tba train --overwrite` killed while replacing it left is settled
    (`settle_replacement`) under the directory's lock, so that what is read is the run the
    directory holds, never the killed start's files. A directory another process runs in is
    `RunBusyError` (that process settled it as it started); one that cannot be written, one line
    naming where the run set aside is (`ConfigError`)."""
    if not any((path / name).exists() for name in (REPLACED, MOVING, DELETING)):
        return
    try:
        with own_run_dir(path):
            settle_replacement(path, log)
    except (ConfigError, OSError) as error:
        reason = error.strerror if isinstance(error, OSError) else "it cannot be written"
        raise ConfigError(f"{path}: a `tba train` that was replacing its run was killed, and "
                          f"the run it replaced is set aside in {path / REPLACED} (or "
                          f"{path / MOVING}); it cannot be put back ({reason}): make {path} "
                          "writable and run this again, or read that run where it is") from None


def _move_back(path: Path) -> None:
    moving = path / MOVING
    for entry in moving.iterdir():
        if not (path / entry.name).exists():
            entry.rename(path / entry.name)
    shutil.rmtree(moving)


def _delete_set_aside(path: Path) -> None:
    """Never a reason for the new run to fail: what is left is deleted by the next start in the
    directory (`settle_replacement`)."""
    with contextlib.suppress(OSError):
        (path / REPLACED).rename(path / DELETING)
    shutil.rmtree(path / DELETING, ignore_errors=True)
