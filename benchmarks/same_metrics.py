"""Whether two runs recorded the same per-step metrics: what a change that must not alter
behaviour (a refactoring) is checked with. Timings (seconds, rates, wall-clock) and memory are
left out; every other number of every step must be equal (or, with `--rtol` and `--atol`, equal
within those tolerances: a change that reorders floating-point sums).

    python -m benchmarks.same_metrics RUN_A RUN_B [--steps 50]

Typical use: the same synchronous run (`train.mode=sync searchers.count=0`, a fixed seed) made
by two versions of the code, e.g. in two clones:

    tba train train.mode=sync searchers.count=0 train.max_steps=50 seed=0 output_dir=runs/a
    (other version) ... output_dir=runs/b
    python -m benchmarks.same_metrics runs/a runs/b

Exit status 0 when the metrics are identical, 1 when they differ (the first differences are
printed).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

from tba.run_dir import read_metrics


def is_timing(key: str) -> bool:
    """Wall-clock quantities, which differ between any two runs."""
    return (key in ("time", "trainer_wait_frac", "peak_memory_mib")
            or key.endswith(("_seconds", "_per_s")) or key.endswith("busy_frac"))  # fmt: skip


def close(va: Any, vb: Any, rtol: float, atol: float = 0.0) -> bool:
    """Equal values, both NaN, or numbers within `rtol` (relative) or `atol` (absolute: for
    quantities that are rounding noise around 0) of each other."""
    if va == vb:
        return True
    numbers = isinstance(va, int | float) and isinstance(vb, int | float)
    if not numbers:
        return False
    if math.isnan(va) and math.isnan(vb):
        return True
    return math.isclose(va, vb, rel_tol=rtol, abs_tol=atol)


def differences(
    a: list[dict], b: list[dict], steps: int, rtol: float = 0.0, atol: float = 0.0
) -> list[str]:
    """Every (step, metric) whose values differ, as lines to print."""
    found = []
    by_step_a = {r["step"]: r for r in a if "step" in r and "snapshot" not in r}
    by_step_b = {r["step"]: r for r in b if "step" in r and "snapshot" not in r}
    for step in range(0, steps + 1):
        ra, rb = by_step_a.get(step), by_step_b.get(step)
        if ra is None or rb is None:
            if (ra is None) != (rb is None):
                found.append(f"step {step}: recorded in only one run")
            continue
        for key in sorted(set(ra) | set(rb)):
            if is_timing(key):
                continue
            va, vb = ra.get(key), rb.get(key)
            if not close(va, vb, rtol, atol):
                found.append(f"step {step} {key}: {va!r} != {vb!r}")
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_a", type=Path)
    parser.add_argument("run_b", type=Path)
    parser.add_argument("--steps", type=int, default=50, help="compare steps 0 to this one")
    parser.add_argument("--rtol", type=float, default=0.0,
                        help="relative tolerance for numbers (default 0: identical)")
    parser.add_argument("--atol", type=float, default=0.0,
                        help="absolute tolerance for numbers (default 0)")
    args = parser.parse_args()
    a = read_metrics(args.run_a / "metrics.jsonl")
    b = read_metrics(args.run_b / "metrics.jsonl")
    found = differences(a, b, args.steps, args.rtol, args.atol)
    compared = sum(1 for r in a if r.get("step", -1) <= args.steps and "snapshot" not in r)
    if found:
        print(f"{len(found)} differences in steps 0-{args.steps}:")
        print("\n".join(found[:20]))
        return 1
    within = f" within rtol {args.rtol:g}, atol {args.atol:g}" if args.rtol or args.atol else ""
    print(f"identical{within}: {compared} records of steps 0-{args.steps} "
          "(timings and memory left out)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
