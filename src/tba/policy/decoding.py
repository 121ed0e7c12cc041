"""The phases both samplers of `tba.policy.sampling` share, in the order a generation runs them.

1. `prefill`: encode each distinct prompt once, left-padded so that every row's next token sits
   in the last column, with the output head applied at that column only (a prompt's K samples
   then copy its KV cache into one allocated for the whole generation: `tba.policy.kv_cache`).
2. `next_logits`, the heart of a decode step: one token for every row through the model, at its
   own position, over its cache and attention mask.
3. `log_probs_at`, `draw_tokens` and `settle`: the behaviour log-probs, `log_softmax(logits /
   temperature)` in float32 (what `Generation` reports, and what the trainer computes), each
   row's token drawn from them with one uniform number a row (both paths draw alike: one seed,
   the same samples), and what a drawn token does to its row: a row already done gets `pad_id`
   with log-prob 0, and a row that drew EOS is done.
4. `decode_loop`: steps until the length limit or until every row is done, read every
   `check_every` steps (each read waits for the device).
5. `response_ends` and `to_generation`: where each response ends (its first EOS, included, or
   the length limit: truncated), computed on the device, then the results copied to the host
   once, at the end.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel

from tba.policy.batching import left_pad, unique_prompts
from tba.policy.kv_cache import logits_keyword, returned_cache


@dataclass
class Generation:
    response_ids: list[list[int]]  # EOS included when the response ended
    logps: list[float]  # behaviour log-prob of each response at the sampling temperature
    token_logps: list[list[float]]  # the same per response token (they sum to `logps`)
    truncated: list[bool]  # hit max_new_tokens without EOS


@contextmanager
def evaluating(model: PreTrainedModel) -> Iterator[None]:
    """`model` in eval mode (no dropout: the samples follow the model's own distribution), its
    training mode restored after, also when generation fails."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


@dataclass
class Prefill:
    """The prompts encoded, one row per distinct prompt; `rows[i]`: sample i's prompt."""

    cache: Any  # the model's dynamic KV cache over the padded prompts
    logits: torch.Tensor  # (prompts, vocabulary): the logits of each first response token
    mask: torch.Tensor  # (prompts, width): 0 over the left padding
    next_position: torch.Tensor  # (prompts,): the position of each first response token
    rows: list[int]

    @property
    def width(self) -> int:
        """The padded prompts' length: where the responses start in the KV cache."""
        return self.mask.size(1)


def prefill(
    model: PreTrainedModel, prompts: list[list[int]], pad_id: int, *, last_logits_only: bool = True
) -> Prefill:
    """Encode every distinct prompt once (its samples share the work). Only the last position's
    logits are wanted (the first response token's): with `last_logits_only` the model's output
    head runs there alone (`logits_to_keep`), not at every prompt position (with SmolLM2's
    49,152-token vocabulary the head is a fifth of the work per token, and its output over a
    whole prompt prompts x width x vocabulary floats); False computes it everywhere, to measure
    against. They are copied out, so that nothing else of the model's output is kept through the
    decode."""
    device = next(model.parameters()).device
    distinct, rows = unique_prompts(prompts)
    ids, mask, positions = left_pad(distinct, pad_id, device)
    keep = logits_keyword(model) if last_logits_only else None
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                **({keep: 1} if keep else {}))  # fmt: skip
    return Prefill(returned_cache(out), out.logits[:, -1].clone(), mask, positions[:, -1] + 1,
                   rows)  # fmt: skip


def next_logits(
    model: PreTrainedModel,
    cache_key: str,
    cache: Any,
    token: torch.Tensor,
    position: torch.Tensor,
    mask: torch.Tensor,
) -> tuple[torch.Tensor, Any]:
    """Feed each row's last `token` at its `position`, attending to `mask`: the logits of every
    row's next token, and the cache the model returns (it writes the token's keys and values
    into `cache`, named `cache_key` in its forward: `kv_cache.cache_keyword`)."""
    out = model(
        input_ids=token[:, None], attention_mask=mask, position_ids=position[:, None],
        use_cache=True, **{cache_key: cache},
    )  # fmt: skip
    return out.logits[:, -1], returned_cache(out)


