"""Supervised fine-tuning: how the embedded worlds' models are made (`tba pretrain`).

    sft_loss = mean over response tokens of -log pi(y_t | x, y_<t)       (the prompt is context)

`supervise` runs it with AdamW, a linear warm-up and a cosine decay over shuffled passes of
(prompt, response) pairs; `fit`, the loop under it, also trains the reward models and classifiers
of the worlds on their own losses (at a constant learning rate).
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable

import torch

from tba.policy.batching import right_pad
from tba.policy.logprobs import next_token_logprobs


def right_pad_pairs(prompts: list[list[int]], responses: list[list[int]], pad_id: int):
    """Concatenate prompt and response per row, right-pad; mark which targets are response tokens.

    Returns (input_ids, attention_mask, response_mask) where response_mask[:, t] says whether
    input_ids[:, t + 1] is a response token (the target of position t).
    """
    ids, attention = right_pad([p + r for p, r in zip(prompts, responses)], pad_id, "cpu")
    response_mask = torch.zeros((len(ids), ids.size(1) - 1), dtype=torch.bool)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        response_mask[i, len(p) - 1 : len(p) + len(r) - 1] = True
    return ids, attention, response_mask


def sft_loss(model, prompts: list[list[int]], responses: list[list[int]], pad_id: int):
    """Mean negative log-likelihood of the response tokens (the prompt is context only)."""
    ids, attention, response_mask = right_pad_pairs(prompts, responses, pad_id)
    return -next_token_logprobs(model, ids, attention, response_mask).mean()


def supervise(
    model,
    prompts: list[list[int]],
    responses: list[list[int]],
    pad_id: int,
    *,
    steps: int,
    batch_size: int,
    lr: float,
    rng: random.Random,
    log=print,
    name: str = "sft",
) -> None:
    """Supervised fine-tuning on (prompt, response) pairs: shuffled passes over the data, AdamW,
    a linear warm-up over the first 5% of the steps, then a cosine decay; gradient norm <= 1."""
    order: list[int] = []

    def batch_loss() -> torch.Tensor:
        nonlocal order
        if len(order) < batch_size:
            order += rng.sample(range(len(prompts)), len(prompts))
        batch, order = order[:batch_size], order[batch_size:]
        return sft_loss(model, [prompts[i] for i in batch], [responses[i] for i in batch], pad_id)

    warmup = max(1, steps // 20)

    def lr_factor(step: int) -> float:
        cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, step / steps)))
        return min(1.0, (step + 1) / warmup) * cosine

    fit(model, batch_loss, steps=steps, lr=lr, name=name, log=log, lr_factor=lr_factor,
        max_grad_norm=1.0)  # fmt: skip


def fit(
    model,
    batch_loss: Callable[[], torch.Tensor],
    *,
    steps: int,
    lr: float,
    name: str,
    log=print,
    lr_factor: Callable[[int], float] | None = None,
    max_grad_norm: float | None = None,
) -> None:
    """`steps` AdamW steps, each on `batch_loss()` (a fresh batch's loss), at `lr` times
    `lr_factor(step)` (constant without one), the gradient norm clipped to `max_grad_norm`."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor) if lr_factor else None
    start = time.time()
    model.train()
    for step in range(steps):
        loss = batch_loss()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        optimizer.step()
        if schedule is not None:
            schedule.step()
        if step % 100 == 0 or step == steps - 1:
            log(f"{name} step {step}/{steps} loss {loss.item():.4f} ({time.time() - start:.0f}s)")
