"""Batched sampling with a KV cache.

Prompts are left-padded so that every row's next token sits in the last column; each decoding step
feeds one token per row and reuses the cache. The behaviour log-prob of a response is the sum of
`log_softmax(logits / temperature)` over its sampled tokens, EOS included.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from tba.policy.batching import left_pad, unique_prompts
from tba.policy.kv_cache import cache_keyword, returned_cache


@dataclass
class Generation:
    response_ids: list[list[int]]  # EOS included when the response ended
    logps: list[float]  # behaviour log-prob of each response at the sampling temperature
    token_logps: list[list[float]]  # the same per response token (they sum to `logps`)
    truncated: list[bool]  # hit max_new_tokens without EOS


@torch.no_grad()
def generate(
    model: PreTrainedModel,
    prompts: list[list[int]],
    *,
    eos_id: int,
    pad_id: int,
    max_new_tokens: int,
    temperature: float = 1.0,
    greedy: bool = False,
    generator: torch.Generator | None = None,
) -> Generation:
    """Sample one response per prompt (repeat a prompt in `prompts` to get several)."""
    device = next(model.parameters()).device
    distinct, rows = unique_prompts(prompts)
    ids, mask, positions = left_pad(distinct, pad_id, device)
    was_training = model.training
    model.eval()
    # Each distinct prompt is encoded once; its KV cache is then copied to each of its samples.
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
    index = torch.tensor(rows, device=device)
    cache, logits = returned_cache(out), out.logits[index, -1]
    cache.batch_select_indices(index)
    mask, next_position = mask[index], positions[index, -1] + 1
    cache_key = cache_keyword(model)

    n = len(prompts)
    tokens = torch.empty((n, 0), dtype=torch.long, device=device)
    step_logps: list[torch.Tensor] = []
    done = torch.zeros(n, dtype=torch.bool, device=device)
    lengths = torch.full((n,), max_new_tokens, dtype=torch.long, device=device)
    for step in range(max_new_tokens):
        log_probs = torch.log_softmax(logits.float() / temperature, dim=-1)
        if greedy:
            token = log_probs.argmax(-1)
        else:
            token = torch.multinomial(log_probs.exp(), 1, generator=generator).squeeze(-1)
        token = torch.where(done, torch.full_like(token, pad_id), token)
        step_logps.append(torch.where(done, 0.0, log_probs.gather(-1, token[:, None]).squeeze(-1)))
        tokens = torch.cat([tokens, token[:, None]], dim=1)
        finished_now = ~done & (token == eos_id)
        lengths = torch.where(finished_now, step + 1, lengths)
        done |= finished_now
        if bool(done.all()) or step == max_new_tokens - 1:
            break
        mask = torch.cat([mask, torch.ones((n, 1), dtype=mask.dtype, device=device)], dim=1)
        out = model(
            input_ids=token[:, None],
            attention_mask=mask,
            position_ids=next_position[:, None],
            use_cache=True,
            **{cache_key: cache},
        )
        cache, logits = returned_cache(out), out.logits[:, -1]
        next_position = next_position + 1
    model.train(was_training)

    token_logps = torch.stack(step_logps, dim=1)
    lengths_list = lengths.tolist()
    return Generation(
        response_ids=[row[:length] for row, length in zip(tokens.tolist(), lengths_list)],
        logps=token_logps.sum(-1).tolist(),
        token_logps=[row[:length] for row, length in zip(token_logps.tolist(), lengths_list)],
        truncated=[not d for d in done.tolist()],
    )


def generate_batched(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    greedy: bool = False,
    generator: torch.Generator | None = None,
    batch_size: int = 256,
) -> list[list[int]]:
    """One response per prompt (its token ids, EOS included when it ended), generated
    `batch_size` prompts at a time: what evaluation, the tasks' judges and the world builds use."""
    responses: list[list[int]] = []
    for first in range(0, len(prompts), batch_size):
        out = generate(
            model, prompts[first : first + batch_size], eos_id=tokenizer.eos_token_id,
            pad_id=tokenizer.pad_token_id, max_new_tokens=max_new_tokens,
            temperature=temperature, greedy=greedy, generator=generator,
        )  # fmt: skip
        responses += out.response_ids
    return responses


def generate_texts(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[list[int]],
    **options,
) -> list[str]:
    """`generate_batched`, decoded without special tokens."""
    responses = generate_batched(model, tokenizer, prompts, **options)
    return tokenizer.batch_decode(responses, skip_special_tokens=True)
