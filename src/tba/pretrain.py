"""`tba pretrain`: supervise the built-in tiny policy on a limited set of worked solutions.

RL sharpens what a policy can already sample; it rarely teaches what the policy never samples. So
the base policy is trained only part of the way: it solves some held-out problems greedily and
many more within 16 samples, which leaves TB something to sharpen.
"""

from __future__ import annotations

import math
import random
import time
from pathlib import Path

import torch

from tba.policy.batching import right_pad
from tba.policy.model import build_tiny_llama
from tba.policy.tokenizer import build_char_tokenizer
from tba.tasks import math as math_task


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
    logits = model(input_ids=ids, attention_mask=attention, use_cache=False).logits[:, :-1]
    nll = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1), reduction="none"
    ).view_as(response_mask)
    return (nll * response_mask).sum() / response_mask.sum()


def pretrain_math_policy(
    out_dir: Path,
    *,
    num_examples: int,
    steps: int,
    batch_size: int,
    lr: float,
    sloppy_fraction: float,
    seed: int,
    log=print,
) -> Path:
    """Train the tiny policy on `num_examples` worked solutions for `steps` steps, save it.

    A `sloppy_fraction` of the three-step solutions stop one step early (see
    `math_task.stopped_early`), as imperfect demonstrations do: the base policy picks up the habit
    often enough that greedy decoding keeps it, while sampling still finishes many problems.
    """
    torch.manual_seed(seed)
    tokenizer = build_char_tokenizer()
    model = build_tiny_llama(
        len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        seed=seed,
    )
    examples = math_task.problems("train", num_examples, seed)
    prompts = [tokenizer(math_task.format_prompt(p.question))["input_ids"] for p in examples]
    rng = random.Random(seed)
    solutions = [
        math_task.stopped_early(p) if rng.random() < sloppy_fraction else p.solution
        for p in examples
    ]
    responses = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in solutions]
    responses = [r + [tokenizer.eos_token_id] for r in responses]

    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    warmup = max(1, steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / steps))),
    )
    order: list[int] = []
    start = time.time()
    model.train()
    for step in range(steps):
        if len(order) < batch_size:
            order += rng.sample(range(num_examples), num_examples)
        batch, order = order[:batch_size], order[batch_size:]
        loss = sft_loss(
            model,
            [prompts[i] for i in batch],
            [responses[i] for i in batch],
            tokenizer.pad_token_id,
        )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if step % 100 == 0 or step == steps - 1:
            log(f"pretrain step {step}/{steps} loss {loss.item():.4f} ({time.time() - start:.0f}s)")
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir
