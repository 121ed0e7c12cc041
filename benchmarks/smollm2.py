"""tba against TRL's GRPOTrainer on one real model, SmolLM2-135M-Instruct
(`pypi:smollm2-135m-instruct`): the suites `smollm2-quickstart`, `smollm2-math` and
`smollm2-sweep` of `benchmarks.compare`.

Every method of a suite starts from the same model and trains on the same prompts with the same
reward, batch (B prompts x K completions a step), response length, temperature and learning
rate; only who trains differs:

- `tba-async`: `tba train`, asynchronous, one searcher process (one core) beside the trainer;
- `tba-sync`: `tba train`, synchronous, the searcher in the trainer's process: what asynchrony
  alone gives is the difference between the two;
- `trl`: TRL's `GRPOTrainer` (`benchmarks.trl_grpo`) with TRL's own loss and its default beta
  of 0, as a TRL user's script runs it.

The suites:

- `smollm2-quickstart`: TRL's quickstart as a user ported it
  (`tests/ports/grpo_quickstart_smollm2_*.py`): conversational prompts, TRL's `reward_len`
  (-|20 - characters|, `benchmarks/quickstart_reward.py`), B x K = 2 x 8, 32 new tokens,
  temperature 1, lr 2e-5, a cut completion scored like any other (TRL's default). The embedded
  summarisation world's posts stand in for trl-lib/tldr (offline): 4,096 training posts,
  held-out posts of the world's test split, each one user turn. Held-out: the mean `reward_len`
  of greedy completions.
- `smollm2-math`: the embedded math task's word problems through the chat template, with the
  settings of the recipe `configs/smollm2_math.yaml`. Held-out: the verifier's greedy score (the
  last number is the answer; a cut answer is scored like any other) and, apart, the share of
  greedy answers cut at the length limit.
- `smollm2-sweep`: the recipe, synchronous, one setting changed at a time (learning rate,
  temperature, response length, B x K, chat template, LoRA), short runs, one seed: where the
  recipe's values come from.

Every run saves snapshots of the policy every `--snapshot-minutes` of training; they are scored
after the run (`benchmarks.heldout`), the base policy first, on the same held-out items for every
run, so evaluation costs no training time; then the run's snapshots (540 MB each) and
checkpoints (1.6 GB each) are deleted, unless `--keep-files` (its final policy stays). The
report gives per method the base, the end (mean ± std over seeds), the time to a target every
method reaches (`--target`, by default the highest level every mean curve reaches), the standard
error of one evaluation, the time to a training-reward target (`--train-target`; the
quickstart's default is -15), and where each method's training time went (generation, optimizer
steps, hand-off of weights, waiting, the rest) from the runs' metrics.jsonl; plots against
minutes and against samples.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from benchmarks.common import (
    Aggregate,
    Method,
    load_aggregates,
    minutes_text,
    plot,
    run_logged,
    run_suite,
    run_summary,
    run_tba,
)
from benchmarks.heldout import CUT, SCORING, score_run
from tba.config import load_config
from tba.keys import get_key
from tba.run_dir import read_metrics, samples_consumed
from tba.tasks.summarize import world

SMOLLM2 = "pypi:smollm2-135m-instruct"
ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "configs" / "smollm2_math.yaml"
REWARD_LEN = Path(__file__).resolve().with_name("quickstart_reward.py")
POSTS = {"train": 4096, "test": 512}
NUM_EVAL = 256
PROCESS = "process.json"

# TRL's runner trains in fp32 on a CPU (as the user's script, `bf16=False`): so does tba here,
# whatever `policy.dtype=auto` would pick on a CPU with native bf16.
FP32 = ["policy.dtype=float32"]
ASYNC = ["train.mode=async", "searchers.count=1"]
SYNC = ["train.mode=sync", "searchers.count=0"]
# A run's own evaluations (base and final) are outside its training clock but not free on two
# cores: kept small, the curve is scored after the run.
SMALL_RUN_EVAL = ["task.num_eval=16", "task.num_eval_pass_k=4", "eval.pass_k=2",
                  "eval.batch_size=64"]  # fmt: skip
# What the recipe says is trained; the suites set the mode, the limits and the evaluation.
RECIPE_KEYS = (
    "policy.model", "policy.chat_template", "policy.max_new_tokens", "policy.temperature",
    "task.name", "train.loss", "train.learning_rate", "train.num_prompts", "train.group_size",
    "train.beta", "train.truncated", "train.truncation_penalty", "lora.r", "lora.alpha",
    "lora.target_modules",
)  # fmt: skip
SWEEP = {  # name: (label, settings changed from the recipe)
    "recipe": ("the recipe (configs/smollm2_math.yaml)", []),
    "lr1e-5": ("lr 1e-5", ["train.learning_rate=1e-5"]),
    "lr5e-5": ("lr 5e-5", ["train.learning_rate=5e-5"]),
    "lr1e-4": ("lr 1e-4", ["train.learning_rate=1e-4"]),
    "temp0.5": ("temperature 0.5", ["policy.temperature=0.5"]),
    "temp1.0": ("temperature 1.0", ["policy.temperature=1.0"]),
    "len48": ("48 new tokens", ["policy.max_new_tokens=48"]),
    "len96": ("96 new tokens", ["policy.max_new_tokens=96"]),
    "B8xK4": ("B = 8 x K = 4", ["train.num_prompts=8", "train.group_size=4"]),
    "no-chat": ("no chat template (the problem as plain text)", ["policy.chat_template=false"]),
    "lora16": ("LoRA r = 16, alpha 32, lr 2e-4",
               ["lora.r=16", "lora.alpha=32", "train.learning_rate=2e-4"]),
}  # fmt: skip


@dataclass(frozen=True)
class Suite:
    """What a suite reports, and its defaults."""

    label: str  # of the headline held-out metric (`benchmarks.heldout` chooses it by task)
    percent: bool  # a share (printed as %) or a reward
    minutes: float
    snapshot_minutes: float
    seeds: int
    train_target: float | None  # the training reward whose time is reported


VERIFIER = "held-out greedy verifier score (last number)"
SUITES = {
    "smollm2-quickstart": Suite("held-out mean reward_len (greedy)", False, 15.0, 2.5, 3, -15.0),
    "smollm2-math": Suite(VERIFIER, True, 30.0, 5.0, 3, None),
    "smollm2-sweep": Suite(VERIFIER, True, 10.0, 5.0, 1, None),
}  # fmt: skip


def suite_defaults(name: str) -> dict:
    """A suite's defaults for `benchmarks.compare`'s common arguments."""
    suite = SUITES[name]
    return {"minutes": suite.minutes, "seeds": suite.seeds, "target": None,
            "snapshot_minutes": suite.snapshot_minutes, "num_eval": NUM_EVAL,
            "out": Path(f"runs/compare_{name.replace('-', '_')}")}  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--train-target", type=float, default=None,
                        help="smollm2 suites: the training reward whose time is reported "
                        "(default: the quickstart's -15; none for math)")  # fmt: skip
    parser.add_argument("--eval-batch-size", type=int, default=64,
                        help="smollm2 suites: held-out prompts generated at once in scoring")
    parser.add_argument("--keep-files", action="store_true",
                        help="smollm2 suites: keep a run's snapshots (540 MB each) and "
                        "checkpoints (1.6 GB each) once it is scored")  # fmt: skip


# ------------------------------------------------------------------------------- the data


def posts_dir(cache_dir: str = "~/.cache/tba") -> Path:
    """Where the quickstart's posts are written (once: they are a function of the world)."""
    return Path(cache_dir).expanduser() / f"quickstart-posts-v{world.VERSION}"


