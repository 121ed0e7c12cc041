"""Errors that end a run with one line for the user, kept free of heavy imports (and of every other
tba module) so that any module can raise them and the CLI can catch them cheaply: bad input exits
with status 2, a run that cannot go on with status 1."""

from collections.abc import Iterator
from contextlib import contextmanager

from safetensors import SafetensorError


class ConfigError(ValueError):
    """A bad configuration value, file or override; the message is one line meant for users."""


class DatasetError(ConfigError):
    """A dataset that cannot be read, or a row without a field the task needs (one line)."""


class CheckpointError(ValueError):
    """A checkpoint that is missing, damaged or does not fit this run (bad input)."""


class RunError(RuntimeError):
    """A run cannot go on; the message says what failed and why."""


class SearcherError(RunError):
    """A searcher failed in a way the run cannot recover from."""


class RewardError(RunError):
    """A reward function failed on every one of its last calls."""


class TrainingError(RunError):
    """Training itself cannot go on (e.g. non-finite losses step after step)."""


class Interrupted(KeyboardInterrupt):
    """A run stopped by Ctrl-C or SIGTERM where it could not first finish its step and save: the
    message says when, what is kept and how to go on; `signum` is the signal (the exit status is
    128 + it, the shell's convention)."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.signum = signum


def first_line(error: BaseException) -> str:
    """An exception's message in one line: its first non-empty line (with the next one when it
    ends with a colon), else its type."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if not lines:
        return type(error).__name__
    return f"{lines[0]} {lines[1]}" if lines[0].endswith(":") and len(lines) > 1 else lines[0]


@contextmanager
def writing(what: str) -> Iterator[None]:
    """A failed write (a full disk, a read-only directory) as the `OSError` it is, naming `what`:
    safetensors reports its own I/O failures as `SafetensorError`, which is not one."""
    try:
        yield
    except SafetensorError as error:
        raise OSError(f"{what}: {error}") from error
