"""The static path of `tba.policy.sampling` (`policy.sampler=static` or `compiled`): generation at
fixed shapes into a static KV cache, without a host synchronisation per token.

Hugging Face's `StaticCache` and every buffer a decode step reads or writes are allocated once
per bucket of rows and positions (`bucket`), so that every decode step in a bucket has the same
shapes; `compiled` runs that step through `torch.compile` (on CUDA with CUDA graphs,
"reduce-overhead"), compiled once per bucket. Tokens are drawn on the device from uniform
numbers drawn with the caller's generator (one a row, `pick_tokens`), and whether all rows are
done is read every `check_every` steps: nothing else waits for the device until the end.

What a bucket of R rows and L positions holds (`StaticBuffers.nbytes`):

- the KV cache: 2 (keys and values) x layers x R x kv_heads x head_dim x L x bytes per element;
- the mask, tokens and log-probs: R x L x 20 bytes (and R x 8 bytes of uniform numbers).

Qwen2.5-0.5B in bfloat16 (24 layers, 2 KV heads of 64) at 128 rows x 384 positions: 576 MiB of
cache. A sampler keeps at most `max_buckets` of them (default 2), so it holds at most `max_buckets`
x its largest bucket. A generation runs in the smallest kept bucket with enough rows and positions
(its rows first; the others run as padding, done from the start) and draws uniform numbers for its
own rows only, as the loop does: from a seeded generator it samples what it would in a bucket of
its own (on a CPU bit for bit; a GPU's kernels may round differently at another shape), and what
the loop samples, up to the rounding of the logits (the static cache attends over all of its
positions, masked, in another order of summation). Only when no kept bucket fits is one
allocated, after the least recently used beyond the bound are freed. What `torch.compile` keeps
per shape (code; on CUDA its graphs and their memory pool) is not freed with a bucket.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, fields
from functools import partial
from typing import Any

import torch
from transformers import PreTrainedModel

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
from tba.policy.kv_cache import cache_keyword, load_prefix, static_cache_like
from tba.policy.model import unwrapped
from tba.policy.quantization import is_quantized


def pick_tokens(
    logits: torch.Tensor,
    uniform: torch.Tensor,
    greedy: torch.Tensor,
    done: torch.Tensor,
    temperature: torch.Tensor,
    eos_id: int,
    pad_id: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every row's next token, its log-prob and whether the row is now done, on the device: the
    loop's draw (`draw_tokens` from ``p = softmax(logits / temperature)`` with the row's number
    of ``uniform``, (rows, 1) float64), or where the 0-d ``greedy`` flag is set the argmax (a
    flag, not a Python branch: one compiled step serves both). Done rows are settled as in the
    loop."""
    log_probs = log_probs_at(logits, temperature)
    token = torch.where(greedy, log_probs.argmax(-1), draw_tokens(log_probs, uniform))
    return settle(log_probs, token, done, eos_id, pad_id)


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
    the uniform numbers of the next draw (or the greedy flag), the temperature, and the tokens
    and log-probs generated so far."""

    cache: Any  # transformers.StaticCache
    mask: torch.Tensor  # (rows, positions): the prompt's padding 0, everything after it 1
    token: torch.Tensor  # (rows,)
    position: torch.Tensor  # (rows,) the position of `token`
    done: torch.Tensor  # (rows,)
    uniform: torch.Tensor  # (rows, 1) float64
    greedy: torch.Tensor  # () bool
    temperature: torch.Tensor  # ()
    tokens: torch.Tensor  # (rows, positions)
    logps: torch.Tensor  # (rows, positions)

    @classmethod
    def allocate(cls, p: Prefill, rows: int, length: int, config: Any) -> StaticBuffers:
        """For `rows` rows of `length` positions, with the heads, dtype and device of the
        prefill's cache and the vocabulary of its logits."""
        device = p.logits.device
        buffers = cls(
            cache=static_cache_like(p.cache, rows, length, config),
            mask=torch.ones((rows, length), dtype=torch.long, device=device),
            token=torch.zeros(rows, dtype=torch.long, device=device),
            position=torch.zeros(rows, dtype=torch.long, device=device),
            done=torch.zeros(rows, dtype=torch.bool, device=device),
            uniform=torch.zeros((rows, 1), dtype=torch.float64, device=device),
            greedy=torch.zeros((), dtype=torch.bool, device=device),
            temperature=torch.ones((), dtype=torch.float32, device=device),
            tokens=torch.zeros((rows, length), dtype=torch.long, device=device),
            logps=torch.zeros((rows, length), dtype=torch.float32, device=device),
        )
        # Fixed addresses: CUDA graphs read these in place instead of copying them every step.
        for tensor in (buffers.mask, buffers.token, buffers.position, buffers.done,
                       buffers.uniform, buffers.greedy, buffers.temperature):  # fmt: skip
            torch._dynamo.mark_static_address(tensor)
        return buffers

    @property
    def nbytes(self) -> int:
        """The memory the bucket holds (the formula of the module's docstring)."""
        cache = sum(t.nbytes for layer in self.cache.layers for t in (layer.keys, layer.values))
        others = (getattr(self, f.name) for f in fields(self) if f.name != "cache")
        return cache + sum(t.nbytes for t in others)

    def load(self, p: Prefill, samples: int, temperature: float, greedy: bool) -> torch.Tensor:
        """Start a generation of `samples` rows from the prefill (row i the prompt `p.rows[i]`):
        its KV cache, mask and positions; the rows past them copy the first prompt and are done
        from the start (they run as padding, and are dropped). Returns the rows' prompt index."""
        num_rows = self.done.size(0)
        index = torch.tensor(p.rows + [0] * (num_rows - samples), device=self.done.device)
        load_prefix(self.cache, p.cache, index)
        self.mask[:, : p.width].copy_(p.mask[index])
        self.mask[:, p.width :].fill_(1)
        self.position.copy_(p.next_position[index])
        self.done.copy_(torch.arange(num_rows, device=self.done.device) >= samples)
        self.temperature.fill_(temperature)
        self.greedy.fill_(greedy)
        return index

    def record(
        self, step: int, token: torch.Tensor, logp: torch.Tensor, done: torch.Tensor
    ) -> torch.Tensor:
        """Keep a step's outputs (a compiled step's outputs are overwritten by its next run);
        returns the rows' done flags."""
        self.token.copy_(token)
        self.done.copy_(done)
        self.tokens[:, step].copy_(token)
        self.logps[:, step].copy_(logp)
        return self.done