def quickstart_rows(split: str, count: int) -> list[dict]:
    """The world's posts as a conversational dataset, one user turn each, as TRL's quickstart
    reads trl-lib/tldr's Reddit posts."""
    return [{"prompt": [{"role": "user", "content": post.prompt.strip()}]}
            for post in world.posts(split, count)]  # fmt: skip


def write_posts(directory: Path) -> None:
    """train.jsonl and test.jsonl in `directory`, unless they are there already."""
    directory.mkdir(parents=True, exist_ok=True)
    for split, count in POSTS.items():
        path = directory / f"{split}.jsonl"
        if path.exists():
            continue
        partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
        partial.write_text("".join(json.dumps(row) + "\n" for row in quickstart_rows(split, count)))
        partial.replace(path)


# -------------------------------------------------------------------------------- settings


def quickstart_settings(data: Path) -> list[str]:
    """TRL's quickstart, as a user ported it to SmolLM2, in `tba train`'s settings."""
    return [
        f"policy.model={SMOLLM2}", "policy.chat_template=true", "policy.max_new_tokens=32",
        "policy.temperature=1.0", "task.name=custom", f"task.train_path={data / 'train.jsonl'}",
        f"task.eval_path={data / 'test.jsonl'}", f"task.reward_funcs=['{REWARD_LEN}:reward_len']",
        "task.num_train=null", "train.num_prompts=2", "train.group_size=8",
        "train.learning_rate=2e-5", "train.truncated=score",
    ]  # fmt: skip


