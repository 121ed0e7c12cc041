"""What a run leaves behind: one directory with config, metrics, evaluation, plot, checkpoint.

<run_dir>/config.yaml      the resolved configuration
<run_dir>/metrics.jsonl    one JSON object per optimizer step (eval fields when evaluated)
<run_dir>/events.jsonl     searchers started, died and restarted; reward faults; skipped
                           steps; checkpoints written or failed; interruptions and resumes
<run_dir>/checkpoints/     everything `tba train --resume` needs (see tba.checkpoint)
<run_dir>/searchers/       per searcher process: samples made and prompt-stream position
<run_dir>/eval.json        base and final evaluation, waiting fraction, staleness histograms
                           (weight versions and optimizer steps), fresh and repeated groups
<run_dir>/attacks.jsonl    (red-teaming) every distinct attack the searchers made, with its
                           reward, toxicity and, in the embedded world, the modes it triggers
<run_dir>/snapshots/       policy weights every `eval.snapshot_minutes`, if asked (fp32, keys
                           of the base model; with LoRA the adapters merged in)
<run_dir>/curves.png       held-out pass@1 and mean reward against wall-clock minutes, and the
                           staleness of the trained samples in optimizer steps
<run_dir>/final/           the trained policy and its tokenizer, loadable with `from_pretrained`;
                           with LoRA: the adapters merged into the base weights (merged tensors
                           in fp32), and the adapters alone in final/adapter/
                           (`peft.PeftModel.from_pretrained(base_model, "final/adapter")`)
<run_dir>/tensorboard/     with report_to=[tensorboard]: every metric as a TensorBoard scalar
<run_dir>/wandb/           with report_to=[wandb]: the Weights & Biases run's local files
<run_dir>/eval_final.json  written by `tba eval`: the final policy scored after the run
<run_dir>/eval_snapshots.json  written by `tba eval --snapshots`: the base policy and every
                           snapshot scored after the run (see tba.scoring)
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from safetensors.numpy import save_file

from tba.errors import ConfigError

if TYPE_CHECKING:
    from tba.tracking import Trackers


def create_run_dir(output_dir: str | None, overwrite: bool = False) -> Path:
    """A new run directory; one that already holds a run is refused unless `overwrite`."""
    path = Path(output_dir or Path("runs") / time.strftime("%Y%m%d-%H%M%S"))
    if (path / "config.yaml").exists() or (path / "metrics.jsonl").exists():
        if not overwrite:
            raise FileExistsError(
                f"run directory {path} already holds a run; continue it with `tba train --resume "
                f"{path}`, replace it with --overwrite, or choose another output_dir"
            )
        shutil.rmtree(path)
    path.mkdir(parents=True, exist_ok=True)
    return path


def truncate_metrics(path: Path, last_step: int) -> None:
    """Drop the records of steps after `last_step`: a resumed run redoes them."""
    if not path.exists():
        return
    kept = [line for line in path.read_text().splitlines()
            if line.strip() and json.loads(line)["step"] <= last_step]  # fmt: skip
    partial = path.with_name(path.name + ".partial")
    partial.write_text("".join(line + "\n" for line in kept))
    os.replace(partial, path)


class MetricsLog:
    """Appends one JSON line per record and flushes, so a killed run keeps what it logged; hands
    every record to the run's `trackers` too (TensorBoard, W&B: `tba.tracking`), which their
    owner opens once per run and closes."""

    def __init__(self, path: Path, trackers: Trackers | None = None) -> None:
        self.path = path
        self.file = path.open("a")
        self.trackers = trackers

    def write(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
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
    """Every distinct completion the searchers made, written once to a JSON-lines file as it
    first arrives: the text, the step, its reward, the reward's parts and extras, and whatever
    `annotate(text)` adds. A resumed run reads the file back and goes on appending."""

    def __init__(self, path: Path, tokenizer, annotate: Callable[[str], dict] | None = None):
        self.path, self.tokenizer, self.annotate = path, tokenizer, annotate
        self.seen: set[str] = set()
        if path.exists():
            self.seen = {json.loads(line)["completion"] for line in path.read_text().splitlines()
                         if line.strip()}  # fmt: skip
        self.file = path.open("a")

    def write(self, samples: list, step: int) -> None:
        texts = self.tokenizer.batch_decode([s.response_ids for s in samples],
                                            skip_special_tokens=True)  # fmt: skip
        for sample, text in zip(samples, texts):
            text = text.strip()
            if text in self.seen:
                continue
            self.seen.add(text)
            record = {"completion": text, "step": step, "reward": sample.reward,
                      **sample.reward_parts, **sample.extras}  # fmt: skip
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
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def samples_consumed(records: list[dict]) -> list[int]:
    """Fresh samples consumed up to each record: tba runs log the samples merged at each step
    (`samples_in`), other trainers their running total (`samples`)."""
    totals, samples = [], 0
    for record in records:
        samples = record.get("samples", samples + record.get("samples_in", 0))
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


METRIC_LABELS = {
    "eval_pass@1": "held-out greedy pass@1", "eval_asr": "attack success rate",
    "eval_diversity": "attack diversity", "eval_win_rate": "win rate (gold judge)",
}  # fmt: skip
X_AXES = {
    "minutes": "wall-clock minutes of training", "steps": "optimizer steps",
    "samples": "fresh samples consumed",
}  # fmt: skip


def metric_label(name: str) -> str:
    return METRIC_LABELS.get(name, name.removeprefix("eval_").replace("_", " "))


def metric_curve(records: list[dict], metric: str, x: str = "minutes") -> tuple[list, list]:
    """(x, value) of every record that holds `metric`, x in `X_AXES`."""
    totals = samples_consumed(records)
    points = [(record, total) for record, total in zip(records, totals) if metric in record]
    xs = {"minutes": [r["time"] / 60 for r, _ in points], "steps": [r["step"] for r, _ in points],
          "samples": [total for _, total in points]}[x]  # fmt: skip
    return xs, [r[metric] for r, _ in points]


def plot_runs(
    runs: dict[str, list[dict]], path: Path, metrics: Sequence[str], x: str = "minutes"
) -> None:
    """The held-out `metrics` of several runs (label -> metric records), one panel per metric,
    one line per run, against `x` (minutes, steps or samples)."""
    plt = _pyplot()
    fig, axes = plt.subplots(len(metrics), 1, figsize=(7, 1 + 3.2 * len(metrics)), dpi=110,
                             sharex=True, squeeze=False)  # fmt: skip
    for ax, metric in zip(axes[:, 0], metrics):
        for label, records in runs.items():
            xs, values = metric_curve(records, metric, x)
            if values:
                ax.plot(xs, values, "o-", markersize=3, label=label)
        ax.set_ylabel(metric_label(metric))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[-1, 0].set_xlabel(X_AXES[x])
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_run_dirs(
    run_dirs: Sequence[Path], path: Path, metrics: Sequence[str] = (), x: str = "minutes"
) -> list[str]:
    """`tba plot`: `plot_runs` of these run directories, labelled by their names (by their paths
    when names repeat); `metrics` default to each run's headline one. Returns the metrics drawn."""
    names = [run_dir.resolve().name for run_dir in run_dirs]
    labels = names if len(set(names)) == len(names) else [str(d) for d in run_dirs]
    runs = {}
    for label, run_dir in zip(labels, run_dirs):
        if not (run_dir / "metrics.jsonl").is_file():
            raise FileNotFoundError(f"{run_dir}: no run there (metrics.jsonl not found)")
        runs[label] = read_metrics(run_dir / "metrics.jsonl")
    recorded = {key for records in runs.values() for record in records for key in record}
    if metrics:
        metrics = [_recorded_name(name, recorded) for name in metrics]
    else:
        metrics = list(dict.fromkeys(filter(None, map(headline_metric, runs.values()))))
        if not metrics:
            raise ConfigError("these runs have no held-out evaluation in their metrics.jsonl")
    path.parent.mkdir(parents=True, exist_ok=True)
    plot_runs(runs, path, metrics, x)
    return metrics


