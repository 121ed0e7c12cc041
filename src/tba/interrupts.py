"""Ctrl-C, SIGTERM and SIGHUP over a whole run, from its start to its end, and what a run that
stopped says: what it keeps and how to go on.

In the training loop a first signal asks the loop to stop after its step (then the run is
checkpointed, evaluated and saved); anywhere else (the start, the evaluations, the saves), or a
second time, the run stops at once, closing its searchers and Ray on the way out, and says in one
line what is kept and what `--resume` does (`tba.run.train` raises it as `Interrupted`).
SIGHUP (the terminal or the SSH session closed) is SIGTERM's twin, except that what the run
prints from then on goes nowhere: the terminal it would print to is gone.
"""

from __future__ import annotations

import contextlib
import os
import signal
import stat
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tba.checkpoint import list_checkpoints
from tba.run_dir import Replacement


class StopRequest(threading.Event):
    """Set when the run is asked to stop after its current step; `signal` says by which signal.
    The run notes here what it is doing, for the line that a signal ending it at once says
    (`stop_on_interrupt`, `interrupted_line`)."""

    signal: int | None = None
    phase = "while starting"  # what the run was doing, in words
    after_step = False  # in the training loop: a first signal stops the run after its step
    aborting = False  # a signal stops the run at once
    trained: int | None = None  # the step at which the loop reached its limit: the final
    # evaluation and save are left
    run_dir: Path | None = None
    replacement: Replacement | None = None  # the run this one replaces, set aside until then
    holding = False  # a moment not to cut short (`hold`): a signal waits for its end
    held: int | None = None  # the signal that waits

    @contextmanager
    def during(self, phase: str, *, after_step: bool = False) -> Iterator[None]:
        """The block is `phase` of the run, in words (`during the final evaluation`), for the
        line that a signal ending the run at once says; `after_step`: the block is the training
        loop, where a first signal stops the run after its step instead. `after_step` ends with
        the block; the phase lasts until the next one begins, so that what closes after the
        block (the searchers it stopped, the trainer of a run it saved, the run's files) is
        said to be its end. A block left by an exception leaves both as they were: the line
        then says where the run was."""
        self.phase, self.after_step = phase, after_step
        yield
        self.after_step = False

    def hold(self) -> None:
        """From now until `release`, a signal waits: Ray stopping its processes and shutting
        down must not be cut short by an exception raised inside it (the process can crash)."""
        self.holding = True

    def release(self) -> None:
        """The end of `hold`: a signal that came meanwhile is handled now, as it would have been
        then."""
        self.holding = False
        if self.held is not None:
            signum, self.held = self.held, None
            signal.raise_signal(signum)


# Ctrl-C; what `timeout`, Docker, Kubernetes and SLURM send before they kill a process; what a
# closed terminal or SSH session sends.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextmanager
def stop_on_interrupt() -> Iterator[StopRequest]:
    """Ctrl-C, SIGTERM and SIGHUP for a whole run, from its start to its end (a SIGHUP ignored,
    as `nohup` starts a process, stays ignored). In the training loop the first one asks the
    loop to stop after the current step (the run is then checkpointed, evaluated and saved);
    anywhere else (the start, the evaluations, the saves), or a second time, the run stops at
    once: a `KeyboardInterrupt` (what Ray's waits raise for one too) that closes the searchers
    and shuts Ray down on its way out, and that `train` turns into one line (`Interrupted`). A
    signal during that way out ends the process there."""
    stop = StopRequest()

    def handler(signum, frame) -> None:
        if stop.aborting:  # the way out is stuck, or the user will not wait for it
            os.write(2, f"tba: interrupted again by {signal.Signals(signum).name}: exiting at "
                        "once\n".encode())  # fmt: skip
            os._exit(128 + signum)
        if signum == signal.SIGHUP:
            leave_terminal()
        if stop.holding:
            stop.held = signum
            return
        stop.signal = signum
        if stop.after_step and not stop.is_set():
            stop.set()
            return
        stop.aborting = True
        raise KeyboardInterrupt

    if threading.current_thread() is not threading.main_thread():
        yield stop  # signals only reach the main thread
        return
    previous = {number: signal.signal(number, handler) for number in STOP_SIGNALS
                if number != signal.SIGHUP or signal.getsignal(number) is not signal.SIG_IGN}
    try:
        yield stop
    finally:
        for number, old in previous.items():
            signal.signal(number, old)


def leave_terminal() -> None:
    """After a hangup, what the run prints goes to /dev/null instead of its terminal: writing to
    a terminal that hung up fails (EIO), and would end the run's save with an error. Output to a
    file or a pipe is kept. (A hung-up terminal no longer answers `isatty`: any character device
    but /dev/null is taken for it.)"""
    with contextlib.suppress(OSError):
        null = os.open(os.devnull, os.O_WRONLY)
        try:
            for descriptor in (1, 2):
                with contextlib.suppress(OSError):
                    mode, device = os.fstat(descriptor), os.fstat(null)
                    if stat.S_ISCHR(mode.st_mode) and mode.st_rdev != device.st_rdev:
                        os.dup2(null, descriptor)
        finally:
            os.close(null)


@dataclass(frozen=True)
class Advice:
    """How the user goes on, in the caller's words (the command line's by default): `resume`
    continues or finishes the run in {path}; `keep` keeps a run in output_dir instead of
    replacing it."""

    resume: str = "`tba train --resume {path}`"
    keep: str = "without --overwrite it is kept"


COMMAND_LINE = Advice()  # the command line's words


def interrupted_line(stop: StopRequest, signum: int, advice: Advice) -> str:
    """What a run stopped at once by a signal says: when, what it keeps, how to go on."""
    return f"by {signal.Signals(signum).name} {stop.phase}; {going_on(stop, advice)}"


def going_on(stop: StopRequest, advice: Advice) -> str:
    """What a run that stopped before its end keeps, and how to finish it (`stop`: what it was
    doing; the run directory, after whatever it restored on its way out)."""
    replacement, run_dir = stop.replacement, stop.run_dir
    if replacement is not None and replacement.restored:
        return f"this run had no checkpoint yet: {replacement.what} is kept, as it was"
    checkpoints = list_checkpoints(run_dir) if run_dir is not None else []
    if not checkpoints:
        return "the run had no checkpoint yet: nothing to resume; start it again"
    resume, newest = advice.resume.format(path=run_dir), checkpoints[-1].name
    if stop.trained is not None and newest == f"step{stop.trained:06d}":
        return (f"its training is complete and checkpointed ({newest}): {resume} evaluates and "
                "saves it, without training")  # fmt: skip
    return f"{resume} continues it from its newest checkpoint, {newest}"