class Buckets(OrderedDict[tuple[int, int], StaticBuffers]):
    """A sampler's buckets by (rows, positions), the least recently used first: at most
    `limit` of them (each holds a KV cache: the module's docstring says how much)."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"max_buckets={limit}: a sampler needs at least one bucket")
        super().__init__()
        self.limit = limit

    def serving(
        self, rows: int, length: int, allocate: Callable[[int, int], StaticBuffers]
    ) -> StaticBuffers:
        """The smallest kept bucket of at least `rows` rows and `length` positions (no
        allocation, and no compilation), else a new one of just that shape, allocated after the
        least recently used beyond the bound are freed (the peak, too, is `limit` buckets)."""
        fitting = [(r * n, (r, n)) for r, n in self if r >= rows and n >= length]
        if fitting:
            shape = min(fitting)[1]
        else:
            while len(self) >= self.limit:
                self.popitem(last=False)
            shape = rows, length
            self[shape] = allocate(rows, length)
        self.move_to_end(shape)
        return self[shape]


def compiles_whole(model: PreTrainedModel) -> bool:
    """Whether Hugging Face declares this model's forward compilable as one graph (a quantized
    model is left to the loop: bitsandbytes' layers inside a compiled decode step are untested
    here)."""
    model = unwrapped(model)
    return bool(getattr(model, "_can_compile_fullgraph", False)) and not is_quantized(model)


class StaticSampler:
    """Generation at fixed shapes into a static KV cache, without a host synchronisation per
    token (see the module's docstring). One per model: it keeps its buckets, and with `compile`
    its compiled step, for every later generation."""

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        compile: bool,
        compile_options: dict[str, Any] | None = None,
        check_every: int = 8,
        max_buckets: int = 2,
    ) -> None:
        """`compile_options`: for `torch.compile` (default: "reduce-overhead", i.e. CUDA graphs,
        on CUDA; inductor's default elsewhere). `check_every`: steps between two reads of whether
        every row is done (each read waits for the device; the steps run past the last EOS are
        fewer than this). `max_buckets`: how many buckets' buffers are kept (the memory bound)."""
        self.model = model
        self.check_every = check_every
        self.cache_key = cache_keyword(model)
        self.buckets = Buckets(max_buckets)
        self.next_tokens = self._next_tokens
        if compile:
            if compile_options is None:
                device = next(model.parameters()).device
                compile_options = {"mode": "reduce-overhead"} if device.type == "cuda" else {}
            self.next_tokens = torch.compile(self._next_tokens, fullgraph=compiles_whole(model),
                                             dynamic=False, **compile_options)  # fmt: skip

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
        """One response per prompt (repeat a prompt in `prompts` to get several)."""
        with evaluating(self.model):
            b, draw = self._start(prompts, eos_id, pad_id, max_new_tokens, temperature, greedy,
                                  generator)  # fmt: skip
            step = partial(self.decode_step, b, draw, eos_id, pad_id)
            with torch._dynamo.config.patch(cache_size_limit=RECOMPILE_LIMIT):
                steps = decode_loop(step, b.done, max_new_tokens, self.check_every)
        n = len(prompts)
        return to_generation(b.tokens[:n, :steps], b.logps[:n, :steps], eos_id, max_new_tokens)

    def _start(
        self,
        prompts: list[list[int]],
        eos_id: int,
        pad_id: int,
        max_new_tokens: int,
        temperature: float,
        greedy: bool,
        generator: torch.Generator | None,
    ) -> tuple[StaticBuffers, Callable[[], Any]]:
        """The prefill (the dynamic cache: its shape changes with every batch of prompts, it is
        not compiled) loaded into a bucket, and the first token drawn from its logits. Returns
        the bucket and the draw of a step's uniform numbers. The prefill is freed on return."""
        p = prefill(self.model, prompts, pad_id)
        rows, length = bucket(len(prompts), p.width + max_new_tokens)
        allocate = partial(StaticBuffers.allocate, p, config=self.model.config)
        b = self.buckets.serving(rows, length, allocate)
        index = b.load(p, len(prompts), temperature, greedy)
        # Numbers for this generation's rows only, as the loop draws them: a seeded generator
        # draws the same samples whichever bucket serves it, and on either path (the rows past
        # them run as padding, whatever their numbers).
        uniform = b.uniform[: len(prompts)]
        draw = (lambda: None) if greedy else partial(uniform.uniform_, generator=generator)
        draw()
        b.record(0, *pick_tokens(p.logits[index], b.uniform, b.greedy, b.done, b.temperature,
                                 eos_id, pad_id))  # fmt: skip
        return b, draw

    def decode_step(
        self, b: StaticBuffers, draw: Callable[[], Any], eos_id: int, pad_id: int, step: int
    ) -> torch.Tensor:
        """One token for every row of the bucket: the step's uniform numbers, then the
        (compiled) model step; returns the rows' done flags."""
        draw()
        done = b.record(step, *self.next_tokens(b.cache, b.token, b.position, b.mask, b.uniform,
                                                b.greedy, b.done, b.temperature, eos_id,
                                                pad_id))  # fmt: skip
        b.position.add_(1)
        return done

    def _next_tokens(
        self,
        cache: Any,
        token: torch.Tensor,
        position: torch.Tensor,
        mask: torch.Tensor,
        uniform: torch.Tensor,
        greedy: torch.Tensor,
        done: torch.Tensor,
        temperature: torch.Tensor,
        eos_id: int,
        pad_id: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Feed each row's last token, pick its next one: what is compiled, every shape fixed by
        the bucket."""
        logits, _ = next_logits(self.model, self.cache_key, cache, token, position, mask)
        return pick_tokens(logits, uniform, greedy, done, temperature, eos_id, pad_id)
