"""`tba eval`: score a run's policies on the held-out set after the run, with the task's own
evaluator, as training evaluates them.

- `score_final(run_dir)`: the trained policy in RUN_DIR/final/, evaluated as a run ends (the
  task's metrics; for pass@1 tasks also sampled pass@k).
- `score_snapshots(run_dir)`: the base policy at minute 0, then every snapshot the run saved
  (`eval.snapshot_minutes`), each evaluated as a run does every `eval.every` steps: a learning
  curve measured after the run, on a held-out set chosen then, at no cost to training time.

Both read the run's config.yaml with `overrides` on top (`task.num_eval=1024`,
`eval.batch_size=64`, `policy.device=cuda`, `seed=0` for the held-out set of seed 0, ...); the
base policy stays the run's own whatever `seed` says. Each result is a point: `minutes` and
`step` of training, the fresh `samples` consumed by then, `value` (the task's headline metric,
e.g. greedy pass@1) and all its `metrics`. A run made in Python (`TBATrainer`) has its task only
there: pass it as `task=trainer.task`.

The code a custom task's config names (`task.reward_funcs`, `task.eval_func`) is imported only
as this user's `tba train` recorded it in the run directory, or with `trust_code=True`
(`tba eval --trust-code`; `tba.trust`). A run directory a killed `tba train --overwrite` left
half-replaced is first put back as it was (`tba.run_dir.settle_interrupted_replacement`).

`tba eval` writes the results to RUN_DIR/eval_final.json and RUN_DIR/eval_snapshots.json.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

from safetensors.numpy import load_file

from tba.checkpoint import list_checkpoints
from tba.config import RunConfig
from tba.core import Task
from tba.errors import ConfigError
from tba.evaluation import EvalFaults, EvalSettings, evaluate
from tba.locks import FileLock, describe_holder
from tba.policy.model import check_device, load_policy, resolve_device, set_weights
from tba.policy.tokenizer import load_tokenizer
from tba.run_dir import (
    LOCK_FILE,
    REPLACED,
    RunBusyError,
    final_saved,
    read_metrics,
    run_config,
    samples_consumed,
    settle_interrupted_replacement,
)
from tba.tasks import load_task, resolve_policy
from tba.tasks.custom import check_run_code

FINAL_SCORES = "eval_final.json"
SNAPSHOT_SCORES = "eval_snapshots.json"


def score_final(
    run_dir: Path, overrides: Sequence[str] = (), *, task: Task | None = None,
    log: Callable[[str], None] = print, trust_code: bool = False,
) -> dict:  # fmt: skip
    """The held-out metrics of the run's final policy, at the step and minute the run ended."""
    settle_run(run_dir, log)
    config = run_config(run_dir, overrides)
    final = run_dir / "final"
    records = read_metrics(run_dir / "metrics.jsonl")
    if not final_saved(final):
        raise FileNotFoundError(f"{run_dir}: no final policy (final/ not found: the run has not "
                                f"ended); {_without_final(run_dir, records)}")  # fmt: skip
    task = task or run_task(run_dir, config, log, trust_code=trust_code)
    model, tokenizer = load_scored_policy(final, config)
    settings = EvalSettings.from_config(config, full=True, step=records[-1]["step"])
    metrics = checked_evaluate(model, tokenizer, task, settings, log)
    last = records[-1]
    return point(last["time"] / 60, last["step"], samples_consumed(records)[-1], task, metrics)


def score_snapshots(
    run_dir: Path, overrides: Sequence[str] = (), *, task: Task | None = None,
    log: Callable[[str], None] = print, trust_code: bool = False,
) -> list[dict]:  # fmt: skip
    """The held-out metrics of the base policy (minute 0), then of every snapshot of the run."""
    settle_run(run_dir, log)
    config = run_config(run_dir, overrides)
    records = read_metrics(run_dir / "metrics.jsonl")
    snapshots = [(record, samples) for record, samples in zip(records, samples_consumed(records))
                 if "snapshot" in record and record["step"] > 0]  # fmt: skip
    if not snapshots:
        raise FileNotFoundError(f"{run_dir}: no snapshots (a run saves them every "
                                "eval.snapshot_minutes=N minutes)")  # fmt: skip
    task = task or run_task(run_dir, config, log, trust_code=trust_code)
    seed = run_config(run_dir).seed  # the policy the run started from, whatever seed evaluates
    base = resolve_policy(config.policy.model, config.pretrain, seed, log)
    model, tokenizer = load_scored_policy(base, config)
    settings = EvalSettings.from_config(config)
    curve = [point(0.0, 0, 0, task, checked_evaluate(model, tokenizer, task, settings, log))]
    for record, samples in snapshots:
        set_weights(model, load_file(run_dir / record["snapshot"]))
        metrics = checked_evaluate(model, tokenizer, task, replace(settings, step=record["step"]),
                                   log)  # fmt: skip
        curve.append(point(record["time"] / 60, record["step"], samples, task, metrics))
    return curve


