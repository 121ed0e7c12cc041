"""How asynchronous TB scales with the number of searchers, against the synchronous mode on the
same cores, on the embedded math task.

It reads the machine's core count. The synchronous run generates and trains in one process on
every core. Asynchronous runs give the trainer one core and each of N searchers one core, for
N = 1, 2, 4, ... up to cores - 1, plus one oversubscribed run (N = cores searchers and the
trainer sharing `cores` cores), shown as such. Per mode it reports samples per second per
searcher and in total, the trainer's waiting fraction, how stale the trained samples were
(optimizer steps), the time to the pass@1 target from the mean curve over seeds, and pass@1
gained per thousand fresh samples.

Then a projection, not a measurement: from the per-searcher throughput r and the trainer's step
time t measured with N = 1, what N searchers on N devices of their own (plus one for the trainer)
would deliver, against a synchronous run on the same N + 1 devices that generates on all of them
and trains on one:

    async fresh samples/s = min(N r, B K / t)          (searchers never wait; the trainer
                                                        cannot use more than one batch a step)
    sync  fresh samples/s = B K / (B K / ((N + 1) r) + t)
    minutes to target     = fresh samples the N = 1 run needed / fresh samples/s

It assumes learning per fresh sample stays what it was at N = 1 (staleness grows with N; the
asynchronous rows above show how much it costs here) and ignores weight-sync time.

    python -m benchmarks.scaling                      # sync + N = 1..cores, 3 seeds x 6 min
    python -m benchmarks.scaling --seeds 1 --minutes 2
"""

from __future__ import annotations

import argparse
import os

import numpy as np
import torch

from benchmarks.common import (
    Aggregate,
    Method,
    add_common_arguments,
    finish,
    merge_results,
    minutes_text,
    pick_methods,
    run_suite,
)
from tba.config import load_config
from tba.quiet import quiet_libraries
from tba.run_dir import read_metrics


def searcher_counts(cores: int) -> list[int]:
    """1, 2, 4, ... up to one searcher per core but the trainer's, then one oversubscribed."""
    fits = max(cores - 1, 1)
    counts = [n for n in (2**i for i in range(fits.bit_length())) if n < fits]
    return [*counts, fits, fits + 1]


def modes(cores: int) -> dict[str, Method]:
    out = {"sync": Method(f"sync, {cores} cores", ["train.mode=sync", "searchers.count=0"])}
    for n in searcher_counts(cores):
        trainer_threads = max(1, cores - n)
        label = f"async, {n} searcher{'s' if n > 1 else ''}"
        if n + 1 > cores:
            label += f" (oversubscribed: {n + 1} processes on {cores} cores)"
        out[f"async-n{n}"] = Method(label, [
            "train.mode=async", f"searchers.count={n}", "searchers.num_cpus=1",
            "searchers.num_threads=1", f"policy.num_threads={trainer_threads}",
            f"ray.num_cpus={max(cores, n)}",
        ])  # fmt: skip
    return out


def searcher_rates(run_dir) -> list[float]:
    """Each searcher's samples per second over the run (its last report)."""
    last: dict[str, float] = {}
    for record in read_metrics(run_dir / "metrics.jsonl"):
        for key, value in record.items():
            if key.endswith("/samples_per_s"):
                last[key] = value
    return [last[k] for k in sorted(last)]


def step_seconds(run_dir) -> float:
    return float(np.mean([r["train_seconds"] for r in read_metrics(run_dir / "metrics.jsonl")
                          if "train_seconds" in r]))  # fmt: skip


def gain_per_sample(agg: Aggregate) -> float:
    """pass@1 points gained per thousand fresh samples, from the base to the end (mean)."""
    gains = [(run[-1].value - run[0].value) / max(run[-1].samples, 1) * 1000
             for run in agg.runs]  # fmt: skip
    return 100 * float(np.mean(gains))


def samples_to_target(agg: Aggregate, target: float) -> float | None:
    """Fresh samples the mean curve consumed by the time it reached the target."""
    minutes = agg.minutes_to(target)
    return None if minutes is None else float(np.interp(minutes, agg.grid, agg.samples))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_arguments(parser, minutes=6.0, out="runs/scaling")
    parser.add_argument("--project", type=int, nargs="+", default=[1, 2, 4, 8, 16],
                        help="searcher counts of the projection")  # fmt: skip
    args = parser.parse_args()
    torch.set_num_threads(2)
    quiet_libraries()
    cores = os.cpu_count() or 1
    if args.report:
        results = pick_methods(merge_results(args.report), args.only, parser)
    else:
        results = run_suite(pick_methods(modes(cores), args.only, parser), args)
    aggregates = finish(results, args, f"searcher scaling on {cores} cores")

    print(f"\nmeasured on {cores} cores")
    print("| mode | samples/s per searcher | samples/s in all | trainer waiting | "
          "staleness (steps) | pass@1 points per 1k fresh samples |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    rates: dict[str, list[float]] = {}
    for name, agg in aggregates.items():
        dirs = [args.out / name / f"seed{s}" for s in sorted(results[name]["runs"], key=int)]
        per = [searcher_rates(d) for d in dirs]
        rates[name] = [float(np.mean(r)) for r in zip(*per)] if per and per[0] else []
        shown = ", ".join(f"{r:.0f}" for r in rates[name]) if rates[name] else "(in-process)"
        print(f"| {agg.label} | {shown} | {agg.mean_of('samples_per_s'):.0f} | "
              f"{agg.mean_of('trainer_wait_frac'):.1%} | "
              f"{agg.mean_of('staleness_steps_mean'):.1f} | {gain_per_sample(agg):.2f} |")

    one = aggregates.get("async-n1")
    needed = samples_to_target(one, args.target) if one else None
    if one is None or not rates.get("async-n1") or needed is None:
        print("\nprojection: needs an asynchronous N = 1 run that reached the target")
        return
    r = rates["async-n1"][0]
    dirs = [args.out / "async-n1" / f"seed{s}" for s in sorted(results["async-n1"]["runs"],
                                                                key=int)]  # fmt: skip
    t = float(np.mean([step_seconds(d) for d in dirs]))
    config = load_config(None, args.overrides)
    batch = config.train.num_prompts * config.train.group_size
    print(f"\nPROJECTION (not measured): N searchers on N devices of their own and the trainer on "
          f"one more, from r = {r:.0f} samples/s per searcher and t = {t:.2f} s per trainer step "
          f"(N = 1 run), B x K = {batch}, and the {needed:.0f} fresh samples the N = 1 runs "
          f"needed to reach {args.target:.3f}")  # fmt: skip
    print("| N | async fresh samples/s | sync fresh samples/s (N + 1 devices) | "
          "async minutes to target | sync minutes to target | async speed-up |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for n in args.project:
        async_rate = min(n * r, batch / t)
        sync_rate = batch / (batch / ((n + 1) * r) + t)
        print(f"| {n} | {async_rate:.0f} | {sync_rate:.0f} | "
              f"{minutes_text(needed / async_rate / 60, float('inf'))} | "
              f"{minutes_text(needed / sync_rate / 60, float('inf'))} | "
              f"{async_rate / sync_rate:.2f}x |")


if __name__ == "__main__":
    main()
