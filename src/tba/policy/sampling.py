"""Batched sampling with a KV cache, two ways.

Both left-pad the prompts so that every row's next token sits in the last column, encode each
distinct prompt once (its K samples share the prefill), then feed one token per row per step. The
behaviour log-prob of a response is the sum of `log_softmax(logits / temperature)` over its
sampled tokens, EOS included. A finished row keeps running as padding, with log-prob 0.

- The loop (`generate`, `policy.sampler=loop`): the dynamic cache of Hugging Face, a token and
  mask tensor that grow by one column per step, and a check with the host after every token of
  whether all rows are done. Simple and the fastest on a CPU, where every step waits for its
  matrix products anyway; on a GPU, shapes that change every step and the per-token wait keep
  the device idle most of the time.
- The static path (`StaticSampler`, `policy.sampler=static` or `compiled`): Hugging Face's
  `StaticCache` and buffers allocated once per bucket of batch size and length, so every decode
  step has the same shapes; `compiled` runs that step through `torch.compile` (on CUDA with CUDA
  graphs, "reduce-overhead"). Tokens are drawn on the device from noise drawn with the caller's
  generator (the exponential race, `pick_tokens`), and whether all rows are done is read every
  `check_every` steps: nothing else waits for the device until the end.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from tba.errors import ConfigError
from tba.policy.batching import left_pad, unique_prompts
from tba.policy.kv_cache import (
    cache_keyword,
    load_prefix,
    returned_cache,
    static_cache_like,
    supports_static_cache,
)
from tba.policy.model import unwrapped
from tba.policy.quantization import is_quantized

SamplerKind = Literal["auto", "loop", "static", "compiled"]


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
    """The loop (`generate`) over one model."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model

    def generate(self, prompts: list[list[int]], **options: Any) -> Generation:
        return generate(self.model, prompts, **options)


