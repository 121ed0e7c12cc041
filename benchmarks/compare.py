"""TB against the baselines and TRL's GRPOTrainer on the embedded math task, over several seeds.

Every run starts from the same base policy and spends the same generation budget per optimizer
step (B = 8 prompts x K = 16 completions, up to 40 tokens, temperature 1, unless a suite varies
it); only what a suite compares differs. Runs save policy snapshots every `--snapshot-minutes`;
all are scored afterwards on the same held-out problems, so evaluation costs no training time.
The table gives, per method, the time to the target read from the mean curve over seeds (and
each seed's own), pass@1 at the end (mean ± std), the gain over the base and the lowest point
any seed reached along the way; the plot shows the mean curves with ± std bands against minutes
and against fresh samples consumed.

Suites (`--suite`):
    main      TBA (the default run), TB synchronous, Dr. GRPO and RLOO synchronous, TRL
    stress    every objective asynchronous with k = 10 syncs between weight publishes
    k         the same five objectives at k = 1 and k = 2
    m         TB at k = 10 with m = 0.5, 0.95 and 1 (the share of groups from fresh samples)
    K         TB with K = 8, 16 and 32 responses per prompt at B * K = 128 samples per step
    trl       TRL's GRPOTrainer alone (use --minutes 30 to see whether it reaches the target)
    engines   TBA with the searchers generating with the built-in engine and with vLLM
    value     TBA against the value-based baselines: PPO (synchronous with the task's critic and
              with a value head on the policy, and asynchronous at the default k) and VinePPO
              (synchronous); also minutes and generated samples (VinePPO's rollouts included) to
              55% and 60%, how many times TB's time each method takes, and how much of the
              return's variance each PPO run's critic explains
    long      VinePPO (vineppo-long) and TBA (tba-long) for 90 minutes each; with --report beside
              the value suite's runs, VinePPO's time to 55%, 60% and TB's pass@1 at 10 minutes,
              that time over TB's, and where each method stands after 90 minutes
    smollm2-quickstart, smollm2-math, smollm2-sweep
              tba asynchronous, tba synchronous and TRL on SmolLM2-135M-Instruct: TRL's
              quickstart (length reward, conversational posts) and the math recipe
              (configs/smollm2_math.yaml), and the sweep behind the recipe; their own defaults,
              scoring and report (`benchmarks.smollm2`)

    python -m benchmarks.compare --suite stress                 # 5 methods x 3 seeds x 5 min
    python -m benchmarks.compare --suite k --seeds 1 --minutes 2
    python -m benchmarks.compare --report runs/compare_stress runs/compare_k --out runs/all
    python -m benchmarks.compare --report runs/compare_k --only tb-k2,rloo-k2 --out runs/k2
    python -m benchmarks.compare --suite value --minutes 10 --out runs/compare_value
    python -m benchmarks.compare --suite long --only vineppo-long --seeds 1 \\
        --out runs/compare_vineppo_long
    python -m benchmarks.compare --report runs/compare_value runs/compare_vineppo_long \\
        --only tba,vineppo-sync,vineppo-long --minutes 10 --out runs/vineppo_time
    python -m benchmarks.compare --suite smollm2-math --seeds 1 --first-seed 2
    python -m benchmarks.compare --suite smollm2-math --report runs/compare_smollm2_math

A restarted invocation with the same --out skips the runs it already finished. TRL needs the
benchmark extra (`pip install -e ".[bench]"`).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np
import torch

from benchmarks import smollm2
from benchmarks.common import (
    Aggregate,
    Method,
    add_common_arguments,
    finish,
    merge_results,
    minutes_text,
    pick_methods,
    run_logged,
    run_suite,
)
from tba.quiet import quiet_libraries
from tba.run_dir import read_metrics

ASYNC = ["train.mode=async", "searchers.count=1"]
LONG = ["train.max_minutes=90", "eval.snapshot_minutes=2"]  # the long suite's own limit
SYNC = ["train.mode=sync", "searchers.count=0"]
PLAIN_TB = ["train.loss=tb", "train.tb.trust_region=none"]


def trl_method(learning_rate: float) -> Method:
    def run(run_dir: Path, seed: int, args: argparse.Namespace) -> None:
        command = [
            sys.executable, "-m", "benchmarks.trl_grpo", "--out", str(run_dir),
            "--minutes", str(args.minutes), "--learning-rate", str(learning_rate),
            "--snapshot-minutes", str(args.snapshot_minutes), "--seed", str(seed),
            f"policy.model={args.base}", *args.overrides,
        ]  # fmt: skip
        run_logged(command, run_dir)

    return Method(f"TRL GRPOTrainer, lr {learning_rate:g}", runner=run)


OBJECTIVES = {  # name: (label, overrides)
    "tb": ("TB + trust region", []),
    "tb-plain": ("TB plain (paper)", PLAIN_TB),
    "proximal_rloo": ("Proximal RLOO", ["train.loss=proximal_rloo"]),
    "dr_grpo": ("Dr. GRPO", ["train.loss=dr_grpo"]),
    "rloo": ("RLOO", ["train.loss=rloo"]),
}


def objectives_at(k: int) -> dict[str, Method]:
    """The five objectives, asynchronous, with weights published every k optimizer steps."""
    return {
        f"{name}-k{k}": Method(f"{label}, k = {k}", [*ASYNC, f"train.sync_every={k}", *extra])
        for name, (label, extra) in OBJECTIVES.items()
    }


def suites(args: argparse.Namespace) -> dict[str, dict[str, Method]]:
    k10 = [*ASYNC, "train.sync_every=10"]
    return {
        "main": {
            "tba": Method("TBA (tba train defaults)"),
            "tb-sync": Method("TB sync", SYNC),
            "dr_grpo-sync": Method("Dr. GRPO sync", [*SYNC, "train.loss=dr_grpo"]),
            "rloo-sync": Method("RLOO sync", [*SYNC, "train.loss=rloo"]),
            "trl": trl_method(args.trl_lr),
        },
        "stress": objectives_at(10),
        "k": {**objectives_at(1), **objectives_at(2)},
        "m": {
            f"tb-k10-m{m}": Method(f"TB, k = 10, m = {m}", [*k10, f"buffer.recent_prob={m}"])
            for m in (0.5, 0.95, 1.0)
        },
        "K": {
            f"tb-K{k}": Method(f"TB, B = {128 // k} x K = {k}", [f"train.group_size={k}",
                                                              f"train.num_prompts={128 // k}"])
            for k in (8, 16, 32)
        },  # fmt: skip
        "trl": {"trl": trl_method(args.trl_lr)},
        "engines": {
            "tba": Method("TBA, builtin engine"),
            "tba-vllm": Method("TBA, vLLM engine", ["searchers.engine=vllm"]),
        },
        "value": {
            "tba": Method("TBA (tba train defaults)"),
            "ppo-sync": Method("PPO sync", [*SYNC, "train.loss=ppo"]),
            "ppo-async": Method("PPO async, default k", [*ASYNC, "train.loss=ppo"]),
            # The value head on the policy, which the math task's preset replaces with a separate
            # critic LM: does a critic that learns pay for the steps it costs?
            "ppo-sync-head": Method("PPO sync, value head on the policy",
                                    [*SYNC, "train.loss=ppo", "train.ppo.value_model=head"]),
            "vineppo-sync": Method("VinePPO sync", [*SYNC, "train.loss=vineppo"]),
        },
        # Their own limit, whatever --minutes says, and snapshots every 2 minutes (45 to score).
        "long": {
            "vineppo-long": Method("VinePPO sync, 90 min", [*SYNC, "train.loss=vineppo", *LONG]),
            "tba-long": Method("TBA (tba train defaults), 90 min", LONG),
        },
        **smollm2.suites(args),
    }


# Common arguments whose defaults a suite may set (the SmolLM2 suites: `smollm2.suite_defaults`).
SUITE_DEFAULTS = ("minutes", "seeds", "target", "snapshot_minutes", "num_eval", "out")


VALUE_TARGETS = (0.55, 0.60)


def print_times_to_targets(
    aggregates: dict[str, Aggregate], reference: str = "tba",
    targets: tuple[float, ...] = VALUE_TARGETS,
) -> None:  # fmt: skip
    """Per method and target: minutes and generated samples to the target (mean curve), and
    that time over the reference method's (`reference`: TB; 50 means TB got there 50 times
    sooner; "> 9" where the method did not get there: its whole run over TB's time). The last
    target is the reference's own pass@1 at its end (its mean curve's), the accuracy a method is
    timed to in VinePPO's comparisons."""
    if reference not in aggregates:
        return
    base = aggregates[reference]
    # The reference's mean curve at its end, rounded down so that the curve reaches it there.
    targets = (*targets, math.floor(float(base.mean[-1]) * 1000) / 1000)
    header = " | ".join(f"minutes to {t:.1%} | samples to {t:.1%} | x TB's time" for t in targets)
    print(f"\n| method | {header} |")
    print("|---|" + "---|---|---|" * len(targets))
    for agg in aggregates.values():
        end = float(agg.grid[-1])
        cells = []
        for target in targets:
            minutes, tb_minutes = agg.minutes_to(target), base.minutes_to(target)
            samples = np.interp(minutes, agg.grid, agg.samples) if minutes is not None else None
            if not tb_minutes:
                ratio = "n/a"
            else:
                ratio = f"{minutes / tb_minutes:.1f}" if minutes is not None else \
                    f"> {end / tb_minutes:.1f}"
            cells.append(f"{minutes_text(minutes, end)} | "
                         f"{f'{samples:,.0f}' if samples is not None else 'not reached'} | "
                         f"{ratio}")  # fmt: skip
        print(f"| {agg.label} | {' | '.join(cells)} |")


