"""Batched sampling with a KV cache, two ways, and the choice between them (`policy.sampler`).

Both run the phases of `tba.policy.decoding`: one prefill per distinct prompt (its K samples share
it), a decode loop of one token per row per step, one draw rule (`draw_tokens`, one uniform number
a row: with the same seed both paths draw the same samples, up to the rounding of their logits)
and one rule for where a response ends. The behaviour log-prob of a response is the sum of
`log_softmax(logits / temperature)` over its sampled tokens, EOS included. A finished row keeps
running as padding, with log-prob 0.

- The loop (`generate`, `policy.sampler=loop`, here): a KV cache and attention mask allocated
  once for the prompt and every new token, written in place, attention over the positions filled
  so far (`kv_cache.PreallocatedLayer`), and a check with the host after every token of whether
  all rows are done. Simple and the fastest on a CPU, where every step waits for its matrix
  products anyway; on a GPU, shapes that change every step and the per-token wait keep the
  device idle most of the time.
- The static path (`StaticSampler`, `policy.sampler=static` or `compiled`,
  `tba.policy.static_sampling`): a static KV cache and buffers allocated once per bucket of rows
  and length, every decode step at the same shapes, optionally `torch.compile`d (with CUDA graphs
  on CUDA), and the host reading whether all rows are done only every `check_every` steps.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Literal, Protocol

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from tba.errors import ConfigError
from tba.policy.decoding import (
    Generation,
    Prefill,
    decode_loop,
    draw_tokens,
    evaluating,
    log_probs_at,
    next_logits,
    prefill,
    settle,
    to_generation,
)
from tba.policy.kv_cache import cache_keyword, preallocated_cache, supports_static_cache
from tba.policy.static_sampling import StaticSampler, bucket, compiles_whole, pick_tokens

__all__ = [
    "Generation", "LoopSampler", "LoopVariant", "Sampler", "SamplerKind", "StaticSampler", "bucket",
    "compiles_whole", "generate", "generate_batched", "generate_texts", "pick_tokens",
    "resolve_sampler", "sampler_for",
]  # fmt: skip

SamplerKind = Literal["auto", "loop", "static", "compiled"]
Draw = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class LoopVariant:
    """How the loop runs. The defaults are what tba runs; each switch puts back what ran before,
    to measure it against in one process (`python -m benchmarks.cpu_speed --ab`)."""

    preallocate: bool = True  # False: Hugging Face's dynamic cache (a torch.cat a layer a token)
    last_logits_only: bool = True  # False: the prefill's output head at every prompt position
    inverse_draw: bool = True  # False: torch.multinomial (a random number a vocabulary entry)


def sample_tokens(
    logits: torch.Tensor,
    done: torch.Tensor,
    *,
    temperature: float,
    greedy: bool,
    generator: torch.Generator | None,
    eos_id: int,
    pad_id: int,
    inverse_draw: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The loop's draw: every row's next token (`draw_tokens` from the tempered softmax with one
    uniform number a row, drawn as the static path draws them; or its argmax), its log-prob and
    whether the row is now done."""
    log_probs = log_probs_at(logits, temperature)
    if greedy:
        token = log_probs.argmax(-1)
    elif inverse_draw:
        uniform = torch.rand((logits.size(0), 1), dtype=torch.float64, device=logits.device,
                             generator=generator)  # fmt: skip
        token = draw_tokens(log_probs, uniform)
    else:
        token = torch.multinomial(log_probs.exp(), 1, generator=generator).squeeze(-1)
    return settle(log_probs, token, done, eos_id, pad_id)


@dataclass
class LoopRows:
    """The loop's rows: their cache, attention mask over every position the generation may fill
    (`filled` of them so far), last token, its position and done flag, and every step's tokens and
    log-probs."""

    cache: Any
    mask: torch.Tensor
    filled: int
    position: torch.Tensor
    done: torch.Tensor
    token: torch.Tensor = field(init=False)
    tokens: list[torch.Tensor] = field(default_factory=list)
    logps: list[torch.Tensor] = field(default_factory=list)

    @classmethod
    def start(cls, p: Prefill, max_new_tokens: int, preallocate: bool) -> LoopRows:
        """One row per sample from the prefill (row i the prompt `p.rows[i]`): its keys and
        values copied into a cache of prompt + `max_new_tokens` positions (with `preallocate`,
        where the model's layers allow: `kv_cache.preallocated_cache`; else rows selected from
        the dynamic cache, which grows by concatenation)."""
        index = torch.tensor(p.rows, device=p.mask.device)
        capacity = p.width + max_new_tokens
        cache = preallocated_cache(p.cache, index, capacity) if preallocate else None
        if cache is None:
            cache = p.cache
            cache.batch_select_indices(index)
        mask = p.mask.new_ones((len(p.rows), capacity))
        mask[:, : p.width] = p.mask[index]
        done = torch.zeros(len(p.rows), dtype=torch.bool, device=index.device)
        return cls(cache, mask, p.width, p.next_position[index], done)

    def record(self, token: torch.Tensor, logp: torch.Tensor, done: torch.Tensor) -> torch.Tensor:
        """Keep a step's outputs; returns the rows' done flags."""
        self.token, self.done = token, done
        self.tokens.append(token)
        self.logps.append(logp)
        return done


