"""Shared by the benchmarks: run `tba train` (or another trainer) in its own process, one run per
method and seed; score the policy snapshots every run saved on one fixed held-out set (after the
run, so evaluation costs no training time); aggregate the seeds (mean and spread of pass@1 at
every snapshot time, time to a target read from the mean curve); print tables and plot the curves
with bands, against wall-clock minutes and against fresh samples consumed.

Every run of a benchmark starts from the same base policy (the built-in one of seed 0) and is
scored on the same held-out problems: seeds vary what RL does (prompt order, sampling), not the
starting point or the test set, so that differences between methods are not differences between
base policies.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import numpy as np

from tba import offline_eval
from tba.config import load_config
from tba.plots import Band, plot_bands
from tba.tasks import resolve_policy


class Point(NamedTuple):
    minutes: float  # of training
    step: int
    samples: int  # fresh samples consumed (generated and merged) so far
    value: float  # the task's headline held-out metric (math: greedy pass@1)


@dataclass
class Method:
    label: str
    overrides: list[str] = field(default_factory=list)
    # Runs something else than `tba train` (e.g. TRL): run(run_dir, seed, args).
    runner: Callable[[Path, int, argparse.Namespace], None] | None = None


def add_common_arguments(parser: argparse.ArgumentParser, minutes: float, out: str) -> None:
    parser.add_argument("--minutes", type=float, default=minutes, help="training budget per run")
    parser.add_argument("--seeds", type=int, default=3, help="seeds per method (0, 1, ...)")
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--target", type=float, default=0.55, help="held-out pass@1 target")
    parser.add_argument("--snapshot-minutes", type=float, default=0.5)
    parser.add_argument("--num-eval", type=int, default=1024, help="held-out problems")
    parser.add_argument(
        "--only", help="comma-separated method names, to run or, with --report, to report "
        "(default: all)",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=Path(out))
    parser.add_argument(
        "--report", type=Path, nargs="+", metavar="DIR",
        help="run nothing: merge the results.json of earlier invocations into one table and "
        "plot (written to --out)",
    )  # fmt: skip
    parser.add_argument("overrides", nargs="*", help="key=value for every tba run")


def pick_methods(methods: dict, only: str | None, parser: argparse.ArgumentParser) -> dict:
    """The methods named by --only (comma-separated), in that order; all when it is not given."""
    if not only:
        return methods
    names = only.split(",")
    if unknown := [name for name in names if name not in methods]:
        parser.error(f"--only: unknown {', '.join(unknown)}; choose from {', '.join(methods)}")
    return {name: methods[name] for name in names}


def base_policy(overrides: list[str] = ()) -> Path:
    """The built-in base policy of the task these overrides select, built with seed 0 (once,
    cached): every run of a benchmark starts from it, whatever its own seed."""
    config = load_config(None, list(overrides))
    return resolve_policy(config.policy.model, config.pretrain, 0, print)


def run_suite(
    methods: dict[str, Method],
    args: argparse.Namespace,
    score: Callable[[Path, int], list[dict]] | None = None,
    summarize: Callable[[Path], dict] | None = None,
) -> dict[str, dict[int, list[Point]]]:
    """Every method for every seed, one run at a time, each scored when it ends
    (`score(run_dir, args.num_eval)`, default `score_snapshots`) and summed up
    (`summarize(run_dir)`, default `run_summary`). Results are saved to `args.out/results.json`
    after each run, and a finished run is not run again when the benchmark is restarted with the
    same --out."""
    score = score or score_snapshots
    summarize = summarize or run_summary
    args.out.mkdir(parents=True, exist_ok=True)
    results_path = args.out / "results.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else {}
    args.base = base_policy(args.overrides)  # runners of other trainers start from it
    # Seed by seed across methods, so that a machine that slows down for a while (shared
    # cores) costs every method alike rather than one of them.
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        for name, method in methods.items():
            entry = results.setdefault(name, {"label": method.label, "runs": {}})
            if str(seed) in entry["runs"]:
                continue
            run_dir = args.out / name / f"seed{seed}"
            if method.runner is not None:
                method.runner(run_dir, seed, args)
            else:
                chosen = [*args.overrides, *method.overrides]
                overrides = [f"policy.model={base_policy(chosen)}", f"seed={seed}", *chosen]
                run_tba(run_dir, overrides, args.minutes, args.snapshot_minutes)
            curve = score(run_dir, args.num_eval)
            entry["runs"][str(seed)] = {"curve": curve, **summarize(run_dir)}
            results_path.write_text(json.dumps(results, indent=1))
    return results


def run_tba(run_dir: Path, overrides: list[str], minutes: float, snapshot_minutes: float) -> None:
    """`tba train` for `minutes` of training, saving snapshots instead of evaluating in the run
    (`overrides` come last: a method may set its own limits, e.g. a number of steps)."""
    command = [
        sys.executable, "-m", "tba.cli", "train",
        f"train.max_minutes={minutes}", "train.max_steps=1000000", "eval.every=1000000",
        # The run's own evaluations (base and final) only cost wall-clock time here: keep small.
        "task.num_eval=64", "task.num_eval_pass_k=16", "eval.pass_k=4",
        f"eval.snapshot_minutes={snapshot_minutes}", *overrides, f"output_dir={run_dir}",
        "--overwrite",
    ]  # fmt: skip
    run_logged(command, run_dir)


def run_logged(command: list[str], run_dir: Path) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {run_dir}: {' '.join(command[2:])}", flush=True)
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    with (run_dir.parent / f"{run_dir.name}.log").open("w") as log:
        subprocess.run(command, check=True, stdout=log, stderr=subprocess.STDOUT)


def score_snapshots(run_dir: Path, num_eval: int) -> list[dict]:
    """The task's held-out metrics of the base policy (minute 0) and of every snapshot of a run
    (`tba eval --snapshots`), with the evaluation set and seed of seed 0 for every run. Each
    point: minutes, step, fresh samples consumed, `value` (the task's headline metric; math:
    greedy pass@1) and every metric."""
    return offline_eval.score_snapshots(run_dir, [f"task.num_eval={num_eval}", "seed=0"])


def run_summary(run_dir: Path) -> dict:
    """Throughput and bookkeeping of a run, from its eval.json."""
    summary = json.loads((run_dir / "eval.json").read_text())
    keys = ["steps", "samples_per_s", "trainer_wait_frac", "staleness_steps_mean",
            "groups_repeated", "identical_batches", "groups_fresh", "groups_trained",
            "train_minutes"]  # fmt: skip
    return {key: summary[key] for key in keys if key in summary}


# ----------------------------------------------------------------------------- aggregation


@dataclass
class Aggregate:
    """One method over its seeds, on a common grid of minutes."""

    label: str
    grid: np.ndarray  # minutes
    runs: list[list[Point]]
    mean: np.ndarray  # mean headline metric over seeds at each grid point
    std: np.ndarray  # its standard deviation over seeds (0 with one seed)
    samples: np.ndarray  # mean fresh samples consumed at each grid point
    summaries: list[dict]

    @property
    def base(self) -> float:
        return float(np.mean([run[0].value for run in self.runs]))

    def minutes_to(self, target: float) -> float | None:
        """When the mean curve first reaches `target` (linear between grid points)."""
        return _first_crossing(self.grid, self.mean, target)

    def seed_minutes_to(self, target: float) -> list[float | None]:
        return [_first_crossing(*_curve_arrays(run)[:2], target) for run in self.runs]

    def final(self) -> tuple[float, float]:
        ends = [run[-1].value for run in self.runs]
        return float(np.mean(ends)), _std(ends)

    def lowest(self) -> float:
        """The lowest pass@1 any seed reached along the way, minus its base."""
        return min(min(p.value for p in run) - run[0].value for run in self.runs)

    def mean_of(self, key: str) -> float:
        values = [s[key] for s in self.summaries if key in s]
        return float(np.mean(values)) if values else float("nan")


def aggregate(label: str, runs: list[list[Point]], summaries: list[dict], step: float) -> Aggregate:
    end = min(run[-1].minutes for run in runs)
    grid = np.append(np.arange(0.0, end, step), end)
    values = np.array([np.interp(grid, *_curve_arrays(run)[:2]) for run in runs])
    samples = np.array([np.interp(grid, _curve_arrays(run)[0], _curve_arrays(run)[2])
                        for run in runs])  # fmt: skip
    std = values.std(axis=0, ddof=1) if len(runs) > 1 else np.zeros(len(grid))
    return Aggregate(label, grid, runs, values.mean(axis=0), std, samples.mean(axis=0), summaries)


def load_aggregates(results: dict, step: float) -> dict[str, Aggregate]:
    out = {}
    for name, entry in results.items():
        seeds = sorted(entry["runs"], key=int)
        runs = [[_point(p) for p in entry["runs"][s]["curve"]] for s in seeds]
        summaries = [entry["runs"][s] for s in seeds]
        out[name] = aggregate(entry["label"], runs, summaries, step)
    return out


def _point(saved: dict | list) -> Point:
    if isinstance(saved, dict):
        return Point(saved["minutes"], saved["step"], saved["samples"], saved["value"])
    return Point(*saved)  # results written before points carried every metric


def _curve_arrays(run: list[Point]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    minutes = np.array([p.minutes for p in run])
    return minutes, np.array([p.value for p in run]), np.array([p.samples for p in run])


def _first_crossing(x: np.ndarray, y: np.ndarray, target: float) -> float | None:
    above = np.nonzero(y >= target)[0]
    if len(above) == 0:
        return None
    i = int(above[0])
    if i == 0:
        return float(x[0])
    return float(x[i - 1] + (target - y[i - 1]) / (y[i] - y[i - 1]) * (x[i] - x[i - 1]))


def _std(values: list[float]) -> float:
    return float(np.std(values, ddof=1)) if len(values) > 1 else 0.0


def merge_results(directories: list[Path]) -> dict:
    results: dict = {}
    for directory in directories:
        for name, entry in json.loads((directory / "results.json").read_text()).items():
            results.setdefault(name, {"label": entry["label"], "runs": {}})["runs"] |= entry["runs"]
    return results


# ------------------------------------------------------------------------------- reporting


def minutes_text(value: float | None, budget: float) -> str:
    return f"{value:.1f}" if value is not None else f"> {budget:.1f}"


def seeds_count(count: int) -> str:
    return f"{count} seed{'' if count == 1 else 's'}"


def seeds_text(values: list[float | None], budget: float) -> str:
    return ", ".join(minutes_text(v, budget) for v in values)


def print_table(
    aggregates: dict[str, Aggregate], args: argparse.Namespace, metric: str = "pass@1"
) -> None:
    """The standard table: time to target (mean curve, then each seed), the metric at the end
    (mean ± std over seeds), gain over the base, the lowest point along the way, throughput."""
    any_run = next(iter(aggregates.values()))
    counts = sorted({len(agg.runs) for agg in aggregates.values()})
    seeds = seeds_count(counts[0]) if len(counts) == 1 else f"{counts[0]}-{counts[-1]} seeds"
    # A method with its own limit (the long suite) runs longer than --minutes.
    ends = sorted({round(float(agg.grid[-1])) for agg in aggregates.values()})
    minutes = f"{ends[0]}" if len(ends) == 1 else f"{ends[0]}-{ends[-1]}"
    print(f"\n{seeds} per method, {minutes} min per run, "
          f"{args.num_eval} held-out items, {metric} target {args.target:.3f}, base "
          f"{any_run.base:.3f}")  # fmt: skip
    print(f"| method | minutes to target (mean curve; per seed) | {metric} at end | gain | "
          "lowest along the way | samples/s | steps | staleness (steps) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for agg in aggregates.values():
        mean, std = agg.final()
        end = float(agg.grid[-1])  # a method may run longer than --minutes (its own limit)
        print(
            f"| {agg.label}{'' if len(counts) == 1 else f' ({seeds_count(len(agg.runs))})'} | "
            f"{minutes_text(agg.minutes_to(args.target), end)}; "
            f"{seeds_text(agg.seed_minutes_to(args.target), end)} | "
            f"{mean:.1%} ± {std:.1%} | {mean - agg.base:+.1%} | {agg.lowest():+.1%} | "
            f"{agg.mean_of('samples_per_s'):.0f} | {agg.mean_of('steps'):.0f} | "
            f"{agg.mean_of('staleness_steps_mean'):.1f} |"
        )


def plot(
    aggregates: dict[str, Aggregate], target: float, path: Path, title: str = "",
    metric: str = "held-out greedy pass@1",
) -> None:  # fmt: skip
    """The mean of the headline metric with a band of ± one standard deviation over seeds,
    against wall-clock minutes (left) and against fresh samples consumed (right)."""
    plot_bands(
        [Band(agg.label, agg.grid, agg.samples, agg.mean, agg.std) for agg in aggregates.values()],
        path, target=target, title=title, ylabel=metric,
    )  # fmt: skip


def finish(
    results: dict, args: argparse.Namespace, title: str, metric: str = "pass@1"
) -> dict[str, Aggregate]:
    """Aggregate, plot to `args.out`, print the table; returns the aggregates."""
    aggregates = load_aggregates(results, args.snapshot_minutes)
    args.out.mkdir(parents=True, exist_ok=True)
    label = "held-out greedy pass@1" if metric == "pass@1" else metric
    plot(aggregates, args.target, args.out / "curves.png", title, label)
    print_table(aggregates, args, metric)
    return aggregates
