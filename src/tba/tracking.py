"""Experiment trackers (`report_to`): every number of a metric record, at the record's step, also
goes to TensorBoard (event files in RUN_DIR/tensorboard), Weights & Biases (RUN_DIR/wandb) and/or
Trackio (its local store).

A training process opens its trackers once (`open_trackers`) and closes them when the run ends;
`MetricsLog` hands them every record it writes to metrics.jsonl. The W&B run is named after the
run directory, in the project `WANDB_PROJECT` (default `tba`), with the run's config; W&B's
other environment variables (`WANDB_MODE=offline`, `WANDB_ENTITY`, `WANDB_RUN_ID` with
`WANDB_RESUME`) apply as usual. A resumed run reports as a new W&B run of the same name unless
`WANDB_RUN_ID` says otherwise.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Protocol

from tba.config import RunConfig
from tba.errors import ConfigError, first_line


class Tracker(Protocol):
    def log(self, numbers: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


def require_trackers(report_to: list[str]) -> None:
    """One line saying what to install for a tracker asked for without its package (the
    trackers' packages carry their names)."""
    for name in report_to:
        if importlib.util.find_spec(name) is None:
            raise ConfigError(f"report_to=[{name}] needs `pip install {name}`")


class TensorBoardTracker:
    def __init__(self, log_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, numbers: dict[str, float], step: int) -> None:
        for key, value in numbers.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    """One W&B run; silent, and without capturing the console (the progress bar stays ours)."""

    def __init__(self, config: RunConfig, run_dir: Path) -> None:
        import wandb

        try:
            self.run = wandb.init(
                project=os.environ.get("WANDB_PROJECT", "tba"), name=run_dir.resolve().name,
                dir=str(run_dir), config=config.model_dump(mode="json"),
                settings=wandb.Settings(silent=True, console="off"),
            )  # fmt: skip
        except wandb.errors.Error as error:  # e.g. no API key and no terminal to ask for one
            raise ConfigError(f"report_to=[wandb]: {first_line(error)}") from None

    def log(self, numbers: dict[str, float], step: int) -> None:
        self.run.log(numbers, step=step)

    def close(self) -> None:
        self.run.finish()


class TrackioTracker:
    """One Trackio run, in Trackio's local store (`TRACKIO_DIR`), in the project
    `TRACKIO_PROJECT` (default `tba`); `trackio show` opens its dashboard."""

    def __init__(self, config: RunConfig, run_dir: Path) -> None:
        import trackio

        self.trackio = trackio
        trackio.init(project=os.environ.get("TRACKIO_PROJECT", "tba"),
                     name=run_dir.resolve().name, config=config.model_dump(mode="json"))

    def log(self, numbers: dict[str, float], step: int) -> None:
        self.trackio.log(numbers, step=step)

    def close(self) -> None:
        self.trackio.finish()


class Trackers:
    """The trackers of one run, fed whole metric records."""

    def __init__(self, trackers: list[Tracker]) -> None:
        self.trackers = trackers

    def log(self, record: dict) -> None:
        """The record's numbers (booleans as 0/1) at its step; records without a step are not
        metrics of a step and are left out."""
        if not self.trackers or "step" not in record:
            return
        numbers = {key: value for key, value in record.items()
                   if isinstance(value, int | float) and key != "step"}  # fmt: skip
        for tracker in self.trackers:
            tracker.log(numbers, record["step"])

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.close()


def open_trackers(config: RunConfig, run_dir: Path) -> Trackers:
    require_trackers(config.report_to)
    trackers: list[Tracker] = []
    if "tensorboard" in config.report_to:
        trackers.append(TensorBoardTracker(run_dir / "tensorboard"))
    if "wandb" in config.report_to:
        trackers.append(WandbTracker(config, run_dir))
    if "trackio" in config.report_to:
        trackers.append(TrackioTracker(config, run_dir))
    return Trackers(trackers)
