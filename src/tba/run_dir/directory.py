"""A run directory itself: what a run writes into it (`RUN_FILES`) and whether it holds a run
that can be resumed or that ended (`holds_run`, `final_saved`, `run_ended`, `describe_run`), the
config a run was trained with (`run_config`), this process's hold on it (`own_run_dir`, its
`.lock`), why a path cannot be one (`unusable_output_dir`), removing a run's files
(`remove_run`), and files written whole or not at all (`write_whole`, `check_writable`)."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from tba.config import RunConfig, load_config
from tba.errors import ConfigError
from tba.locks import FileLock, Locked, describe_holder
from tba.trust import CODE_RECORD

# What a run writes into its directory: what `--overwrite`, or a new start after a run that never
# checkpointed, removes (and nothing else that may be in the directory).
RUN_FILES = ("config.yaml", "metrics.jsonl", "events.jsonl", "eval.json", "curves.png",
             "attacks.jsonl", "completions.jsonl", "eval_final.json", "eval_snapshots.json",
             "checkpoints", "searchers", "snapshots", "final", "tensorboard", "wandb",
             "base_model", CODE_RECORD)  # fmt: skip


class RunExistsError(FileExistsError):
    """The run directory holds a run to resume or one that ended: starting anew would lose it.
    `advice` says how to go on, in the words of the caller (the command line's by default)."""

    COMMAND_LINE = ("continue it with `tba train --resume {path}`, replace it with --overwrite, "
                    "or choose another output_dir")  # fmt: skip

    def __init__(self, path: Path, advice: str = COMMAND_LINE) -> None:
        super().__init__(f"run directory {path} already holds a run; {advice.format(path=path)}")
        self.path = path


class RunBusyError(FileExistsError):
    """Another process is running in the run directory: a second start would write over it."""

    def __init__(self, path: Path, holder: dict) -> None:
        super().__init__(f"run directory {path} is in use by {describe_holder(holder)}: "
                         "wait for that run to end, or stop it, or choose another output_dir")
        self.path = path


# Held by the process that runs in the directory (`own_run_dir`); names it to a second start.
LOCK_FILE = ".lock"


def holds_run(path: Path) -> bool:
    """A run that can be resumed (a complete checkpoint) or that ended (eval.json, final/)."""
    checkpoints = path / "checkpoints"
    resumable = checkpoints.is_dir() and any(checkpoints.glob("step*/state.json"))
    return resumable or (path / "eval.json").exists() or (path / "final").is_dir()


def final_saved(path: Path) -> bool:
    """Whether `path` (a run's final/) holds a whole saved policy: a config and its weights (a
    save cut short by a kill, in runs written before final/ was saved under a temporary name,
    may have left only part of it)."""
    weights = [*path.glob("model*.safetensors"), *path.glob("pytorch_model*.bin")]
    return (path / "config.json").is_file() and bool(weights)


def run_ended(path: Path) -> bool:
    """Whether the run in `path` ended: its summary (eval.json) and final policy are saved."""
    return (path / "eval.json").is_file() and final_saved(path / "final")


def describe_run(path: Path) -> str:
    """The run in `path` in a few words: 'the finished run in RUN (final/, 3 checkpoints)'."""
    steps = sorted(p.parent.name for p in (path / "checkpoints").glob("step*/state.json"))
    kept = ["final/"] if final_saved(path / "final") else []
    if steps:
        kept.append(f"{len(steps)} checkpoint{'s' if len(steps) > 1 else ''}, the newest "
                    f"{steps[-1]}")  # fmt: skip
    state = "finished" if run_ended(path) else "unfinished"
    return f"the {state} run in {path} ({', '.join(kept) or 'eval.json'})"


def run_config(run_dir: Path, overrides: Sequence[str] = ()) -> RunConfig:
    """The config a run directory was trained with, `overrides` on top."""
    if not (run_dir / "config.yaml").is_file():
        raise FileNotFoundError(f"{run_dir}: no run there (config.yaml not found)")
    return load_config(run_dir / "config.yaml", list(overrides))

@contextmanager
def own_run_dir(path: Path) -> Iterator[Path]:
    """This process's exclusive hold on the existing run directory `path`, taken before anything
    in it is read or changed and let go at exit (`tba.locks`: a process that died lets go too).
    A directory another process runs in is `RunBusyError`; one that cannot be written,
    `ConfigError`."""
    lock = FileLock(path / LOCK_FILE, directory=True)  # a deleted .lock still holds
    try:
        lock.acquire()
    except Locked as error:
        raise RunBusyError(path, error.holder) from None
    except OSError as error:
        raise unusable_output_dir(path, error) from None
    try:
        yield path
    finally:
        lock.release()


def unusable_output_dir(path: Path, error: OSError) -> ConfigError:
    """Why `path` cannot be a run directory, and what to do, in one line."""
    advice = "choose another output_dir"
    if error.errno == errno.ENAMETOOLONG:  # before anything else asks the system about `path`
        return _name_too_long(path)
    if path.exists() and not path.is_dir():
        return ConfigError(f"output_dir {path} is a file, not a directory: {advice}, or move "
                           "the file away")  # fmt: skip
    blocking = next((parent for parent in path.parents if parent.is_file()), None)
    if blocking is not None:
        return ConfigError(f"output_dir {path} cannot be created: {blocking} is a file, not a "
                           f"directory; {advice}")  # fmt: skip
    if not path.exists() and error.errno == errno.ENOENT:
        return ConfigError(f"output_dir {path} does not exist")
    reason = error.strerror or str(error)
    if error.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        where = error.filename or path
        return ConfigError(f"output_dir {path} cannot be created or written ({reason}: {where}): "
                           f"{advice} where you can write, or fix its permissions")  # fmt: skip
    return ConfigError(f"output_dir {path} cannot be used ({reason}): {advice}")


def _name_too_long(path: Path) -> ConfigError:
    """A path with a name longer than its file system allows (255 bytes on most), or longer
    than a path may be."""
    longest = max(path.parts, key=lambda part: len(os.fsencode(part)))
    size = len(os.fsencode(longest))
    if size > 255:
        return ConfigError(f"output_dir {path} cannot be used: its name {longest[:24]}... is "
                           f"{size} bytes long, and a file system allows 255: choose a shorter "
                           "output_dir")  # fmt: skip
    return ConfigError(f"output_dir {path} cannot be used: the path is longer than this system "
                       "allows (File name too long): choose a shorter output_dir")


def remove_run(path: Path) -> None:
    """The files a run wrote into `path` (`RUN_FILES`, and their temporary `.partial` copies),
    and nothing else."""
    for name in RUN_FILES:
        for target in (path / name, path / f"{name}{PARTIAL}"):
            if target.is_dir():
                shutil.rmtree(target)
            elif target.exists():
                target.unlink()


# The temporary name of a file or directory written whole or not at all (`write_whole`).
PARTIAL = ".partial"


def write_whole(path: Path, text: str) -> None:
    """`text` as the file `path`, whole or not at all: written under a temporary name, then
    renamed (a full disk or a kill leaves the file as it was). A failed write is the `OSError`."""
    partial = path.with_name(path.name + PARTIAL)
    try:
        partial.write_text(text)
        os.replace(partial, path)
    except BaseException:
        with contextlib.suppress(OSError):
            partial.unlink(missing_ok=True)
        raise


def check_writable(path: Path, what: str, advice: str) -> None:
    """Before the work whose result goes to the file `path`: that it can be written there (its
    directory made if need be, a file created in it), else one line (`ConfigError`) naming
    `what`, why, and `advice`."""
    if path.is_dir():
        raise ConfigError(f"cannot write {what} {path}: it is a directory; {advice}")
    blocking = next((parent for parent in path.parents if parent.is_file()), None)
    if blocking is not None:
        raise ConfigError(f"cannot write {what} {path}: {blocking} is a file, not a directory; "
                          f"{advice}")  # fmt: skip
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path.parent):
            pass
    except OSError as error:
        reason = error.strerror or str(error)
        raise ConfigError(f"cannot write {what} {path} ({reason}); {advice}") from None