def recipe_settings(path: Path = RECIPE) -> list[str]:
    """What the recipe trains (`RECIPE_KEYS`), as `key=value` settings."""
    values = load_config(path).model_dump()
    settings = []
    for key in RECIPE_KEYS:
        value = get_key(values, key)
        settings.append(f"{key}={value if isinstance(value, str) else json.dumps(value)}")
    return settings


# --------------------------------------------------------------------------------- methods


def timed(run: Callable[[], None], run_dir: Path) -> None:
    """`run()`, its wall-clock seconds (start-up, the run's own evaluations and saves included)
    written to RUN_DIR/process.json."""
    start = time.time()
    run()
    (run_dir / PROCESS).write_text(json.dumps({"seconds": time.time() - start}))


def tba_method(label: str, shared: list[str], own: list[str]) -> Method:
    """`tba train` with the suite's `shared` settings, then the command line's, then the
    method's `own` (its mode, or a sweep's change)."""

    def run(run_dir: Path, seed: int, args: argparse.Namespace) -> None:
        overrides = [f"seed={seed}", *shared, *args.overrides, *own, *SMALL_RUN_EVAL]
        timed(lambda: run_tba(run_dir, overrides, args.minutes, args.snapshot_minutes), run_dir)

    return Method(label, [*shared, *own, *SMALL_RUN_EVAL], runner=run)


def trl_command(run_dir: Path, seed: int, args: argparse.Namespace, shared: list[str]) -> list[str]:
    """`benchmarks.trl_grpo` with the suite's settings, then the command line's, and TRL's
    default beta (0)."""
    return [
        sys.executable, "-m", "benchmarks.trl_grpo", "--out", str(run_dir),
        "--minutes", str(args.minutes), "--snapshot-minutes", str(args.snapshot_minutes),
        "--seed", str(seed), "--beta", "0", *shared, *args.overrides,
    ]  # fmt: skip


def trl_method(label: str, shared: list[str]) -> Method:
    def run(run_dir: Path, seed: int, args: argparse.Namespace) -> None:
        command = trl_command(run_dir, seed, args, shared)
        timed(lambda: run_logged(command, run_dir), run_dir)

    return Method(label, list(shared), runner=run)


def three_ways(shared: list[str]) -> dict[str, Method]:
    return {
        "tba-async": tba_method("tba, asynchronous (one searcher process)", shared, ASYNC),
        "tba-sync": tba_method("tba, synchronous", shared, SYNC),
        "trl": trl_method("TRL GRPOTrainer", shared),
    }


def suites(args: argparse.Namespace) -> dict[str, dict[str, Method]]:
    """The SmolLM2 suites' methods (nothing is written: `run` writes the quickstart's posts)."""
    recipe = recipe_settings()
    return {
        "smollm2-quickstart": three_ways([*quickstart_settings(posts_dir()), *FP32]),
        "smollm2-math": three_ways([*recipe, *FP32]),
        # Synchronous: on two cores the faster mode for this model (the quickstart suite).
        "smollm2-sweep": {name: tba_method(label, [*recipe, *FP32], [*SYNC, *change])
                          for name, (label, change) in SWEEP.items()},  # fmt: skip
    }


def run(methods: dict[str, Method], args: argparse.Namespace) -> dict:
    """Every method for every seed (`benchmarks.common.run_suite`), each run scored after it ends
    (`benchmarks.heldout.score_run`) and summed up (`run_facts`); the results of `methods`."""
    write_posts(posts_dir())

    def score(run_dir: Path, num_eval: int) -> list[dict]:
        curve = score_run(run_dir, num_eval, batch_size=args.eval_batch_size,
                          keep_snapshots=args.keep_files)  # fmt: skip
        if not args.keep_files:  # a scored run is not run again: nothing to resume
            shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
        return curve

    results = run_suite(methods, args, score=score, summarize=run_facts)
    return {name: results[name] for name in methods}


