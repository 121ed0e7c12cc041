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
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file


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
    """Appends one JSON line per record and flushes, so a killed run keeps what it logged; with
    `tensorboard` (a directory), also writes every number of a record as a TensorBoard scalar at
    the record's step."""

    def __init__(self, path: Path, tensorboard: Path | None = None) -> None:
        self.path = path
        self.file = path.open("a")
        self.board = tensorboard_writer(tensorboard) if tensorboard is not None else None

    def write(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.board is not None and "step" in record:
            for key, value in record.items():
                if isinstance(value, int | float) and key != "step":
                    self.board.add_scalar(key, value, record["step"])
            self.board.flush()

    def close(self) -> None:
        self.file.close()
        if self.board is not None:
            self.board.close()

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def require_tensorboard() -> None:
    """One line saying what to install when TensorBoard logging is asked for without it."""
    if importlib.util.find_spec("tensorboard") is None:
        from tba.config import ConfigError

        raise ConfigError("report_to=[tensorboard] needs `pip install tensorboard`")


def tensorboard_writer(log_dir: Path):
    require_tensorboard()
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(log_dir=str(log_dir))


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


METRIC_LABELS = {"eval_pass@1": "held-out greedy pass@1", "eval_asr": "attack success rate",
                 "eval_diversity": "attack diversity", "eval_win_rate": "win rate (gold judge)"}


def plot_curves(
    records: list[dict], path: Path, title: str = "", metrics: tuple[str, ...] = ("eval_pass@1",)
) -> None:
    """The held-out `metrics` (greedy pass@1 by default) and the reward of new samples against
    wall-clock minutes; below, how stale the trained samples were (optimizer steps since their
    weights were published)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    steps = [r for r in records if "reward_mean" in r]
    fig, (ax, lag) = plt.subplots(
        2, 1, figsize=(7, 6), dpi=110, sharex=True, gridspec_kw={"height_ratios": [2, 1]}
    )
    for name, color in zip(metrics, ("tab:blue", "tab:green", "tab:purple", "tab:brown")):
        evals = [r for r in records if name in r]
        label = METRIC_LABELS.get(name, name.removeprefix("eval_").replace("_", " "))
        ax.plot([r["time"] / 60 for r in evals], [r[name] for r in evals], "o-", color=color,
                label=label)  # fmt: skip
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
