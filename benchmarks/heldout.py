"""Held-out scores of a run's snapshots, the same for tba's runs and TRL's (`benchmarks.trl_grpo`
writes a tba config.yaml and tba's snapshots): the greedy completion of each held-out prompt,
scored by the task's own functions, with the standard error of that one evaluation and the share
of completions cut at the length limit (no EOS within `policy.max_new_tokens`).

- A task with a verifier (math: the last number is the answer, `correct_fn`): the share of
  greedy answers it accepts (`eval_pass@1`), whatever the length. A cut answer is scored like
  any other, so the training reward's truncation penalty does not enter it; how many were cut
  is `eval_cut_frac`.
- A task scored by reward functions (a custom task, e.g. TRL's quickstart `reward_len`): their
  mean over the greedy completions (`eval_reward`), as `tba.tasks.custom.MeanReward`.

Scoring happens after the run, so it costs no training time; `score_run` also writes the curve
to RUN_DIR/eval_snapshots.json, as `tba eval --snapshots` does, and how long it took to
RUN_DIR/scoring.json.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from pathlib import Path

from tba import offline_eval
from tba.config import RunConfig
from tba.core import RewardFn, Task
from tba.evaluation import EvalSettings, score_completions
from tba.run_dir import run_config
from tba.tasks import load_task

CUT = "eval_cut_frac"
SCORING = "scoring.json"


class GreedyScores:
    """The held-out metrics of a policy: its greedy completion of every row, scored."""

    def __init__(self, rows: list[dict], functions: list[RewardFn], headline: str) -> None:
        self.rows, self.functions, self.headline = rows, functions, headline

    def __call__(self, model, tokenizer, settings: EvalSettings) -> dict[str, float]:
        eos = tokenizer.eos_token_id

        def cut_at_limit(completion_ids: list[list[int]], **_) -> list[float]:
            # Generation stops at EOS or at the limit: no EOS at the end means cut there.
            return [float(not ids or ids[-1] != eos) for ids in completion_ids]

        # The marker rides along with weight 0: it leaves the totals to the task's functions
        # (weighted as in training where they are its reward functions).
        given = settings.reward_weights if self.headline == "eval_reward" else None
        weights = (*(given or [1.0] * len(self.functions)), 0.0)
        scores = score_completions(model, tokenizer, self.rows, [*self.functions, cut_at_limit],
                                   settings, greedy=True, weights=weights)  # fmt: skip
        cut = scores.parts["cut_at_limit"]
        metrics = {CUT: sum(cut) / len(cut)}
        if self.headline == "eval_pass@1":  # unscored (NaN) counts as wrong, as tba's pass@1
            values = [float(total > 0.5) for total in scores.totals]
            mean = sum(values) / len(values)
            se = math.sqrt(mean * (1 - mean) / len(values))
        else:
            values = [total for total in scores.totals if math.isfinite(total)]
            mean, se = mean_and_se(values)
        unscored = sum(not math.isfinite(total) for total in scores.totals)
        return metrics | {self.headline: mean, "eval_se": se} | (
            {"eval_unscored": float(unscored)} if unscored else {})  # fmt: skip


def mean_and_se(values: list[float]) -> tuple[float, float]:
    """The mean and its standard error (NaN for no values, 0 spread for one)."""
    if not values:
        return math.nan, math.nan
    mean = math.fsum(values) / len(values)
    if len(values) == 1:
        return mean, 0.0
    variance = math.fsum((v - mean) ** 2 for v in values) / (len(values) - 1)
    return mean, math.sqrt(variance / len(values))


def held_out_task(config: RunConfig, num_eval: int) -> Task:
    """The run's task with `num_eval` held-out rows of seed 0 (every run is scored on the same
    ones), evaluated by `GreedyScores`: the verifier where the task has one (`correct_fn`), else
    the mean of its reward functions."""
    task_config = config.task.model_copy(update={"num_eval": num_eval})
    task = load_task(task_config, seed=0, policy_model=config.policy.model,
                     cache_dir=config.pretrain.cache_dir)  # fmt: skip
    if task.correct_fn is not None:
        functions, headline = [task.correct_fn], "eval_pass@1"
    else:
        functions, headline = task.reward_fns, "eval_reward"
    return Task(task.name, [], task.eval_rows, task.reward_fns,
                evaluate=GreedyScores(task.eval_rows, functions, headline),
                metrics=(headline, CUT), conversational=task.conversational)  # fmt: skip


def score_run(
    run_dir: Path, num_eval: int, *, batch_size: int = 64, keep_snapshots: bool = True
) -> list[dict]:
    """The base policy and every snapshot of the run in `run_dir`, scored on `num_eval` held-out
    rows (`held_out_task`): a point each (minutes, step, samples, `value`: the headline metric,
    `metrics`). Written to RUN_DIR/eval_snapshots.json; without `keep_snapshots` the snapshot
    files go once scored (a 135M-parameter policy's are 540 MB each)."""
    start = time.time()
    config = run_config(run_dir)
    task = held_out_task(config, num_eval)
    overrides = [f"task.num_eval={num_eval}", "seed=0", f"eval.batch_size={batch_size}"]
    curve = offline_eval.score_snapshots(run_dir, overrides, task=task)
    (run_dir / offline_eval.SNAPSHOT_SCORES).write_text(json.dumps(curve, indent=1))
    (run_dir / SCORING).write_text(json.dumps({"seconds": time.time() - start,
                                               "items": num_eval}))  # fmt: skip
    if not keep_snapshots:
        shutil.rmtree(run_dir / "snapshots", ignore_errors=True)
    return curve