# ----------------------------------------------------------------------------- run facts


def run_facts(run_dir: Path) -> dict:
    """What the report needs of a run besides its curve: `run_summary`'s figures, where its
    training time went (`time_split`), its training reward over time (`reward_series`), the
    process's minutes and those of scoring it afterwards."""
    facts = run_summary(run_dir) | {"time_split": time_split(run_dir),
                                    "train_reward": reward_series(run_dir)}  # fmt: skip
    if (run_dir / PROCESS).exists():
        facts["process_minutes"] = json.loads((run_dir / PROCESS).read_text())["seconds"] / 60
    if (run_dir / SCORING).exists():
        scoring = json.loads((run_dir / SCORING).read_text())
        facts |= {"scoring_minutes": scoring["seconds"] / 60, "scored_items": scoring["items"]}
    return facts


def scored_items(results: dict, default: int) -> str:
    """How many held-out items the runs of `results` were scored on, as the runs recorded it
    (`--report` reads runs scored with another `--num-eval`); `default` where none did."""
    counts = {run["scored_items"] for entry in results.values()
              for run in entry["runs"].values() if "scored_items" in run}  # fmt: skip
    return "/".join(str(n) for n in sorted(counts)) if counts else str(default)


def time_split(run_dir: Path) -> dict[str, float]:
    """Seconds of the run's training time by what the trainer did, from its step records:
    `generation` (sampling and scoring done in the trainer's process: tba synchronous, TRL),
    `training` (the optimizer steps), `handoff` (publishing weights to the searchers),
    `waiting` (for samples, the first buffer fill included), `other` (the rest: checkpoints,
    snapshots, logging), `total`; `searcher_busy`, the share of its time an asynchronous
    searcher spent generating."""
    records = [r for r in read_metrics(run_dir / "metrics.jsonl") if "step_seconds" in r]
    summary = json.loads((run_dir / "eval.json").read_text())
    total = summary["train_minutes"] * 60
    parts = {
        "generation": sum(r.get("gen_seconds", 0.0) for r in records),
        "training": sum(r.get("train_seconds", 0.0) for r in records),
        "handoff": sum(r.get("sync_seconds", 0.0) for r in records),
        # A synchronous step's wait is its own generation; what is left of it is waiting.
        "waiting": summary.get("warmup_seconds", 0.0) + sum(
            r["wait_seconds"] - r.get("gen_seconds", 0.0) for r in records if "wait_seconds" in r),
    }  # fmt: skip
    split = parts | {"other": total - sum(parts.values()), "total": total}
    busy = [r["searcher0/busy_frac"] for r in records if "searcher0/busy_frac" in r]
    return split | ({"searcher_busy": busy[-1]} if busy else {})


def reward_series(run_dir: Path, window: int = 64, points: int = 200) -> list[dict]:
    """The mean training reward of the last `window` fresh samples (at least) after each step, as
    curve points (minutes, step, samples, value), at most `points` of them."""
    records = read_metrics(run_dir / "metrics.jsonl")
    series, recent = [], []
    for record, samples in zip(records, samples_consumed(records)):
        if "reward_in" not in record or not record.get("samples_in"):
            continue
        recent.append((record["samples_in"], record["reward_in"]))
        while sum(n for n, _ in recent[1:]) >= window:
            recent.pop(0)
        mean = sum(n * r for n, r in recent) / sum(n for n, _ in recent)
        series.append({"minutes": record["time"] / 60, "step": record["step"],
                       "samples": samples, "value": mean})  # fmt: skip
    every = max(1, math.ceil(len(series) / points))
    return series[::every] + (series[-1:] if (len(series) - 1) % every else [])


# ---------------------------------------------------------------------------------- report


