"""Shared by the benchmarks: run `tba train` in its own process, score the policy snapshots a run
saved (greedy pass@1 on the held-out split, after the run, so evaluation costs no training time),
and draw pass@1 against wall-clock minutes."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from safetensors.numpy import load_file
from transformers import AutoTokenizer

from tba.config import load_config
from tba.evaluation import greedy_pass_at_1
from tba.policy.model import load_model, set_weights
from tba.rundir import read_metrics
from tba.tasks import build_task

Curve = list[tuple[float, int, float]]  # (minutes, step, greedy pass@1)


def run_tba(run_dir: Path, overrides: list[str], minutes: float, snapshot_minutes: float) -> None:
    """`tba train` for `minutes` of training, saving snapshots instead of evaluating in the run."""
    command = [
        sys.executable, "-m", "tba.cli", "train", *overrides,
        f"train.max_minutes={minutes}", "train.max_steps=1000000", "eval.every=1000000",
        f"eval.snapshot_minutes={snapshot_minutes}", f"output_dir={run_dir}",
    ]  # fmt: skip
    run_logged(command, run_dir)


def run_logged(command: list[str], run_dir: Path) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {run_dir.name}: {' '.join(command[2:])}", flush=True)
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    with (run_dir.parent / f"{run_dir.name}.log").open("w") as log:
        subprocess.run(command, check=True, stdout=log, stderr=subprocess.STDOUT)


def pass_at_1_curve(run_dir: Path, base: float | None = None) -> Curve:
    """Greedy pass@1 at every snapshot of a run; `base` (or the run's own step-0 evaluation)
    stands for minute 0 unless the run saved a snapshot there."""
    config = load_config(run_dir / "config.yaml")
    task = build_task(
        config.task.name, num_train=1, num_eval=config.task.num_eval, seed=config.seed
    )
    tokenizer = AutoTokenizer.from_pretrained(run_dir / "final")
    model = load_model(str(run_dir / "final"), "cpu")
    records = read_metrics(run_dir / "metrics.jsonl")
    curve: Curve = []
    if base is not None or "eval_pass@1" in records[0]:
        curve.append((0.0, 0, base if base is not None else records[0]["eval_pass@1"]))
    for record in records:
        if "snapshot" in record:
            set_weights(model, load_file(run_dir / record["snapshot"]))
            score = greedy_pass_at_1(
                model, tokenizer, task.eval_rows, task.correct_fn,
                max_new_tokens=config.policy.max_new_tokens,
            )  # fmt: skip
            curve.append((record["time"] / 60, record["step"], score))
    return curve


def minutes_to(target: float, curve: Curve) -> float | None:
    return next((minutes for minutes, _, score in curve if score >= target), None)


def plot_curves(curves: dict[str, Curve], target: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    colors = plt.cm.tab20.colors if len(curves) > 10 else plt.cm.tab10.colors
    for (name, curve), color in zip(curves.items(), colors):
        minutes, _, scores = zip(*curve)
        ax.plot(minutes, scores, marker="o", markersize=3, label=name, color=color)
    ax.axhline(target, color="grey", linestyle=":", label="target")
    ax.set_xlabel("wall-clock minutes of training")
    ax.set_ylabel("held-out greedy pass@1")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