def critic_fit(run_dir: Path, last: int = 100) -> tuple[float, list[float]] | None:
    """How much of the return's variance a run's critic explained: the mean of its
    `explained_variance` over the last `last` steps and over each quarter of the steps (steps
    with constant returns, NaN, left out); None for a run without a critic."""
    records = read_metrics(run_dir / "metrics.jsonl")
    values = [row["explained_variance"] for row in records if "explained_variance" in row]
    if not values:
        return None
    fits = np.array(values, dtype=float)  # a null (NaN written by a JSON encoder) becomes NaN
    quarters = [float(np.nanmean(part)) for part in np.array_split(fits, 4)]
    return float(np.nanmean(fits[-last:])), quarters


def print_critic_fit(directories: list[Path], names: list[str]) -> None:
    """Per run of a method with a critic: its explained variance (`critic_fit`)."""
    rows = []
    for name in names:
        for directory in directories:
            for run_dir in sorted((directory / name).glob("seed*")):
                fit = critic_fit(run_dir) if (run_dir / "metrics.jsonl").exists() else None
                if fit is not None:
                    quarters = ", ".join(f"{q:.2f}" for q in fit[1])
                    rows.append(f"| {name} | {run_dir.name} | {fit[0]:.3f} | {quarters} |")
    if rows:
        print("\n| method | run | critic's explained variance, last 100 steps | by quarters |")
        print("|---|---|---|---|")
        print("\n".join(rows))


