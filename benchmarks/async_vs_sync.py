"""Asynchronous against synchronous TB on the embedded math task, from the same base policy.

Each mode runs as its own `tba train` process for the same wall-clock budget with the same
hyperparameters (B, K, learning rate, beta, m, k); only `train.mode` and where generation runs
differ. Neither run pauses to evaluate: both save the policy every `--snapshot-minutes`, and the
snapshots are scored afterwards (greedy pass@1 on the held-out split), so evaluation costs neither
mode any training time. The table gives the time each mode takes to reach the pass@1 target,
their ratio, pass@1 at the end of the budget, and the trainer's waiting fraction.

    python benchmarks/async_vs_sync.py                  # 8 minutes per mode (about 20 in all)
    python benchmarks/async_vs_sync.py --minutes 2 --target 0.5

The synchronous baseline runs its searcher inside the trainer process (`searchers.count=0`): on
this 2-core machine that is its fastest setting (both cores for generation, then both for the
update), ahead of two searcher processes. The asynchronous run has one searcher process and the
trainer on the other core.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.numpy import load_file
from transformers import AutoTokenizer

from tba.config import load_config
from tba.evaluation import greedy_pass_at_1
from tba.policy.model import load_model, set_weights
from tba.quiet import quiet_libraries
from tba.rundir import read_metrics
from tba.tasks import build_task

MODES = {
    "sync": ["train.mode=sync", "searchers.count=0"],
    "async": ["train.mode=async", "searchers.count=1"],
}


def run(mode: str, out: Path, args: argparse.Namespace) -> Path:
    run_dir = out / mode
    command = [
        sys.executable, "-m", "tba.cli", "train", *MODES[mode],
        f"train.max_minutes={args.minutes}", "train.max_steps=1000000", "eval.every=1000000",
        f"eval.snapshot_minutes={args.snapshot_minutes}", f"task.num_eval={args.num_eval}",
        f"seed={args.seed}", f"output_dir={run_dir}", *args.overrides,
    ]  # fmt: skip
    print(f"[{time.strftime('%H:%M:%S')}] {mode}: {' '.join(command[3:])}", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    with (out / f"{mode}.log").open("w") as log:
        subprocess.run(command, check=True, stdout=log, stderr=subprocess.STDOUT)
    return run_dir


def pass_at_1_curve(run_dir: Path) -> list[tuple[float, int, float]]:
    """(minutes, step, greedy pass@1) at the start and at every snapshot."""
    config = load_config(run_dir / "config.yaml")
    task = build_task(
        config.task.name, num_train=1, num_eval=config.task.num_eval, seed=config.seed
    )
    tokenizer = AutoTokenizer.from_pretrained(run_dir / "final")
    model = load_model(str(run_dir / "final"), "cpu")
    records = read_metrics(run_dir / "metrics.jsonl")
    curve = [(0.0, 0, records[0]["eval_pass@1"])]
    for record in records:
        if "snapshot" in record:
            set_weights(model, load_file(run_dir / record["snapshot"]))
            score = greedy_pass_at_1(
                model, tokenizer, task.eval_rows, task.correct_fn,
                max_new_tokens=config.policy.max_new_tokens,
            )  # fmt: skip
            curve.append((record["time"] / 60, record["step"], score))
    return curve


def minutes_to(target: float, curve: list[tuple[float, int, float]]) -> float | None:
    return next((minutes for minutes, _, score in curve if score >= target), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=8.0, help="training budget per mode")
    parser.add_argument("--target", type=float, default=0.55, help="held-out pass@1 target")
    parser.add_argument("--snapshot-minutes", type=float, default=0.5)
    parser.add_argument("--num-eval", type=int, default=512, help="held-out problems")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("runs/async_vs_sync"))
    parser.add_argument("--modes", default="sync,async", help="comma-separated: sync, async")
    parser.add_argument("overrides", nargs="*", help="key=value for both runs")
    args = parser.parse_args()
    if args.out.exists():
        parser.error(f"{args.out} exists; choose another --out")
    torch.set_num_threads(2)
    quiet_libraries()

    results = {}
    for mode in args.modes.split(","):
        run_dir = run(mode, args.out, args)
        summary = json.loads((run_dir / "eval.json").read_text())
        curve = pass_at_1_curve(run_dir)
        results[mode] = {
            "curve": curve,
            "minutes_to_target": minutes_to(args.target, curve),
            "final_pass@1": summary["final"]["eval_pass@1"],
            "steps": summary["steps"],
            "trainer_wait_frac": summary["trainer_wait_frac"],
        }
    (args.out / "results.json").write_text(json.dumps(results, indent=2))
    plot(results, args.target, args.out / "async_vs_sync.png")
    print_table(results, args)


def print_table(results: dict, args: argparse.Namespace) -> None:
    def minutes(value: float | None) -> str:
        return f"{value:.1f}" if value is not None else f"> {args.minutes:g}"

    base = next(iter(results.values()))["curve"][0][2]
    print(f"\nbase pass@1 {base:.3f}, target {args.target:.3f}, {args.minutes:g} min per mode")
    print("| mode | minutes to target | pass@1 at end | steps | steps/min | trainer waiting |")
    print("|---|---|---|---|---|---|")
    for mode, r in results.items():
        print(
            f"| {mode} | {minutes(r['minutes_to_target'])} | {r['final_pass@1']:.3f} | "
            f"{r['steps']} | {r['steps'] / args.minutes:.0f} | {r['trainer_wait_frac']:.1%} |"
        )
    sync_t = results.get("sync", {}).get("minutes_to_target")
    async_t = results.get("async", {}).get("minutes_to_target")
    if sync_t is not None and async_t is not None:
        print(f"\nasync reaches the target {sync_t / async_t:.2f}x as fast as sync")
    else:
        print("\nspeed-up: not measurable (a mode did not run or reach the target in the budget)")


def plot(results: dict, target: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for mode, r in results.items():
        minutes, _, scores = zip(*r["curve"])
        ax.plot(minutes, scores, marker="o", markersize=3, label=mode)
    ax.axhline(target, color="grey", linestyle=":", label="target")
    ax.set_xlabel("wall-clock minutes of training")
    ax.set_ylabel("held-out greedy pass@1")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
