"""The logs a run writes as it goes, and reading them back: metrics.jsonl (`MetricsLog`, also
handed to the run's trackers), events.jsonl (`EventLog`), attacks.jsonl and completions.jsonl
(`SampleLog`), policy snapshots (`save_snapshot`); the records of a metrics.jsonl
(`read_metrics`), cut back to a resumed step (`truncate_metrics`), the fresh samples up to each
(`samples_consumed`) and the run's headline held-out metric (`headline_metric`)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from tba.errors import ConfigError, RunError
from tba.tracking import Trackers


def truncate_metrics(path: Path, last_step: int, *, ending: bool = False) -> None:
    """Drop the records of steps after `last_step`: a resumed run redoes them; `ending`: also the
    final evaluation's record at `last_step`, which a run resumed to be evaluated and saved
    writes again."""
    if not path.exists():
        return
    kept = [record for record in read_metrics(path) if record["step"] < last_step or (
        record["step"] == last_step and not (ending and _final_record(record)))]  # fmt: skip
    partial = path.with_name(path.name + ".partial")
    partial.write_text("".join(json.dumps(record) + "\n" for record in kept))
    os.replace(partial, path)


def _final_record(record: dict) -> bool:
    """The final evaluation's record: held-out metrics at the last step, neither a step's own
    record (with its loss) nor a snapshot's."""
    return record["step"] > 0 and "loss" not in record and "snapshot" not in record


class MetricsLog:
    """Appends one JSON line per record and flushes, so a killed run keeps what it logged; hands
    every record to the run's `trackers` too (TensorBoard, W&B: `tba.tracking`), which their
    owner opens once per run and closes."""

    def __init__(self, path: Path, trackers: Trackers | None = None) -> None:
        self.path = path
        self.file = path.open("a")
        self.trackers = trackers

    def write(self, record: dict) -> None:
        try:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        except OSError as error:  # a full disk: the run cannot record what it does
            raise RunError(f"cannot write {self.path}: {error.strerror or error}") from None
        if self.trackers is not None:
            self.trackers.log(record)

    def close(self) -> None:
        self.file.close()

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class EventLog:
    """Notable events, one JSON line each; all but routine ones also go to the console."""

    ROUTINE = {"searcher_ready", "checkpoint"}

    def __init__(self, path: Path, log: Callable[[str], None]) -> None:
        self.metrics = MetricsLog(path)
        self.log = log

    def __call__(self, kind: str, **fields) -> None:
        self.metrics.write({"time": time.time(), "event": kind, **fields})
        if kind not in self.ROUTINE or fields.get("incarnation"):
            self.log(f"{kind}: " + ", ".join(f"{k}={v}" for k, v in fields.items()))

    def close(self) -> None:
        self.metrics.close()


class SampleLog:
    """New samples written to a JSON-lines file as they arrive: the completion's text, the step,
    its reward, the reward's parts and extras, whatever `annotate(text)` adds, and with `prompts`
    (the training rows' prompts, by prompt id) the prompt. `distinct`: each distinct completion
    once (attacks.jsonl); otherwise every sample (completions.jsonl). A resumed run goes on
    appending."""

    def __init__(
        self, path: Path, tokenizer, *, annotate: Callable[[str], dict] | None = None,
        distinct: bool = True, prompts: list | None = None,
    ) -> None:  # fmt: skip
        self.path, self.tokenizer, self.annotate = path, tokenizer, annotate
        self.distinct, self.prompts = distinct, prompts
        self.seen: set[str] = set()
        if distinct and path.exists():
            self.seen = {json.loads(line)["completion"] for line in path.read_text().splitlines()
                         if line.strip()}  # fmt: skip
        self.file = path.open("a")

    def write(self, samples: list, step: int) -> None:
        texts = self.tokenizer.batch_decode([s.response_ids for s in samples],
                                            skip_special_tokens=True)  # fmt: skip
        for sample, text in zip(samples, texts):
            text = text.strip()
            if self.distinct:
                if text in self.seen:
                    continue
                self.seen.add(text)
            record = {"completion": text, "step": step, "reward": sample.reward,
                      **sample.reward_parts, **sample.extras}  # fmt: skip
            if self.prompts is not None:
                record = {"prompt": self.prompts[sample.prompt_id], **record,
                          "truncated": sample.truncated, "version": sample.version}  # fmt: skip
            if self.annotate is not None:
                record |= self.annotate(text)
            self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def save_snapshot(run_dir: Path, weights: dict[str, np.ndarray], step: int) -> str:
    """Policy weights as snapshots/stepNNNNNN.safetensors; returns the path relative to run_dir,
    as metrics.jsonl records it."""
    path = Path("snapshots") / f"step{step:06d}.safetensors"
    (run_dir / "snapshots").mkdir(exist_ok=True)
    save_file(weights, run_dir / path)
    return str(path)


def read_metrics(path: Path) -> list[dict]:
    """The records of a metrics.jsonl (or events.jsonl). A last line cut short (the process was
    killed while writing it) is left out: its record is lost, the file is not. Any other line that
    is not JSON is a damaged file: one line naming it."""
    lines = path.read_text().splitlines()
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as error:
            if number == len(lines):
                break
            raise ConfigError(f"{path}, line {number}, is not a JSON record ({error.msg}): the "
                              "file is damaged") from None  # fmt: skip
    return records


def samples_consumed(records: list[dict]) -> list[int]:
    """Fresh samples generated up to each record: tba runs log the samples merged at each step
    (`samples_in`) and VinePPO's rollouts for its values (`rollouts_in`), other trainers their
    running total (`samples`)."""
    totals, samples = [], 0
    for record in records:
        arrived = record.get("samples_in", 0) + record.get("rollouts_in", 0)
        samples = record.get("samples", samples + arrived)
        totals.append(samples)
    return totals


def headline_metric(records: list[dict]) -> str | None:
    """The first held-out metric the run evaluated: its task's headline one (math: greedy
    pass@1; custom: `eval_pass@1` or `eval_reward`; red-teaming: `eval_asr`)."""
    for record in records:
        for key in record:
            if key.startswith("eval_"):
                return key
    return None