def report(results: dict, args: argparse.Namespace, suite: Suite) -> None:
    """Plots (the headline metric, the cut share, the training reward; each against minutes and
    samples) in `args.out`, and the tables."""
    args.out.mkdir(parents=True, exist_ok=True)
    aggregates = load_aggregates(results, args.snapshot_minutes)
    target = args.target if args.target is not None else common_target(aggregates, suite)
    title = f"{args.suite}: {SMOLLM2}"
    plot(aggregates, target, args.out / "curves.png", title, suite.label)
    cut = load_aggregates(with_curves(results, lambda run: metric_curve(run, CUT)),
                          args.snapshot_minutes)  # fmt: skip
    plot(cut, None, args.out / "cut.png", title, "share of greedy answers cut at the limit")
    print_main_table(aggregates, cut, results, args, suite, target)
    train_target = args.train_target if args.train_target is not None else suite.train_target
    rewards = load_aggregates(with_curves(results, lambda run: run.get("train_reward", [])),
                              args.snapshot_minutes / 10)  # fmt: skip
    if rewards:
        plot(rewards, train_target, args.out / "train_reward.png", title,
             "training reward (last 64 fresh samples)")  # fmt: skip
        print_train_reward_table(rewards, train_target)
    print_time_split(results)


def with_curves(results: dict, curve_of: Callable[[dict], list[dict]]) -> dict:
    """`results` with each run's curve replaced by `curve_of(run)`; runs without one, and
    methods left without runs, left out."""
    out = {}
    for name, entry in results.items():
        runs = {seed: {**run, "curve": curve_of(run)} for seed, run in entry["runs"].items()}
        kept = {seed: run for seed, run in runs.items() if run["curve"]}
        if kept:
            out[name] = {"label": entry["label"], "runs": kept}
    return out


def metric_curve(run: dict, metric: str) -> list[dict]:
    """A run's held-out curve with `metric` as its value."""
    return [{**point, "value": point["metrics"][metric]} for point in run["curve"]
            if metric in point.get("metrics", {})]  # fmt: skip


def common_target(aggregates: dict[str, Aggregate], suite: Suite) -> float | None:
    """The highest level every method's mean curve reaches (rounded down: to a point for a
    share, to half a unit for a reward), when that is above every base; else None."""
    level = min(float(np.max(agg.mean)) for agg in aggregates.values())
    level = math.floor(level * 100) / 100 if suite.percent else math.floor(level * 2) / 2
    return level if level > max(agg.base for agg in aggregates.values()) else None


def value_text(value: float, percent: bool) -> str:
    return f"{value:.1%}" if percent else f"{value:.2f}"


def spread_text(values: list[float], percent: bool) -> str:
    """mean ± std over seeds."""
    std = float(np.std(values, ddof=1)) if len(values) > 1 else 0.0
    return f"{value_text(float(np.mean(values)), percent)} ± {value_text(std, percent)}"


def seed_times_text(times: list[float | None], budget: float) -> str:
    """The minutes each seed took to a target: mean ± std of those that reached it, and how
    many did."""
    reached = [t for t in times if t is not None]
    if not reached:
        return f"> {budget:.1f} (0/{len(times)})"
    std = float(np.std(reached, ddof=1)) if len(reached) > 1 else 0.0
    return f"{np.mean(reached):.1f} ± {std:.1f} ({len(reached)}/{len(times)})"


def target_cells(agg: Aggregate, target: float | None) -> str:
    """Minutes to `target` (mean curve), per seed, and samples (mean curve): three cells."""
    if target is None:
        return "- | - | -"
    end = float(agg.grid[-1])
    minutes = agg.minutes_to(target)
    samples = f"{np.interp(minutes, agg.grid, agg.samples):,.0f}" if minutes is not None else "-"
    return (f"{minutes_text(minutes, end)} | {seed_times_text(agg.seed_minutes_to(target), end)} "
            f"| {samples}")  # fmt: skip


