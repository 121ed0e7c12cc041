"""A new run directory (`create_run_dir`): made, owned by this process, and cleared of a run
that stopped before its first checkpoint, or, with `overwrite`, of the run it holds, which is
set aside until the new run has its first checkpoint (`tba.run_dir.replacement`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

from tba.run_dir.directory import (
    RunExistsError,
    describe_run,
    holds_run,
    own_run_dir,
    remove_run,
    unusable_output_dir,
)
from tba.run_dir.replacement import Replacement, set_aside, settle_replacement


def create_run_dir(
    output_dir: str | None, overwrite: bool = False, log: Callable[[str], None] = print,
    *, owner: ExitStack, keep: str = "without --overwrite it is kept",
) -> tuple[Path, Replacement | None]:  # fmt: skip
    """A new run directory, owned (`own_run_dir`) until `owner` closes. One that holds a run
    (`holds_run`) is refused unless `overwrite`; with it, that run is said (`keep`: how the caller
    keeps it instead) and set aside (`set_aside`) until the new run has its first checkpoint,
    restored if it stops before (the `Replacement`, also settled when `owner` closes). The files of
    a run that stopped before its first checkpoint (a failed start) are replaced."""
    path = Path(output_dir or Path("runs") / time.strftime("%Y%m%d-%H%M%S"))
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise unusable_output_dir(path, error) from None
    owner.enter_context(own_run_dir(path))
    settle_replacement(path, log)
    if holds_run(path) and not overwrite:
        raise RunExistsError(path)
    if holds_run(path):
        what = describe_run(path)
        log(f"replacing {what} once this run has its first checkpoint; {keep}")
        return path, owner.enter_context(set_aside(path, what, log))
    if (path / "config.yaml").exists() or (path / "metrics.jsonl").exists():
        log(f"replacing the run in {path}: it stopped before its first checkpoint")
        remove_run(path)
    return path, None
