"""Held-out evaluation: greedy pass@1 and sampled pass@k.

pass@k here is the fraction of problems with at least one correct answer among k samples (the
plain estimator with n = k; the unbiased estimator of Chen et al. equals it when n = k).
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from tba.policy.sampling import generate
from tba.policy.tokenizer import encode_prompts
from tba.tasks import RewardFn


def _correct(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    rows: list[dict],
    correct_fn: RewardFn,
    *,
    max_new_tokens: int,
    temperature: float,
    greedy: bool,
    batch_size: int,
    generator: torch.Generator | None = None,
    chat_template: bool = False,
) -> list[bool]:
    results: list[bool] = []
    for first in range(0, len(rows), batch_size):
        batch = rows[first : first + batch_size]
        texts = [row["prompt"] for row in batch]
        out = generate(
            model,
            encode_prompts(tokenizer, texts, chat_template=chat_template),
            eos_id=tokenizer.eos_token_id,
            pad_id=tokenizer.pad_token_id,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            greedy=greedy,
            generator=generator,
        )
        completions = tokenizer.batch_decode(out.response_ids, skip_special_tokens=True)
        columns = {key: [row[key] for row in batch] for key in batch[0] if key != "prompt"}
        scores = correct_fn([row["prompt"] for row in batch], completions, **columns)
        results += [score > 0.5 for score in scores]
    return results


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
