"""Held-out evaluation: a task's own (`Task.evaluate`), or greedy pass@1 and sampled pass@k.

pass@k here is the fraction of problems with at least one correct answer among k samples (the
plain estimator with n = k; the unbiased estimator of Chen et al. equals it when n = k).

The user's functions (a task's `correct_fn`, or its reward functions for `eval_reward`) are
called as in training (`tba.rewards.scorer`: TRL's keyword contract, a timeout, faults counted).
A completion a function could not score counts as wrong, `eval_unscored` says how many there
were, and each fault goes to `settings.on_fault`: `EvalFaults` logs it, and stops the run (or
`tba eval`) when a function failed on every completion of an evaluation, called twice.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from tba.config import RunConfig
from tba.core import EventLogger, RewardFn, Task
from tba.errors import RewardError
from tba.policy.sampling import generate_batched
from tba.policy.tokenizer import encode_prompts
from tba.rewards.scorer import RewardScorer, Scores, TrainerState


class EvalFaults:
    """Faults of the user's functions in held-out evaluation: each one an event. A function that
    fails on some completions leaves them unscored (`eval_unscored`); one that fails on every
    completion of an evaluation stops the run at once, with its reason: the evaluation measured
    nothing, and a run without one would end with a metric of NaN and status 0."""

    def __init__(self, log_event: EventLogger) -> None:
        self.log_event = log_event
        self.failed_all: dict[str, tuple[str, int]] = {}  # function -> (reason, completions)

    def __call__(self, function: str, reason: str, failed: int, total: int) -> None:
        self.log_event("eval_fault", function=function, reason=reason, failed=failed, of=total)
        if failed == total:
            self.failed_all.setdefault(function, (reason, total))

    def evaluation_done(self) -> None:
        """Raises `RewardError` when a function failed on every completion it was given."""
        failed_all, self.failed_all = self.failed_all, {}
        for function, (reason, total) in failed_all.items():
            raise RewardError(f"held-out evaluation: {function!r} failed on all {total} "
                              f"completions: {reason}")  # fmt: skip


@dataclass(frozen=True)
class EvalSettings:
    """How a policy is evaluated (from the run's config)."""

    max_new_tokens: int
    temperature: float = 1.0  # of the sampled metrics
    batch_size: int = 256
    seed: int = 0
    chat_template: bool = False
    pass_k: int = 16
    num_pass_k: int = 128  # problems of the pass@k estimate
    full: bool = False  # the costly metrics too (pass@k): at the start and the end of a run
    max_prompt_length: int | None = None
    reward_timeout_s: float = 60.0
    reward_weights: tuple[float, ...] | None = None
    step: int = 0  # optimizer steps taken by the evaluated policy
    max_steps: int = 0
    sampler: str = "auto"  # `policy.sampler`: evaluation generates as the built-in engine does
    # on_fault(function, reason, completions it failed on, completions): a user function's fault
    on_fault: Callable[[str, str, int, int], None] | None = field(default=None, compare=False)

    @classmethod
    def from_config(
        cls, config: RunConfig, full: bool = False, step: int = 0,
        on_fault: Callable[[str, str, int, int], None] | None = None,
    ) -> EvalSettings:  # fmt: skip
        weights = config.task.reward_weights
        return cls(
            max_new_tokens=config.policy.max_new_tokens, temperature=config.policy.temperature,
            batch_size=config.eval.batch_size, seed=config.seed,
            chat_template=config.policy.chat_template, pass_k=config.eval.pass_k,
            num_pass_k=config.task.num_eval_pass_k, full=full,
            max_prompt_length=config.policy.max_prompt_length,
            reward_timeout_s=config.searchers.reward_timeout_s,
            reward_weights=tuple(weights) if weights is not None else None,
            step=step, max_steps=config.train.max_steps or 0, sampler=config.policy.sampler,
            on_fault=on_fault,
        )  # fmt: skip


def evaluate(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, task: Task, settings: EvalSettings
) -> dict[str, float]:
    """The task's held-out metrics: its own evaluation, else greedy pass@1 of `task.correct_fn`
    on `task.eval_rows` (and, with `settings.full`, sampled pass@k and pass@1)."""
    if task.evaluate is not None:
        return task.evaluate(model, tokenizer, settings)
    scores = score_completions(model, tokenizer, task.eval_rows, [task.correct_fn], settings,
                               greedy=True)  # fmt: skip
    result = {"eval_pass@1": _mean(_correct(scores))} | _unscored(scores, "eval_unscored")
    if settings.full:
        result |= sampled_pass_at_k(model, tokenizer, task.eval_rows[: settings.num_pass_k],
                                    task.correct_fn, settings)  # fmt: skip
    return result


def score_completions(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    rows: list[dict],
    reward_fns: list[RewardFn],
    settings: EvalSettings,
    *,
    greedy: bool,
    generator: torch.Generator | None = None,
    weights: tuple[float, ...] | None = None,
    batch_size: int | None = None,
) -> Scores:
    """One completion per row (greedy, or sampled at the settings' temperature), scored by
    `reward_fns` with the row's other columns, as training scores them."""
    prompts = [row["prompt"] for row in rows]
    prompt_ids = encode_prompts(tokenizer, prompts, chat_template=settings.chat_template,
                                max_length=settings.max_prompt_length)  # fmt: skip
    completion_ids = generate_batched(
        model, tokenizer, prompt_ids, max_new_tokens=settings.max_new_tokens,
        temperature=1.0 if greedy else settings.temperature, greedy=greedy, generator=generator,
        batch_size=batch_size or settings.batch_size, sampler=settings.sampler,
    )  # fmt: skip
    completions = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    columns = {key: [row[key] for row in rows] for key in rows[0] if key != "prompt"}
    # Faults go to `on_fault`: whether they stop the run is the run's call. A call that fails
    # on every completion is made once more: one failure then fails the whole evaluation.
    scorer = RewardScorer(reward_fns, weights=weights, timeout_s=settings.reward_timeout_s,
                          max_failures=sys.maxsize, call_again=True)  # fmt: skip
    state = TrainerState(settings.step, settings.max_steps)
    scores = scorer.score(prompts, completions, completion_ids, columns, state)
    for name, reason, failed in scores.faults:
        if settings.on_fault is not None:
            settings.on_fault(name, reason, failed, len(completions))
    return scores


def sampled_pass_at_k(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    rows: list[dict],
    correct_fn: RewardFn,
    settings: EvalSettings,
) -> dict[str, float]:
    """pass@k and the mean accuracy of single samples (pass@1 sampled), from k samples each."""
    k = settings.pass_k
    repeated = [row for row in rows for _ in range(k)]
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(settings.seed)
    scores = score_completions(model, tokenizer, repeated, [correct_fn], settings, greedy=False,
                               generator=generator, batch_size=2 * settings.batch_size)  # fmt: skip
    correct = _correct(scores)
    per_problem = [any(correct[i * k : (i + 1) * k]) for i in range(len(rows))]
    return {f"pass@{k}": _mean(per_problem), "sampled_pass@1": _mean(correct)}


def _correct(scores: Scores) -> list[bool]:
    """Correct: a score above 0.5 (a completion the function could not score is not)."""
    return [score > 0.5 for score in scores.totals]


def _unscored(scores: Scores, name: str) -> dict[str, float]:
    """`{name: completions without a usable score}`, when there were some."""
    missing = sum(score != score for score in scores.totals)  # NaN
    return {name: float(missing)} if missing else {}


def _mean(values: list) -> float:
    return sum(values) / len(values)