def decode_step(
    model: PreTrainedModel, cache_key: str, rows: LoopRows, draw: Draw, step: int
) -> torch.Tensor:
    """One token for every row: the last one fed at its position over the mask of the positions
    filled (the prompt's padding masked), the next drawn by `draw` (`sample_tokens`). Nothing here
    waits for the device."""
    rows.filled += 1
    logits, rows.cache = next_logits(model, cache_key, rows.cache, rows.token, rows.position,
                                     rows.mask[:, : rows.filled])  # fmt: skip
    rows.position = rows.position + 1
    return rows.record(*draw(logits, rows.done))


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
    variant: LoopVariant = LoopVariant(),
) -> Generation:
    """Sample one response per prompt (repeat a prompt in `prompts` to get several): the loop.
    It reads after every token whether all rows are done (on a CPU that wait costs nothing: every
    step waits for its matrix products anyway), so that no step runs past the last EOS."""
    draw = partial(sample_tokens, temperature=temperature, greedy=greedy, generator=generator,
                   eos_id=eos_id, pad_id=pad_id, inverse_draw=variant.inverse_draw)  # fmt: skip
    with evaluating(model):
        p = prefill(model, prompts, pad_id, last_logits_only=variant.last_logits_only)
        rows = LoopRows.start(p, max_new_tokens, variant.preallocate)
        rows.record(*draw(p.logits[p.rows], rows.done))
        del p
        step = partial(decode_step, model, cache_keyword(model), rows, draw)
        decode_loop(step, rows.done, max_new_tokens, check_every=1)
    tokens, logps = torch.stack(rows.tokens, dim=1), torch.stack(rows.logps, dim=1)
    return to_generation(tokens, logps, eos_id, max_new_tokens)


class Sampler(Protocol):
    """What generates responses for a model: the loop or the static path."""

    def generate(
        self,
        prompts: list[list[int]],
        *,
        eos_id: int,
        pad_id: int,
        max_new_tokens: int,
        temperature: float = 1.0,
        greedy: bool = False,
        generator: torch.Generator | None = None,
    ) -> Generation:
        """One response per prompt (repeat a prompt in `prompts` to get several)."""


class LoopSampler:
    """The loop (`generate`) over one model, as `variant` says (the default: as tba runs)."""

    def __init__(self, model: PreTrainedModel, variant: LoopVariant = LoopVariant()) -> None:
        self.model = model
        self.variant = variant

    def generate(self, prompts: list[list[int]], **options: Any) -> Generation:
        return generate(self.model, prompts, variant=self.variant, **options)


def resolve_sampler(model: PreTrainedModel, kind: SamplerKind) -> str:
    """`auto`: `compiled` on CUDA for a model that compiles as one graph into a static cache,
    else `loop` (on a CPU the loop is the faster: docs/engines.md). `static` and `compiled` on a
    model a static cache cannot serve: one line saying so."""
    static_ok = supports_static_cache(model)
    if kind == "auto":
        on_cuda = next(model.parameters()).device.type == "cuda"
        return "compiled" if on_cuda and static_ok and compiles_whole(model) else "loop"
    if kind != "loop" and not static_ok:
        raise ConfigError(
            f"policy.sampler={kind}: {type(model).__name__} has layers that Hugging Face's "
            "StaticCache serves otherwise (sliding-window or linear attention) or a transformers "
            "release before 5; use policy.sampler=loop or auto"
        )
    return kind


class _KeptSamplers(dict):
    """A model's static samplers, kept on the model; a copy of the model starts without any."""

    def __deepcopy__(self, memo: dict) -> _KeptSamplers:
        return _KeptSamplers()

    def __reduce__(self) -> tuple:
        return (_KeptSamplers, ())


def sampler_for(model: PreTrainedModel, kind: SamplerKind = "auto") -> Sampler:
    """The sampler of `kind` (`policy.sampler`) for `model`. A static one is made once per model
    and kept on it, as Hugging Face keeps a model's compiled forward on the model: its buckets
    (and on CUDA the graphs recorded over them) then serve every later generation."""
    kind = resolve_sampler(model, kind)
    if kind == "loop":
        return LoopSampler(model)
    kept = vars(model).setdefault("_tba_samplers", _KeptSamplers())
    if kind not in kept:
        kept[kind] = StaticSampler(model, compile=kind == "compiled")
    return kept[kind]


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
    sampler: SamplerKind = "loop",
) -> list[list[int]]:
    """One response per prompt (its token ids, EOS included when it ended), generated
    `batch_size` prompts at a time: what evaluation, the tasks' judges and the world builds use.
    `sampler`: `policy.sampler` (held-out evaluation generates as the searchers do)."""
    responses: list[list[int]] = []
    sample = sampler_for(model, sampler).generate
    for first in range(0, len(prompts), batch_size):
        out = sample(
            prompts[first : first + batch_size], eos_id=tokenizer.eos_token_id,
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
