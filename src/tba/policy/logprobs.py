"""The sequence log-prob used everywhere: searcher (reference log-probs) and trainer alike.

    log pi(y | x) = sum_t log_softmax(logits_t / temperature)[y_t]

summed over every response token, EOS included, with no length normalisation.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel


def right_pad_pairs(prompts: list[list[int]], responses: list[list[int]], pad_id: int):
    """Concatenate prompt and response per row, right-pad; mark which targets are response tokens.

    Returns (input_ids, attention_mask, response_mask) where response_mask[:, t] says whether
    input_ids[:, t + 1] is a response token (the target of position t).
    """
    rows = [p + r for p, r in zip(prompts, responses)]
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    response_mask = torch.zeros((len(rows), width - 1), dtype=torch.bool)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        ids[i, : len(p) + len(r)] = torch.tensor(p + r)
        attention[i, : len(p) + len(r)] = 1
        response_mask[i, len(p) - 1 : len(p) + len(r) - 1] = True
    return ids, attention, response_mask


def sequence_logprobs(
    model: PreTrainedModel,
    prompts: list[list[int]],
    responses: list[list[int]],
    *,
    pad_id: int,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Summed response log-probs, shape (len(prompts),), float32, differentiable w.r.t. the model."""
    device = next(model.parameters()).device
    ids, attention, response_mask = right_pad_pairs(prompts, responses, pad_id)
    ids, attention, response_mask = ids.to(device), attention.to(device), response_mask.to(device)
    logits = model(input_ids=ids, attention_mask=attention, use_cache=False).logits[:, :-1]
    log_probs = torch.log_softmax(logits.float() / temperature, dim=-1)
    token_logps = log_probs.gather(-1, ids[:, 1:, None]).squeeze(-1)
    return (token_logps * response_mask).sum(-1)