def settle_run(run_dir: Path, log: Callable[[str], None]) -> None:
    """The run in `run_dir` as it is, before it is read: a replacement a kill cut short settled
    (`settle_interrupted_replacement`); a run another process holds is read as it is now."""
    with contextlib.suppress(RunBusyError):
        settle_interrupted_replacement(run_dir, log)


def checked_evaluate(
    model, tokenizer, task: Task, settings: EvalSettings, log: Callable[[str], None]
) -> dict[str, float]:
    """`evaluate`, as a run evaluates: its user functions' faults said, and one that failed on
    every completion an error (`EvalFaults`), not a metric of NaN."""

    def log_event(kind: str, **fields) -> None:
        log(f"{kind}: " + ", ".join(f"{key}={value}" for key, value in fields.items()))

    faults = EvalFaults(log_event)
    metrics = evaluate(model, tokenizer, task, replace(settings, on_fault=faults))
    faults.evaluation_done()
    return metrics


def _without_final(run_dir: Path, records: list[dict]) -> str:
    """What can be done with a run that has no final policy: what it has; for a run that a
    process is training now, wait for it (or score the snapshots it saved so far)."""
    holder = FileLock(run_dir / LOCK_FILE, directory=True).holder()
    if holder is not None:
        snapshots = any("snapshot" in record for record in records)
        later = (f", or score the snapshots it has saved with `tba eval --snapshots {run_dir}`"
                 if snapshots else " (a run with eval.snapshot_minutes=N saves snapshots that "
                 "`tba eval --snapshots` scores while it runs)")  # fmt: skip
        replacing = (f"; the run it replaces is kept in {run_dir / REPLACED} until it has its "
                     "first checkpoint" if (run_dir / REPLACED).is_dir() else "")  # fmt: skip
        return (f"the run is in progress, held by {describe_holder(holder)}: evaluate it when "
                f"it ends{later}{replacing}")  # fmt: skip
    ways = []
    if list_checkpoints(run_dir):
        ways.append(f"finish it with `tba train --resume {run_dir}`")
    if any("snapshot" in record for record in records):
        ways.append(f"score its snapshots with `tba eval --snapshots {run_dir}`")
    return " or ".join(ways) or "it stopped before its first checkpoint: start it again"


def run_task(
    run_dir: Path, config: RunConfig, log: Callable[[str], None], *, trust_code: bool = False
) -> Task:
    """The run's task, built from its config as `tba train` builds it; the code that config
    names imported only as the run recorded it, or with `trust_code` (`check_run_code`)."""
    tc = config.task
    if tc.name == "custom" and tc.train_path is None and tc.dataset is None:
        raise ConfigError(
            f"{run_dir}: its task was given in Python (TBATrainer); score it there, with "
            "trainer.evaluate() or tba.offline_eval.score_snapshots(run_dir, task=trainer.task)"
        )
    check_run_code(tc, run_config(run_dir).task, run_dir, trusted=trust_code, log=log)
    return load_task(tc, seed=config.seed, policy_model=config.policy.model,
                     cache_dir=config.pretrain.cache_dir, log=log)  # fmt: skip


def load_scored_policy(path: Path, config: RunConfig):
    """A policy saved with its tokenizer, on the device and in the dtype the run trained it."""
    check_device(config.policy.device, "policy.device")
    device = resolve_device(config.policy.device)
    model = load_policy(str(path), device, dtype=config.policy.dtype)
    return model, load_tokenizer(str(path), chat_template=config.policy.chat_template)


def point(minutes: float, step: int, samples: int, task: Task, metrics: dict) -> dict:
    return {"minutes": minutes, "step": step, "samples": samples,
            "value": metrics[task.metrics[0]], "metrics": metrics}  # fmt: skip