def pick_tokens(
    logits: torch.Tensor,
    noise: torch.Tensor,
    done: torch.Tensor,
    temperature: torch.Tensor,
    eos_id: int,
    pad_id: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every row's next token, its log-prob and whether the row is now done, on the device.

    The exponential race: with E_i ~ Exp(1) independent, P(argmax_i p_i / E_i = j) = p_j, so

        token = argmax_i  log p_i - log E_i,    p = softmax(logits / temperature)

    is an exact draw from p (the Gumbel-max trick, with Gumbel noise -log E). `noise` holds the
    E_i (float64: in float32 the smallest draws are so coarse that tokens below ~1e-7 could never
    win); noise of ones makes it the greedy argmax. A row already done gets `pad_id` with
    log-prob 0, as in the loop.
    """
    log_probs = torch.log_softmax(logits.float() / temperature, dim=-1)
    token = (log_probs - noise.log()).argmax(-1)
    token = torch.where(done, pad_id, token)
    logp = torch.where(done, 0.0, log_probs.gather(-1, token[:, None]).squeeze(-1))
    return token, logp, done | (token == eos_id)


LENGTH_BUCKET = 64  # static buffers hold a multiple of this many positions
# Compiled variants of the decode step per process (one per bucket and model shape). Dynamo's
# default, 8, would make a ninth bucket fail: a step compiled as one graph cannot fall back.
RECOMPILE_LIMIT = 64


def bucket(batch_size: int, length: int) -> tuple[int, int]:
    """The static buffers' shape for `batch_size` rows of up to `length` tokens: the next power
    of two rows and the next multiple of `LENGTH_BUCKET` positions, so that shapes repeat (each
    bucket is compiled once) at the price of some padding rows and masked positions."""
    return 1 << (batch_size - 1).bit_length(), math.ceil(length / LENGTH_BUCKET) * LENGTH_BUCKET


@dataclass
class StaticBuffers:
    """Everything a decode step of one bucket reads and writes, allocated once: the KV cache,
    the attention mask over all of its positions, each row's last token, position and done flag,
    the noise of the next draw, the temperature, and the tokens and log-probs generated so far."""

    cache: Any  # transformers.StaticCache
    mask: torch.Tensor  # (rows, positions): the prompt's padding 0, everything after it 1
    token: torch.Tensor  # (rows,)
    position: torch.Tensor  # (rows,) the position of `token`
    done: torch.Tensor  # (rows,)
    noise: torch.Tensor  # (rows, vocabulary) float64
    temperature: torch.Tensor  # ()
    tokens: torch.Tensor  # (rows, positions)
    logps: torch.Tensor  # (rows, positions)

    @classmethod
    def allocate(
        cls, prefix: Any, rows: int, length: int, vocab_size: int, config: Any
    ) -> StaticBuffers:
        """For `rows` rows of `length` positions, with the heads, dtype and device of the
        prefill cache `prefix`."""
        device = prefix.layers[0].keys.device
        buffers = cls(
            cache=static_cache_like(prefix, rows, length, config),
            mask=torch.ones((rows, length), dtype=torch.long, device=device),
            token=torch.zeros(rows, dtype=torch.long, device=device),
            position=torch.zeros(rows, dtype=torch.long, device=device),
            done=torch.zeros(rows, dtype=torch.bool, device=device),
            noise=torch.ones((rows, vocab_size), dtype=torch.float64, device=device),
            temperature=torch.ones((), dtype=torch.float32, device=device),
            tokens=torch.zeros((rows, length), dtype=torch.long, device=device),
            logps=torch.zeros((rows, length), dtype=torch.float32, device=device),
        )
        # Fixed addresses: CUDA graphs read these in place instead of copying them every step.
        for tensor in (buffers.mask, buffers.token, buffers.position, buffers.done,
                       buffers.noise, buffers.temperature):  # fmt: skip
            torch._dynamo.mark_static_address(tensor)
        return buffers

    def record(
        self, step: int, token: torch.Tensor, logp: torch.Tensor, done: torch.Tensor
    ) -> None:
        """Keep a step's outputs (a compiled step's outputs are overwritten by its next run)."""
        self.token.copy_(token)
        self.done.copy_(done)
        self.tokens[:, step].copy_(token)
        self.logps[:, step].copy_(logp)


class StaticSampler:
    """Generation at fixed shapes into a static KV cache, without a host synchronisation per
    token (see the module's docstring). One per model: it keeps its buffers per bucket, and with
    `compile` its compiled decode step, for every later generation."""

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        compile: bool,
        compile_options: dict[str, Any] | None = None,
        check_every: int = 8,
    ) -> None:
        """`compile_options`: for `torch.compile` (default: "reduce-overhead", i.e. CUDA graphs,
        on CUDA; inductor's default elsewhere). `check_every`: steps between two reads of whether
        every row is done (each read waits for the device; the steps run past the last EOS are
        fewer than this)."""
        self.model = model
        self.check_every = check_every
        self.cache_key = cache_keyword(model)
        self.buckets: dict[tuple[int, int], StaticBuffers] = {}
        self.decode = self._decode_step
        if compile:
            if compile_options is None:
                device = next(model.parameters()).device
                compile_options = {"mode": "reduce-overhead"} if device.type == "cuda" else {}
            self.decode = torch.compile(self._decode_step, fullgraph=compiles_whole(model),
                                        dynamic=False, **compile_options)  # fmt: skip

    def _decode_step(
        self,
        cache: Any,
        token: torch.Tensor,
        position: torch.Tensor,
        mask: torch.Tensor,
        noise: torch.Tensor,
        done: torch.Tensor,
        temperature: torch.Tensor,
        eos_id: int,
        pad_id: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Feed each row's last token, pick its next one: every shape fixed by the bucket."""
        out = self.model(
            input_ids=token[:, None], attention_mask=mask, position_ids=position[:, None],
            use_cache=True, **{self.cache_key: cache},
        )  # fmt: skip
        return pick_tokens(out.logits[:, -1], noise, done, temperature, eos_id, pad_id)

    @torch.no_grad()
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
        model = self.model
        device = next(model.parameters()).device
        distinct, rows = unique_prompts(prompts)
        ids, mask, positions = left_pad(distinct, pad_id, device)
        was_training = model.training
        model.eval()
        # The prefill runs once per distinct prompt, with the dynamic cache (its shape changes
        # with every batch of prompts: it is not compiled), and is then copied row by row.
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
        prefix, prompt_length = returned_cache(out), ids.size(1)
        num_rows, length = bucket(len(prompts), prompt_length + max_new_tokens)
        if (num_rows, length) not in self.buckets:
            self.buckets[num_rows, length] = StaticBuffers.allocate(
                prefix, num_rows, length, out.logits.size(-1), model.config
            )
        b = self.buckets[num_rows, length]
        # Rows past the last sample copy the first prompt and are done from the start: they run
        # as padding, and are dropped.
        index = torch.tensor(rows + [0] * (num_rows - len(rows)), device=device)
        load_prefix(b.cache, prefix, index)
        b.mask[:, :prompt_length].copy_(mask[index])
        b.mask[:, prompt_length:].fill_(1)
        b.position.copy_(positions[index, -1] + 1)
        b.done.copy_(torch.arange(num_rows, device=device) >= len(prompts))
        b.temperature.fill_(temperature)
        b.noise.fill_(1.0)  # greedy: the race without noise is the argmax
        self._draw(b, greedy, generator)
        first = pick_tokens(out.logits[index, -1], b.noise, b.done, b.temperature, eos_id, pad_id)
        b.record(0, *first)
        del out, prefix
        steps = 1
        with torch._dynamo.config.patch(cache_size_limit=RECOMPILE_LIMIT):
            while steps < max_new_tokens:
                if steps % self.check_every == 0 and bool(b.done.all()):  # the only sync
                    break
                self._draw(b, greedy, generator)
                b.record(steps, *self.decode(b.cache, b.token, b.position, b.mask, b.noise,
                                             b.done, b.temperature, eos_id, pad_id))  # fmt: skip
                b.position.add_(1)
                steps += 1
        model.train(was_training)
        return _generation(b.tokens[: len(prompts), :steps], b.logps[: len(prompts), :steps],
                           eos_id, max_new_tokens)  # fmt: skip

    @staticmethod
    def _draw(b: StaticBuffers, greedy: bool, generator: torch.Generator | None) -> None:
        """The next step's Exp(1) noise, from the caller's generator, on the device."""
        if not greedy:
            b.noise.exponential_(generator=generator)


def _generation(
    tokens: torch.Tensor, logps: torch.Tensor, eos_id: int, max_new_tokens: int
) -> Generation:
    """Responses cut after their first EOS (past it, rows ran as padding with log-prob 0);
    one without EOS ran `max_new_tokens` steps and is truncated."""
    responses, token_logps, truncated = [], [], []
    for row, row_logps in zip(tokens.tolist(), logps.tolist(), strict=True):
        length = row.index(eos_id) + 1 if eos_id in row else max_new_tokens
        responses.append(row[:length])
        token_logps.append(row_logps[:length])
        truncated.append(eos_id not in row)
    return Generation(responses, logps.sum(-1).tolist(), token_logps, truncated)


def compiles_whole(model: PreTrainedModel) -> bool:
    """Whether Hugging Face declares this model's forward compilable as one graph (a quantized
    model is left to the loop: bitsandbytes' layers inside a compiled decode step are untested
    here)."""
    model = unwrapped(model)
    return bool(getattr(model, "_can_compile_fullgraph", False)) and not is_quantized(model)


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
    and kept on it, as Hugging Face keeps a model's compiled forward on the model: its buffers
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
