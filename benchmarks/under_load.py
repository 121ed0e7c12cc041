"""An asynchronous run on a machine that is busy with something else: does it hold?

Runs `tba train` (asynchronous, defaults) twice for `--minutes` each: once alone on the machine,
once while part of the project's test suite runs beside it, over and over, from `--load-after`
minutes on. Both runs save snapshots, scored afterwards on the same held-out problems. The table
gives, for each run: the searcher's samples per second while the load ran (and the same window of
the idle run), the machine's load average over that window, the searcher's rate per available core
(rate divided by its fair share of the cores, cores / max(cores, load average)), the staleness of
the trained samples, and the lowest and last held-out pass@1 against the base.

    python -m benchmarks.under_load                  # 2 x 6 minutes
    python -m benchmarks.under_load --minutes 3 --load-after 0.5
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import base_policy, run_tba, score_snapshots
from tba.quiet import quiet_libraries
from tba.run_dir import read_metrics

TESTS = ["-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "tests/test_buffer.py",
         "tests/test_objectives.py", "tests/test_baselines.py", "tests/test_policy.py",
         "tests/test_hf_models.py", "tests/test_datasets.py"]  # fmt: skip


class Load:
    """The test suite in a loop from `after` seconds on (wall clock, counted from before the run
    starts, so the load is on from at most `after` seconds of training time to the end), while
    recording the load average."""

    def __init__(self, after: float, repo: Path, tests: bool) -> None:
        self.after, self.repo, self.tests = after, repo, tests
        self.stop = threading.Event()
        self.loads: list[float] = []
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        if self.stop.wait(self.after):
            return
        threading.Thread(target=self._sample, daemon=True).start()
        while self.tests and not self.stop.is_set():
            process = subprocess.Popen([sys.executable, *TESTS], cwd=self.repo,
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            while process.poll() is None:
                if self.stop.wait(1.0):
                    process.kill()
                    break

    def _sample(self) -> None:
        while not self.stop.wait(5.0):
            self.loads.append(os.getloadavg()[0])


def searcher_rate(run_dir: Path, window: tuple[float, float]) -> float:
    """Samples merged per second of training within `window` (seconds of training)."""
    records = [r for r in read_metrics(run_dir / "metrics.jsonl") if "samples_in" in r]
    inside = [r for r in records if window[0] <= r["time"] <= window[1]]
    if len(inside) < 2:
        return float("nan")
    return sum(r["samples_in"] for r in inside[1:]) / (inside[-1]["time"] - inside[0]["time"])


def staleness(run_dir: Path, window: tuple[float, float]) -> float:
    records = read_metrics(run_dir / "metrics.jsonl")
    values = [r["staleness_steps_mean"] for r in records
              if "staleness_steps_mean" in r and window[0] <= r["time"] <= window[1]]  # fmt: skip
    return float(np.mean(values)) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=6.0)
    parser.add_argument("--load-after", type=float, default=1.0, help="minutes before the load")
    parser.add_argument("--num-eval", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("runs/under_load"))
    parser.add_argument("overrides", nargs="*", help="key=value for both runs")
    args = parser.parse_args()
    if args.out.exists():
        parser.error(f"{args.out} exists; choose another --out")
    torch.set_num_threads(2)
    quiet_libraries()
    repo = Path(__file__).resolve().parent.parent
    overrides = [f"policy.model={base_policy()}", f"seed={args.seed}", *args.overrides]
    cores = os.cpu_count() or 1
    window = (args.load_after * 60, float("inf"))  # training seconds, the same in both runs
    rows = {}
    for name in ("idle", "loaded"):
        run_dir = args.out / name
        load = Load(args.load_after * 60, repo, tests=name == "loaded")
        load.thread.start()
        run_tba(run_dir, overrides, args.minutes, snapshot_minutes=0.5)
        load.stop.set()
        load.thread.join()
        curve = score_snapshots(run_dir, args.num_eval)
        scores = [p["value"] for p in curve]
        mean_load = float(np.mean(load.loads))
        rate = searcher_rate(run_dir, window)
        rows[name] = (rate, mean_load, rate / (cores / max(cores, mean_load)),
                      staleness(run_dir, window), scores)  # fmt: skip
    print(f"\n{cores} cores, {args.minutes:g} min per run; rates and staleness from minute "
          f"{args.load_after:g} of training to the end, in both runs")  # fmt: skip
    print("| run | searcher samples/s | load average | samples/s per available core | "
          "staleness (steps) | base | lowest | last |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for name, (rate, mean_load, per_core, stale, scores) in rows.items():
        print(f"| {name} | {rate:.0f} | {mean_load:.1f} | {per_core:.0f} | {stale:.1f} | "
              f"{scores[0]:.1%} | {min(scores):.1%} | {scores[-1]:.1%} |")
    idle, loaded = rows["idle"][2], rows["loaded"][2]
    print(f"\nunder load the searcher keeps {loaded / idle:.2f}x its idle samples/s per available "
          "core")


if __name__ == "__main__":
    main()
