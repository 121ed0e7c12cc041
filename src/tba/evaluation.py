"""Held-out evaluation: a task's own (`Task.evaluate`), or greedy pass@1 and sampled pass@k.

pass@k here is the fraction of problems with at least one correct answer among k samples (the
plain estimator with n = k; the unbiased estimator of Chen et al. equals it when n = k).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from tba.core import RewardFn, Task
from tba.policy.sampling import generate_texts
from tba.policy.tokenizer import encode_prompts
from tba.rewards.scorer import as_reward_inputs, call_reward


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

    @classmethod
    def from_config(cls, config, full: bool = False) -> EvalSettings:
        return cls(
            max_new_tokens=config.policy.max_new_tokens, temperature=config.policy.temperature,
            batch_size=config.eval.batch_size, seed=config.seed,
            chat_template=config.policy.chat_template, pass_k=config.eval.pass_k,
            num_pass_k=config.task.num_eval_pass_k, full=full,
        )  # fmt: skip


def evaluate(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, task: Task, settings: EvalSettings
) -> dict[str, float]:
    """The task's held-out metrics: its own evaluation, else greedy pass@1 of `task.correct_fn`
    on `task.eval_rows` (and, with `settings.full`, sampled pass@k and pass@1)."""
    if task.evaluate is not None:
        return task.evaluate(model, tokenizer, settings)
    result = {
        "eval_pass@1": greedy_pass_at_1(
            model, tokenizer, task.eval_rows, task.correct_fn,
            max_new_tokens=settings.max_new_tokens, batch_size=settings.batch_size,
            chat_template=settings.chat_template,
        )
    }  # fmt: skip
    if settings.full:
        result |= sampled_pass_at_k(
            model, tokenizer, task.eval_rows[: settings.num_pass_k], task.correct_fn,
            k=settings.pass_k, max_new_tokens=settings.max_new_tokens,
            temperature=settings.temperature, seed=settings.seed,
            batch_size=2 * settings.batch_size, chat_template=settings.chat_template,
        )  # fmt: skip
    return result


def _scores(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    rows: list[dict],
    score_fn: RewardFn,
    *,
    max_new_tokens: int,
    temperature: float,
    greedy: bool,
    batch_size: int,
    generator: torch.Generator | None = None,
    chat_template: bool = False,
) -> list[float]:
    """`score_fn` of one completion per row (the row's other columns passed on)."""
    prompts = [row["prompt"] for row in rows]
    completions = generate_texts(
        model, tokenizer, encode_prompts(tokenizer, prompts, chat_template=chat_template),
        max_new_tokens=max_new_tokens, temperature=temperature, greedy=greedy,
        generator=generator, batch_size=batch_size,
    )  # fmt: skip
    columns = {key: [row[key] for row in rows] for key in rows[0] if key != "prompt"}
    prompts, completions = as_reward_inputs(prompts, completions)
    return [float(s) for s in call_reward(score_fn, prompts, completions, **columns)]


def _correct(model, tokenizer, rows: list[dict], correct_fn: RewardFn, **options) -> list[bool]:
    return [score > 0.5 for score in _scores(model, tokenizer, rows, correct_fn, **options)]


def greedy_scores(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    rows: list[dict],
    score_fn: RewardFn,
    *,
    max_new_tokens: int,
    batch_size: int = 256,
    chat_template: bool = False,
) -> list[float]:
    """`score_fn` of the greedy completion of each row."""
    return _scores(
        model, tokenizer, rows, score_fn, max_new_tokens=max_new_tokens, temperature=1.0,
        greedy=True, batch_size=batch_size, chat_template=chat_template,
    )  # fmt: skip


def greedy_pass_at_1(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    rows: list[dict],
    correct_fn: RewardFn,
    *,
    max_new_tokens: int,
    batch_size: int = 256,
    chat_template: bool = False,
) -> float:
    correct = _correct(
        model, tokenizer, rows, correct_fn, max_new_tokens=max_new_tokens, temperature=1.0,
        greedy=True, batch_size=batch_size, chat_template=chat_template,
    )  # fmt: skip
    return sum(correct) / len(correct)


def sampled_pass_at_k(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    rows: list[dict],
    correct_fn: RewardFn,
    *,
    k: int,
    max_new_tokens: int,
    temperature: float,
    seed: int = 0,
    batch_size: int = 512,
    chat_template: bool = False,
) -> dict[str, float]:
    """pass@k and the mean accuracy of single samples (pass@1 sampled), from k samples each."""
    repeated = [row for row in rows for _ in range(k)]
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    correct = _correct(
        model, tokenizer, repeated, correct_fn, max_new_tokens=max_new_tokens,
        temperature=temperature, greedy=False, batch_size=batch_size, generator=generator,
        chat_template=chat_template,
    )  # fmt: skip
    per_problem = [any(correct[i * k : (i + 1) * k]) for i in range(len(rows))]
    return {
        f"pass@{k}": sum(per_problem) / len(rows),
        "sampled_pass@1": sum(correct) / len(correct),
    }
