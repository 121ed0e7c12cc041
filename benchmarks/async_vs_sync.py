"""Asynchronous against synchronous TB on the embedded math task, over several seeds.

Every run starts from the same base policy with the same hyperparameters (B, K, learning rate,
beta, m); only the mode, where generation runs and k differ. No run pauses to evaluate: each
saves the policy every `--snapshot-minutes`, and the snapshots are scored afterwards on the same
held-out problems. The table gives each mode's time to the target (from the mean curve over seeds,
and per seed), pass@1 at the end, the trainer's waiting fraction, how stale the trained samples
were, and how many groups were trained twice back to back; then the speed-up of each asynchronous
mode over the synchronous one.

    python -m benchmarks.async_vs_sync                        # 3 modes x 3 seeds x 8 minutes
    python -m benchmarks.async_vs_sync --seeds 1 --minutes 2 --target 0.5

The synchronous baseline runs its searcher inside the trainer process (`searchers.count=0`): on
a 2-core machine that is its fastest setting (both cores for generation, then both for the
update). The asynchronous runs have one searcher process and the trainer on the other core.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import (
    Method,
    add_common_arguments,
    finish,
    merge_results,
    pick_methods,
    run_suite,
)
from tba.quiet import quiet_libraries

MODES = {
    "sync": Method("sync (searcher in the trainer process)", ["train.mode=sync",
                                                             "searchers.count=0"]),
    "async-k1": Method("async, k = 1", ["train.mode=async", "searchers.count=1",
                                        "train.sync_every=1"]),
    "async-k2": Method("async, k = 2", ["train.mode=async", "searchers.count=1",
                                        "train.sync_every=2"]),
}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_arguments(parser, minutes=8.0, out="runs/async_vs_sync")
    args = parser.parse_args()
    torch.set_num_threads(2)
    quiet_libraries()
    if args.report:
        results = pick_methods(merge_results(args.report), args.only, parser)
    else:
        results = run_suite(pick_methods(MODES, args.only, parser), args)
    aggregates = finish(results, args, "asynchronous against synchronous TB")

    print("\n| mode | trainer waiting | groups trained twice back to back | fresh groups |")
    print("|---|---|---|---|")
    for agg in aggregates.values():
        fresh = agg.mean_of("groups_fresh") / agg.mean_of("groups_trained")
        print(f"| {agg.label} | {agg.mean_of('trainer_wait_frac'):.1%} | "
              f"{agg.mean_of('groups_repeated'):.0f} | {fresh:.0%} |")  # fmt: skip
    sync = aggregates.get("sync")
    for name, agg in aggregates.items():
        if name == "sync" or sync is None:
            continue
        t_sync, t_async = sync.minutes_to(args.target), agg.minutes_to(args.target)
        if t_sync is not None and t_async is not None:
            print(f"\n{agg.label}: reaches the target {t_sync / t_async:.2f}x as fast as sync "
                  "(mean curves)")  # fmt: skip
        else:
            print(f"\n{agg.label}: speed-up not measurable (a mean curve missed the target)")


if __name__ == "__main__":
    main()