def print_main_table(
    aggregates: dict[str, Aggregate], cut: dict[str, Aggregate], results: dict,
    args: argparse.Namespace, suite: Suite, target: float | None,
) -> None:  # fmt: skip
    """Per method: base, end (mean ± std over seeds), gain, time and samples to the target, the
    cut share at the base and the end, steps and samples/s; then the standard error of one
    evaluation."""
    said = "--target" if args.target is not None else "the highest every mean curve reaches"
    shown = value_text(target, suite.percent) if target is not None else "none above every base"
    items = scored_items(results, args.num_eval)
    print(f"\n{args.suite}: {suite.label}, {items} held-out items; target {shown} "
          f"({said})")  # fmt: skip
    print("| method | seeds | base | end (mean ± std) | gain | minutes to target (mean curve) | "
          "per seed | samples to target | cut at the limit: base → end | steps | samples/s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, agg in aggregates.items():
        ends = [run[-1].value for run in agg.runs]
        gain = value_text(float(np.mean(ends)) - agg.base, suite.percent)
        cuts = cut.get(name)
        cut_text = "-" if cuts is None or not cuts.runs else (
            f"{cuts.base:.1%} → {spread_text([run[-1].value for run in cuts.runs], True)}")
        print(f"| {agg.label} | {len(agg.runs)} | {value_text(agg.base, suite.percent)} | "
              f"{spread_text(ends, suite.percent)} | {gain} | {target_cells(agg, target)} | "
              f"{cut_text} | {agg.mean_of('steps'):.0f} | {agg.mean_of('samples_per_s'):.2f} |")
    errors = [point["metrics"]["eval_se"] for entry in results.values()
              for run in entry["runs"].values() for point in run["curve"][-1:]
              if "eval_se" in point.get("metrics", {})]  # fmt: skip
    if errors:
        print("\nStandard error of one evaluation (the ends' mean): "
              f"±{value_text(float(np.mean(errors)), suite.percent)}")  # fmt: skip


def print_train_reward_table(rewards: dict[str, Aggregate], target: float | None) -> None:
    """Per method: the time and samples each seed took to a training reward of `target`, and
    the training reward at the end. Per seed only: a training-reward curve starts at the first
    step, not at minute 0, where a mean curve on the grid would read it."""
    shown = f"{target:g}" if target is not None else "none (--train-target)"
    print(f"\nTraining reward (mean of the last 64 fresh samples), target {shown}")
    print("| method | minutes to target per seed (mean ± std, reached) | samples to target "
          "(mean of the seeds reaching it) | training reward at the end (mean ± std) |")
    print("|---|---|---|---|")
    for agg in rewards.values():
        ends = spread_text([run[-1].value for run in agg.runs], False)
        if target is None:
            print(f"| {agg.label} | - | - | {ends} |")
            continue
        times = agg.seed_minutes_to(target)
        samples = [float(np.interp(t, [p.minutes for p in run], [p.samples for p in run]))
                   for t, run in zip(times, agg.runs) if t is not None]  # fmt: skip
        print(f"| {agg.label} | {seed_times_text(times, float(agg.grid[-1]))} | "
              f"{f'{np.mean(samples):,.0f}' if samples else '-'} | {ends} |")


SPLIT_PARTS = ("generation", "training", "handoff", "waiting", "other")


def print_time_split(results: dict) -> None:
    """Per method (means over seeds): where its training time went, its searcher's busy share,
    the whole process's minutes and those of scoring its snapshots afterwards (not in the
    training clock)."""
    print("\nWhere the training time went (minutes, share of the training time; mean over seeds)")
    print("| method | training | generation | optimizer steps | hand-off | waiting | other "
          "(checkpoints, snapshots, logging) | searcher busy | whole process | scoring after "
          "the run |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for entry in results.values():
        runs = [run for run in entry["runs"].values() if "time_split" in run]
        if not runs:
            continue
        splits = [run["time_split"] for run in runs]
        total = mean_of(splits, "total")
        cells = [f"{mean_of(splits, part) / 60:.1f} ({mean_of(splits, part) / total:.0%})"
                 for part in SPLIT_PARTS]  # fmt: skip
        busy = mean_of(splits, "searcher_busy")
        process, scoring = mean_of(runs, "process_minutes"), mean_of(runs, "scoring_minutes")
        print(f"| {entry['label']} | {total / 60:.1f} | {' | '.join(cells)} | "
              f"{'-' if busy is None else f'{busy:.0%}'} | "
              f"{'-' if process is None else f'{process:.1f}'} | "
              f"{'-' if scoring is None else f'{scoring:.1f}'} |")  # fmt: skip


def mean_of(rows: list[dict], key: str) -> float | None:
    """The mean of `key` over the rows that have it (None: none has)."""
    values = [row[key] for row in rows if key in row]
    return float(np.mean(values)) if values else None
