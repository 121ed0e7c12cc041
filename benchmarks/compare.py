"""TB against the baselines and TRL's GRPOTrainer on the embedded math task, like for like.

Every run starts from the same base policy and spends the same generation budget per optimizer
step (B = 8 prompts x K = 16 completions, up to 40 tokens, temperature 1); only the objective,
the mode and the trainer differ. Runs save policy snapshots every `--snapshot-minutes` and are
scored afterwards (greedy pass@1 on the held-out split), so evaluation costs no training time.

    python benchmarks/compare.py                      # the main table, 8 minutes per run
    python benchmarks/compare.py --stress             # every objective asynchronous with k = 10
    python benchmarks/compare.py --only tba-async,dr_grpo-sync --minutes 2
    python benchmarks/compare.py --report runs/a runs/b --out runs/all   # one table from several

TRL needs the benchmark extra (`pip install -e ".[bench]"`); its learning rate is swept
(`--trl-lrs`) and every point of the sweep is reported, the best one in the main table.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from common import Curve, minutes_to, pass_at_1_curve, plot_curves, run_logged, run_tba

from tba.quiet import quiet_libraries

LOSSES = {
    "tb": "TBA",
    "dr_grpo": "Dr. GRPO",
    "grpo": "GRPO",
    "rloo": "RLOO",
    "proximal_rloo": "Proximal RLOO",
    "online_dpo": "Online DPO",
}
ASYNC = ["train.mode=async", "searchers.count=1"]
SYNC = ["train.mode=sync", "searchers.count=0"]


def methods(stress: bool) -> dict[str, tuple[str, list[str]]]:
    """run name -> (label, overrides)."""
    if stress:
        return {
            f"{loss}-async-k10": (f"{label} async, k = 10", [*ASYNC, f"train.loss={loss}",
                                                             "train.sync_every=10"])
            for loss, label in LOSSES.items()
        }  # fmt: skip
    table = {"tb-async": ("TBA async", [*ASYNC, "train.loss=tb"])}
    for loss, label in LOSSES.items():
        table[f"{loss}-sync"] = (f"{label} sync", [*SYNC, f"train.loss={loss}"])
    for loss in ("dr_grpo", "online_dpo"):
        table[f"{loss}-async"] = (f"{LOSSES[loss]} async", [*ASYNC, f"train.loss={loss}"])
    return table


def run_trl(run_dir: Path, learning_rate: float, args: argparse.Namespace) -> None:
    command = [
        sys.executable, str(Path(__file__).parent / "trl_grpo.py"), "--out", str(run_dir),
        "--minutes", str(args.minutes), "--learning-rate", str(learning_rate),
        "--snapshot-minutes", str(args.snapshot_minutes), "--seed", str(args.seed),
        f"task.num_eval={args.num_eval}",
    ]  # fmt: skip
    run_logged(command, run_dir)


def summarize(label: str, run_dir: Path, curve: Curve, target: float) -> dict:
    summary = json.loads((run_dir / "eval.json").read_text())
    return {
        "label": label,
        "curve": curve,
        "minutes_to_target": minutes_to(target, curve),
        "final_pass@1": curve[-1][2],
        "samples_per_s": summary["samples_per_s"],
        "steps": summary["steps"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=8.0, help="training budget per run")
    parser.add_argument("--target", type=float, default=0.55, help="held-out pass@1 target")
    parser.add_argument("--snapshot-minutes", type=float, default=0.5)
    parser.add_argument("--num-eval", type=int, default=512, help="held-out problems")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stress", action="store_true", help="every objective async, k = 10")
    parser.add_argument("--only", help="comma-separated run names (default: all)")
    parser.add_argument("--trl-lrs", default="1e-5,5e-5,2e-4", help="TRL learning rates to try")
    parser.add_argument("--no-trl", action="store_true", help="skip TRL's GRPOTrainer")
    parser.add_argument("--out", type=Path, default=Path("runs/compare"))
    parser.add_argument("--report", type=Path, nargs="+", metavar="DIR",
                        help="run nothing: merge the results.json of earlier invocations into one "
                        "table and plot (written to --out)")  # fmt: skip
    args = parser.parse_args()
    if args.report:
        report(args)
        return
    if args.out.exists():
        parser.error(f"{args.out} exists; choose another --out")
    torch.set_num_threads(2)
    quiet_libraries()

    runs = methods(args.stress)
    if not args.stress and not args.no_trl:
        for lr in args.trl_lrs.split(","):
            runs[f"trl-grpo-lr{lr}"] = (f"TRL GRPOTrainer, lr {lr}", [])
    if args.only:
        runs = {name: runs[name] for name in args.only.split(",")}
    results = {}
    for name, (label, overrides) in runs.items():
        run_dir = args.out / name
        if name.startswith("trl-"):
            run_trl(run_dir, float(name.removeprefix("trl-grpo-lr")), args)
        else:
            run_tba(run_dir, [*overrides, f"task.num_eval={args.num_eval}", f"seed={args.seed}"],
                    args.minutes, args.snapshot_minutes)  # fmt: skip
        results[name] = summarize(label, run_dir, pass_at_1_curve(run_dir), args.target)
        (args.out / "results.json").write_text(json.dumps(results, indent=2))
    plot_curves(
        {r["label"]: r["curve"] for r in results.values()}, args.target, args.out / "compare.png"
    )
    print_table(results, args)


def report(args: argparse.Namespace) -> None:
    """One table and plot from several invocations (same --minutes, --target and --num-eval)."""
    results = {}
    for directory in args.report:
        results |= json.loads((directory / "results.json").read_text())
    results = dict(sorted(results.items(), key=lambda kv: -kv[1]["final_pass@1"]))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=2))
    plot_curves(
        {r["label"]: r["curve"] for r in results.values()}, args.target, args.out / "compare.png"
    )
    print_table(results, args)


def print_table(results: dict, args: argparse.Namespace) -> None:
    def minutes(value: float | None) -> str:
        return f"{value:.1f}" if value is not None else f"> {args.minutes:g}"

    print(f"\ntarget pass@1 {args.target:.3f}, {args.minutes:g} min per run, "
          f"{args.num_eval} held-out problems")  # fmt: skip
    print("| method | minutes to target | pass@1 at end | samples/s | steps |")
    print("|---|---|---|---|---|")
    for r in results.values():
        print(
            f"| {r['label']} | {minutes(r['minutes_to_target'])} | {r['final_pass@1']:.3f} | "
            f"{r['samples_per_s']:.0f} | {r['steps']} |"
        )


if __name__ == "__main__":
    main()