def log_probs_at(logits: torch.Tensor, temperature: float | torch.Tensor) -> torch.Tensor:
    """The distribution every token is drawn from, as log-probs, and the log-probs reported."""
    return torch.log_softmax(logits.float() / temperature, dim=-1)


def draw_tokens(log_probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Each row's token drawn from ``p = exp(log_probs)`` by inverse transform sampling, with
    ``uniform`` (rows, 1) float64 in [0, 1):

        token = min { j : u * sum_i p_i < sum_{i <= j} p_i }

    One random number a row, not one a vocabulary entry (the exponential race, Gumbel-max and
    `torch.multinomial` draw a whole row of them: on a CPU with a 49k vocabulary that is a sixth
    of a decode step). The cumulative sum is float64, so that a token of probability 1e-12 still
    owns its own sliver of [0, 1); a token of probability 0 owns none and is never drawn."""
    cdf = log_probs.exp().double().cumsum(-1)
    token = torch.searchsorted(cdf, uniform * cdf[:, -1:], right=True).squeeze(-1)
    return token.clamp_max(cdf.size(-1) - 1)  # u * total rounded up to total: the last token


def settle(
    log_probs: torch.Tensor, token: torch.Tensor, done: torch.Tensor, eos_id: int, pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The token each row keeps, its log-prob under `log_probs` and whether the row is now done:
    a row already done runs on as padding (`pad_id`, log-prob 0); one that drew EOS is done."""
    token = torch.where(done, pad_id, token)
    logp = torch.where(done, 0.0, log_probs.gather(-1, token[:, None]).squeeze(-1))
    return token, logp, done | (token == eos_id)


def decode_loop(
    decode_step: Callable[[int], torch.Tensor],
    done: torch.Tensor,
    max_new_tokens: int,
    check_every: int,
) -> int:
    """Run `decode_step(step)` (one token for every row; it returns the rows' done flags) for
    steps 1, 2, ... (step 0 was drawn from the prefill's logits), until `max_new_tokens` tokens
    or until every row is done. That is read every `check_every` steps, the only wait for the
    device: the rows run at most `check_every - 1` steps past their last EOS, as padding.
    Returns the number of tokens per row."""
    steps = 1
    while steps < max_new_tokens:
        if steps % check_every == 0 and bool(done.all()):
            break
        done = decode_step(steps)
        steps += 1
    return steps


def response_ends(
    tokens: torch.Tensor, eos_id: int, max_new_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each row's response ends, on the device: (its length, whether it was truncated).
    A response ends at its first EOS, included (past it the row ran as padding); one without EOS
    ran to `max_new_tokens` and is truncated."""
    is_eos = tokens == eos_id
    after = torch.arange(1, tokens.size(1) + 1, device=tokens.device)
    lengths = torch.where(is_eos, after, max_new_tokens).amin(-1)
    return lengths, ~is_eos.any(-1)


def to_generation(
    tokens: torch.Tensor, logps: torch.Tensor, eos_id: int, max_new_tokens: int
) -> Generation:
    """The responses, cut where they end (`response_ends`), from every row's tokens and their
    log-probs (rows, steps): the generation's only copies to the host (four)."""
    lengths, truncated = response_ends(tokens, eos_id, max_new_tokens)
    lengths, truncated = torch.stack([lengths, truncated.long()]).tolist()
    return Generation(
        response_ids=[row[:n] for row, n in zip(tokens.tolist(), lengths, strict=True)],
        logps=logps.sum(-1).tolist(),
        token_logps=[row[:n] for row, n in zip(logps.tolist(), lengths, strict=True)],
        truncated=[bool(t) for t in truncated],
    )
