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
from pathlib import Path

import torch
from common import minutes_to, pass_at_1_curve, plot_curves, run_tba  # the script's folder

from tba.quiet import quiet_libraries

MODES = {
    "sync": ["train.mode=sync", "searchers.count=0"],
    "async": ["train.mode=async", "searchers.count=1"],
}


def run(mode: str, out: Path, args: argparse.Namespace) -> Path:
    run_dir = out / mode
    overrides = [*MODES[mode], f"task.num_eval={args.num_eval}", f"seed={args.seed}"]
    run_tba(run_dir, [*overrides, *args.overrides], args.minutes, args.snapshot_minutes)
    return run_dir


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
    curves = {mode: r["curve"] for mode, r in results.items()}
    plot_curves(curves, args.target, args.out / "async_vs_sync.png")
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


if __name__ == "__main__":
    main()