def _recorded_name(name: str, recorded: set[str]) -> str:
    """`name` as the runs record it: as given, or with the `eval_` prefix of held-out metrics."""
    for candidate in (name, f"eval_{name}"):
        if candidate in recorded:
            return candidate
    held_out = sorted(key for key in recorded if key.startswith("eval_") or "pass@" in key)
    raise ConfigError(f"--metric {name}: no run recorded it (held-out metrics recorded: "
                      f"{', '.join(held_out) or 'none'})")  # fmt: skip


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    return plt


def plot_curves(
    records: list[dict], path: Path, title: str = "", metrics: tuple[str, ...] = ("eval_pass@1",)
) -> None:
    """The held-out `metrics` (greedy pass@1 by default) and the reward of new samples against
    wall-clock minutes; below, how stale the trained samples were (optimizer steps since their
    weights were published)."""
    plt = _pyplot()
    steps = [r for r in records if "reward_mean" in r]
    fig, (ax, lag) = plt.subplots(
        2, 1, figsize=(7, 6), dpi=110, sharex=True, gridspec_kw={"height_ratios": [2, 1]}
    )
    for name, color in zip(metrics, ("tab:blue", "tab:green", "tab:purple", "tab:brown")):
        ax.plot(*metric_curve(records, name), "o-", color=color, label=metric_label(name))
    ax.set_ylabel("held-out metric")
    ax.set_ylim(0.0, 1.0)
    ax.grid(alpha=0.3)
    ax.set_title(title)
    # The reward of the samples that arrived at each step, on its own axis (rewards may be log
    # probabilities): what the searchers' policy scores; a batch's own mean mixes in replay.
    minutes = [r["time"] / 60 for r in steps]
    reward_axis = ax.twinx()
    arrived = [r for r in steps if r.get("samples_in")]
    if arrived:
        reward_axis.plot([r["time"] / 60 for r in arrived],
                         _moving_average([r["reward_in"] for r in arrived], 25), color="tab:orange",
                         label="reward of new samples (25-step average)")  # fmt: skip
    else:
        reward_axis.plot(minutes, _moving_average([r["reward_mean"] for r in steps], 25),
                         color="tab:orange",
                         label="batch mean reward (25-step average)")  # fmt: skip
    reward_axis.set_ylabel("reward", color="tab:orange")
    lines = ax.get_legend_handles_labels()
    more = reward_axis.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], loc="lower right", fontsize=8)
    staleness = [r.get("staleness_steps_mean", 0.0) for r in steps]
    lag.plot(minutes, [r.get("staleness_steps_max", 0.0) for r in steps], color="tab:red",
             alpha=0.3, linewidth=0.8, label="max in the batch")  # fmt: skip
    lag.plot(minutes, _moving_average(staleness, 25), color="tab:red",
             label="batch mean (25-step average)")  # fmt: skip
    lag.set_xlabel("wall-clock minutes")
    lag.set_ylabel("staleness (steps)")
    lag.grid(alpha=0.3)
    lag.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _moving_average(values: list[float], window: int) -> list[float]:
    """Trailing mean over the last `window` values (fewer at the start)."""
    sums = [0.0]
    for value in values:
        sums.append(sums[-1] + value)
    return [
        (sums[i + 1] - sums[max(0, i + 1 - window)]) / min(i + 1, window)
        for i in range(len(values))
    ]
