"""The main job over seeds: `tba train` with nothing but a seed and an output directory, exactly as
a new user runs it (each seed builds its own base policy), then its held-out greedy pass@1 as the
run itself measured it (at the start, every `eval.every` steps, and at the end).

Per seed: pass@1 at the start and at the end, the gain, the largest drop between two consecutive
evaluations in the second half of the run (a late collapse shows there), steps and samples/s;
then the mean ± std over seeds, and the curves (mean ± std band) against minutes and against
fresh samples consumed.

    python -m benchmarks.main_job --seeds 3 --out runs/main_job          # 3 x ~11 minutes
    python -m benchmarks.main_job --report runs/main_job                  # tables and plot only
    python -m benchmarks.main_job --seeds 3 --out runs/main_job_8bit train.optimizer=adamw_8bit
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from benchmarks.common import Point, aggregate
from tba.plots import Band, plot_bands
from tba.run_dir import read_metrics

METRIC = "eval_pass@1"


def run_seed(out: Path, seed: int, overrides: list[str]) -> Path:
    run_dir = out / f"seed{seed}"
    if (run_dir / "eval.json").exists():
        return run_dir  # finished in an earlier invocation
    command = [sys.executable, "-m", "tba.cli", "train", f"seed={seed}", f"output_dir={run_dir}",
               *overrides, "--overwrite"]  # fmt: skip
    with (out / f"seed{seed}.log").open("w") as log:
        subprocess.run(command, check=True, stdout=log, stderr=subprocess.STDOUT)
    return run_dir


def curve(run_dir: Path) -> list[Point]:
    """(minutes, step, fresh samples merged so far, pass@1) at every evaluation of the run."""
    points, merged = [], 0
    for record in read_metrics(run_dir / "metrics.jsonl"):
        merged += record.get("samples_in", 0)
        if METRIC in record:
            points.append(Point(record["time"] / 60, record["step"], merged, record[METRIC]))
    return points


def largest_late_drop(points: list[Point]) -> float:
    """The largest fall between two consecutive evaluations in the second half of the run."""
    half = points[-1].minutes / 2
    late = [p.value for p in points if p.minutes >= half]
    return max([0.0, *(a - b for a, b in zip(late, late[1:]))])


def report(run_dirs: list[Path], out: Path, overrides: list[str]) -> None:
    runs = [curve(run_dir) for run_dir in run_dirs]
    summaries = [json.loads((run_dir / "eval.json").read_text()) for run_dir in run_dirs]
    job = " ".join(["tba train seed=S", *overrides])
    print(f"`{job}`, held-out greedy pass@1 as the run measures it; {len(runs)} seeds\n")
    print("| seed | start | after the run | gain | minutes | steps | largest late drop | "
          "samples/s |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    rows = []
    for run_dir, points, summary in zip(run_dirs, runs, summaries):
        start, end = summary["base"][METRIC], summary["final"][METRIC]
        row = (start, end, end - start, largest_late_drop(points))
        rows.append(row)
        print(f"| {run_dir.name.removeprefix('seed')} | {start:.1%} | {end:.1%} | "
              f"{end - start:+.1%} | {summary['train_minutes']:.1f} | {summary['steps']} | "
              f"{row[3]:.1%} | {summary['samples_per_s']:.0f} |")  # fmt: skip
    values = np.array(rows)
    mean, std = values.mean(axis=0), values.std(axis=0, ddof=1) if len(rows) > 1 else 0 * values[0]
    print(f"| mean ± std | {mean[0]:.1%} ± {std[0]:.1%} | {mean[1]:.1%} ± {std[1]:.1%} | "
          f"{mean[2]:+.1%} ± {std[2]:.1%} | | | {mean[3]:.1%} ± {std[3]:.1%} | |")  # fmt: skip
    together = aggregate("tba train", runs, summaries, step=0.5)
    print("\nmean ± std over seeds against minutes:\n")
    print("| minutes | " + " | ".join(f"{m:.1f}" for m in together.grid[::2]) + " |")
    print("| --- | " + " | ".join("---" for _ in together.grid[::2]) + " |")
    print("| pass@1 | " + " | ".join(f"{m:.1%} ± {s:.1%}" for m, s in
                                    zip(together.mean[::2], together.std[::2])) + " |")  # fmt: skip
    band = Band(f"tba train ({len(runs)} seeds)", together.grid, together.samples, together.mean,
                together.std)  # fmt: skip
    plot_bands([band], out / "main_job.png", title=f"{job}, over seeds")
    print(f"\nplot: {out / 'main_job.png'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("runs/main_job"))
    parser.add_argument("--report", type=Path, metavar="DIR",
                        help="run nothing: the tables and plot of the seeds in DIR")  # fmt: skip
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="settings added to every seed's command (the default job has none)")
    args = parser.parse_args()
    if args.report:
        report(sorted(p.parent for p in args.report.glob("seed*/eval.json")), args.report,
               args.overrides)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    run_dirs = [run_seed(args.out, seed, args.overrides) for seed in range(args.seeds)]
    report(run_dirs, args.out, args.overrides)


if __name__ == "__main__":
    main()
