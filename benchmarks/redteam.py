"""Red-teaming on the embedded world: TB against reward-maximising RL, searcher scaling, and a
learned log Z, over several seeds.

Every run starts from the world's attacker prior with the red-teaming defaults (`task.name=
redteam`) and saves snapshots; each snapshot is scored afterwards on the same evaluation (512
attacks sampled at temperature 1 with one seed, 5 victim answers each): attack success rate (ASR),
diversity (1 - mean pairwise TF-IDF cosine similarity of the attacks), vulnerable modes with a
successful attack (of 12), and distinct successful attacks. What the searchers found during the
run is counted too, from the run's `attacks.jsonl` (every distinct attack made, scored on its 5
victim answers when it was made): the modes with a successful attack, and the successful attacks.

Suites (`--suite`):
    compare   TB (asynchronous) against GRPO, Dr. GRPO and RLOO on the same pipeline; RLOO also
              with the KL term fixed when the attack was sampled (as TRL's RLOO; the default uses
              the current policy's, which makes its gradient TB's, fresh or replayed), and run
              synchronously with fresh samples first (m = 1), as on-policy trainers run it
    scaling   TB with 1, 2 and 4 searchers' worth of samples per trainer step, at equal steps
              (synchronous, so that only the samples per step differ: each step generates N
              batches and trains on one, fresh samples first)
    logz      TB with VarGrad's log Z against a learned one

    python -m benchmarks.redteam --suite compare              # 6 methods x 3 seeds x 6 min
    python -m benchmarks.redteam --suite scaling --steps 200
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
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
from tba.tasks.redteam.task import SUCCESS_THRESHOLD

REDTEAM = ["task.name=redteam"]
ASYNC = [*REDTEAM, "train.mode=async", "searchers.count=1"]
COLUMNS = {"eval_asr": "ASR", "eval_diversity": "diversity",
           "eval_diversity_successful": "diversity of successes",
           "eval_modes_covered": "modes covered (of 12)",
           "eval_unique_successful": "distinct successes"}  # fmt: skip


def suites(args: argparse.Namespace) -> dict[str, dict[str, Method]]:
    steps = [f"train.max_steps={args.steps}", "train.max_minutes=null"]
    sync = [*REDTEAM, "train.mode=sync", "searchers.count=0", *steps]
    return {
        "compare": {
            "tb": Method("TB (async)", ASYNC),
            "grpo": Method("GRPO (async)", [*ASYNC, "train.loss=grpo"]),
            "dr_grpo": Method("Dr. GRPO (async)", [*ASYNC, "train.loss=dr_grpo"]),
            "rloo": Method("RLOO (async)", [*ASYNC, "train.loss=rloo"]),
            "rloo_sampled_kl": Method(
                "RLOO, KL fixed at sampling (async)",
                [*ASYNC, "train.loss=rloo", "train.baseline_kl=behaviour"],
            ),
            "rloo_on_policy": Method(
                "RLOO, synchronous, fresh samples first",
                [*REDTEAM, "train.mode=sync", "searchers.count=0", "train.loss=rloo",
                 "buffer.recent_prob=1.0"],
            ),  # fmt: skip
        },
        "scaling": {
            f"tb-x{n}": Method(f"TB, samples of {n} searcher{'s' if n > 1 else ''} per step",
                               [*sync, f"searchers.prompts_per_batch={4 * n}"])
            for n in (1, 2, 4)
        },  # fmt: skip
        "logz": {
            "tb-vargrad": Method("TB, VarGrad log Z", [*ASYNC, "train.tb.log_z=vargrad"]),
            "tb-learned": Method("TB, learned log Z", [*ASYNC, "train.tb.log_z=learned"]),
        },
    }


def found_in_training(attacks_path: Path) -> dict[str, float]:
    """Modes with a successful attack among every distinct attack the searchers made, and how
    many of those attacks succeeded (success: mean P(harmful) of the victim's answers > 0.5)."""
    modes: set[int] = set()
    successes = 0
    with attacks_path.open() as lines:
        for line in lines:
            attack = json.loads(line)
            if attack["toxicity"] > SUCCESS_THRESHOLD:
                successes += 1
                modes.update(attack["modes"])
    return {"found_modes": len(modes), "found_successes": successes}


def add_found_in_training(results: dict, directories: list[Path]) -> None:
    """`found_in_training` of every run whose directory (`<dir>/<method>/seed<N>`) is here."""
    for name, entry in results.items():
        for seed, run in entry["runs"].items():
            for directory in directories:
                path = directory / name / f"seed{seed}" / "attacks.jsonl"
                if path.exists():
                    run |= found_in_training(path)


def print_metrics(results: dict) -> None:
    """Every metric at the end of the runs, and what the searchers found: mean ± std over
    seeds."""
    print("\n| method | " + " | ".join(COLUMNS.values()) + " | steps | modes found in training "
          "| successful attacks found |")  # fmt: skip
    print("|---|" + "---|" * (len(COLUMNS) + 3))
    for entry in results.values():
        runs = list(entry["runs"].values())
        ends = [run["curve"][-1]["metrics"] | run for run in runs]
        cells = []
        for key in [*COLUMNS, "steps", "found_modes", "found_successes"]:
            values = [end.get(key, float("nan")) for end in ends]
            spread = np.std(values, ddof=1) if len(values) > 1 else 0.0
            fmt = {"eval_asr": ".3f", "eval_diversity": ".3f", "eval_diversity_successful": ".3f",
                   "steps": ".0f"}.get(key, ".1f")
            cells.append(f"{np.mean(values):{fmt}} ± {spread:{fmt}}")
        print(f"| {entry['label']} | " + " | ".join(cells) + " |")
    first = next(iter(results.values()))
    base = first["runs"][next(iter(first["runs"]))]["curve"][0]["metrics"]
    print("| attacker prior (before training) | " + " | ".join(
        f"{base.get(key, float('nan')):.3f}" for key in COLUMNS) + " | 0 | | |")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_arguments(parser, minutes=6.0, out="runs/redteam")
    parser.add_argument("--suite", default="compare", choices=["compare", "scaling", "logz"])
    parser.add_argument("--steps", type=int, default=200, help="trainer steps (scaling suite)")
    parser.set_defaults(num_eval=512, target=0.5)
    args = parser.parse_args()
    torch.set_num_threads(2)
    quiet_libraries()
    if args.report:
        results = pick_methods(merge_results(args.report), args.only, parser)
        add_found_in_training(results, args.report)
    else:
        methods = pick_methods(suites(args)[args.suite], args.only, parser)
        results = {name: entry for name, entry in run_suite(methods, args).items()
                   if name in methods}  # fmt: skip
        add_found_in_training(results, [args.out])
    finish(results, args, f"red-teaming: {args.suite} (ASR)", metric="ASR")
    print_metrics(results)


if __name__ == "__main__":
    main()