def parse_args(
    argv: list[str] | None = None,
) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    """The parser and the arguments, a suite's own defaults filled in where it has them (else the
    common ones)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_arguments(parser, minutes=5.0, out="runs/compare")
    parser.add_argument(
        "--suite", default="main",
        choices=["main", "stress", "k", "m", "K", "trl", "engines", "value", "long",
                 *smollm2.SUITES],
    )  # fmt: skip
    parser.add_argument("--trl-lr", type=float, default=5e-5, help="TRL's learning rate")
    smollm2.add_arguments(parser)
    common = {key: parser.get_default(key) for key in SUITE_DEFAULTS}
    parser.set_defaults(**dict.fromkeys(SUITE_DEFAULTS))
    args = parser.parse_args(argv)
    defaults = smollm2.suite_defaults(args.suite) if args.suite in smollm2.SUITES else common
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return parser, args


def main() -> None:
    parser, args = parse_args()
    torch.set_num_threads(2)
    quiet_libraries()
    if args.suite in smollm2.SUITES:
        suite = smollm2.SUITES[args.suite]
        if args.report:
            smollm2.report(pick_methods(merge_results(args.report), args.only, parser), args,
                           suite)  # fmt: skip
            return
        methods = pick_methods(suites(args)[args.suite], args.only, parser)
        smollm2.report(smollm2.run(methods, args), args, suite)
        return
    if args.report:
        aggregates = finish(pick_methods(merge_results(args.report), args.only, parser), args,
                            "comparison")  # fmt: skip
        print_times_to_targets(aggregates)
        print_critic_fit(args.report, list(aggregates))
        return
    methods = pick_methods(suites(args)[args.suite], args.only, parser)
    results = run_suite(methods, args)
    aggregates = finish({name: results[name] for name in methods}, args, f"suite: {args.suite}")
    print_times_to_targets(aggregates)
    print_critic_fit([args.out], list(methods))


if __name__ == "__main__":
    main()
