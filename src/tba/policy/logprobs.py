"""The log-probs used everywhere: searcher (reference log-probs), trainer, evaluation and SFT.

    log pi(y_t | x, y_<t) = log_softmax(logits_t / temperature)[y_t]      (token_logprobs)
    log pi(y | x)         = sum_t log pi(y_t | x, y_<t)                    (sequence_logprobs)

over every response token, EOS included, with no length normalisation.

A batch usually holds K responses per prompt, so each distinct prompt runs through the model once
and its KV cache is shared by all of its responses (gradients flow through the shared prompt).
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from tba.policy.batching import left_pad, right_pad, unique_prompts
from tba.policy.kv_cache import cache_keyword, returned_cache
from tba.policy.model import is_checkpointing


def log_softmax(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log_softmax(logits / temperature) over the vocabulary, in fp32 at least (bf16 logits would
    round the log-probs); fp64 stays fp64, for exact tests."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return torch.log_softmax(logits / temperature, dim=-1)


def gather_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """log pi(token) under `logits` (..., V) at `temperature`, for every entry of `tokens` (...)."""
    return log_softmax(logits, temperature).gather(-1, tokens[..., None]).squeeze(-1)


def sequence_logprobs(
    model: PreTrainedModel,
    prompts: list[list[int]],
    responses: list[list[int]],
    *,
    pad_id: int,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Summed response log-probs, shape (len(prompts),), float32, differentiable."""
    token_logps, mask = token_logprobs(
        model, prompts, responses, pad_id=pad_id, temperature=temperature
    )
    return (token_logps * mask).sum(-1)


def token_logprobs(
    model: PreTrainedModel,
    prompts: list[list[int]],
    responses: list[list[int]],
    *,
    pad_id: int,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token response log-probs (N, T), right-padded, float32, differentiable, and the 0/1
    float mask (N, T) of real response tokens."""
    # Checkpointed layers run without a KV cache (transformers drops it), so each response then
    # runs with its own copy of its prompt.
    share = not (model.training and is_checkpointing(model))
    logits, response_ids, response_mask = response_logits(
        model, prompts, responses, pad_id=pad_id, share_prompts=share
    )
    token_logps = gather_logprobs(logits, response_ids, temperature)
    mask = response_mask.to(token_logps.dtype)
    return token_logps * mask, mask


def response_logits(
    model: PreTrainedModel,
    prompts: list[list[int]],
    responses: list[list[int]],
    *,
    pad_id: int,
    share_prompts: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The logits that predict each response token (N, T, V), the right-padded response ids
    (N, T) and the 0/1 mask of real response tokens (N, T). Prompts are left-padded and
    responses right-padded, so that every response starts in the same column. `share_prompts`:
    each distinct prompt runs once and its KV cache serves all of its responses; otherwise each
    response runs with its prompt in front."""
    if any(len(r) == 0 for r in responses):
        raise ValueError("every response needs at least one token")
    device = next(model.parameters()).device
    distinct, rows = unique_prompts(prompts)
    prompt_ids, prompt_mask, prompt_positions = left_pad(distinct, pad_id, device)
    index = torch.tensor(rows, device=device)
    response_ids, response_mask = right_pad(responses, pad_id, device)
    if share_prompts:
        logits = _logits_sharing_prompts(
            model, prompt_ids, prompt_mask, prompt_positions, index, response_ids, response_mask
        )
        return logits, response_ids, response_mask
    ids = torch.cat([prompt_ids[index], response_ids], dim=1)
    mask = torch.cat([prompt_mask[index], response_mask], dim=1)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False)
    # The logits at the last prompt column predict the first response token, and so on.
    start = prompt_ids.size(1) - 1
    return out.logits[:, start : start + response_ids.size(1)], response_ids, response_mask


def _logits_sharing_prompts(
    model: PreTrainedModel,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    prompt_positions: torch.Tensor,
    index: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
) -> torch.Tensor:
    """Logits predicting each response token (N, T, V): every distinct prompt runs once and its
    KV cache is copied to each of its responses (`index`: the prompt of each response)."""
    prompt_out = model(
        input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=prompt_positions,
        use_cache=True,
    )  # fmt: skip
    cache = returned_cache(prompt_out)
    cache.batch_select_indices(index)  # each response gets its prompt's keys and values
    offsets = torch.arange(response_ids.size(1), device=response_ids.device)
    response_out = model(
        input_ids=response_ids,
        attention_mask=torch.cat([prompt_mask[index], response_mask], dim=1),
        position_ids=prompt_positions[index, -1:] + 1 + offsets,
        use_cache=True,
        **{cache_keyword(model): cache},
    )
    # The prompt's last logits predict the first response token; each response position the next.
    return torch.cat([prompt_out.logits[index, -1:], response_out.logits[:, :-1]], dim=1)
