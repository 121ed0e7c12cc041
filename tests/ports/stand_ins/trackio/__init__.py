"""An offline stand-in for the `trackio` package (`init`, `log`, `finish`), for the port tests:
each call becomes a JSON line of TRACKIO_DIR/calls.jsonl."""

import json
import os
from pathlib import Path


def _record(call: str, **fields) -> None:
    path = Path(os.environ["TRACKIO_DIR"]) / "calls.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as file:
        file.write(json.dumps({"call": call, **fields}, default=str) + "\n")


def init(project, name=None, config=None, **kwargs):
    _record("init", project=project, name=name, has_config=config is not None)


def log(metrics, step=None):
    _record("log", step=step, keys=sorted(metrics))


def finish():
    _record("finish")
