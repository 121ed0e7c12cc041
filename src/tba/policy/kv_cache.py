"""Passing a KV cache into a model and reading it back, across transformers versions.

transformers 5.24 renamed the forward argument and output field `past_key_values` to `cache`
(the old name still works until 5.40, with a deprecation warning on every run). Models that have
not moved (older releases, remote code) only know the old name, so the name is read from the
model's own forward signature.

Both paths of sampling prefill the prompts with the default dynamic cache (one row per distinct
prompt), then copy it, one row per sample, into a cache allocated once for the whole generation:

- the loop (`tba.policy.sampling`) into a `PreallocatedLayer` per layer: keys and values for the
  prompt and every new token, each written in place, and attention given a view of the positions
  filled so far (the dynamic cache instead concatenates each layer's keys and values with every
  token: a copy of the whole cache per token, 12-19% of a CPU decode step with SmolLM2);
- the static path (`tba.policy.static_sampling`) into Hugging Face's `StaticCache`, of fixed
  shape: what a compiled decode step writes in place, attending over all of its positions.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from transformers import Cache, PreTrainedModel, StaticCache
from transformers.cache_utils import DynamicLayer


def cache_keyword(model: PreTrainedModel) -> str:
    """The name this model's forward takes its KV cache by (read once per call site, not per
    token: `inspect.signature` is not free)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"


def returned_cache(output: Any) -> Any:
    """The KV cache a forward pass with `use_cache=True` returned."""
    cache = getattr(output, "cache", None)
    return cache if cache is not None else output.past_key_values


def logits_keyword(model: PreTrainedModel) -> str | None:
    """The forward argument that limits the logits to the last positions (`logits_to_keep`;
    `num_logits_to_keep` before transformers 4.50), or None where the model has neither."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT
    parameters = inspect.signature(base.forward).parameters
    return next((k for k in ("logits_to_keep", "num_logits_to_keep") if k in parameters), None)


class PreallocatedLayer(DynamicLayer):
    """One layer's keys and values in buffers allocated once for every position a generation
    will hold: `update` writes a token's keys and values in place, and `keys`/`values` are views
    of the positions filled so far, so that attention and Hugging Face's masks see exactly what a
    dynamic layer would hold, without its `torch.cat` (a copy of the layer's cache) per token."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, filled: int) -> None:
        """`keys`, `values`: (rows, heads, capacity, head size), their first `filled` positions
        already written."""
        super().__init__()
        self.key_buffer, self.value_buffer = keys, values
        self.device = keys.device
        self.is_initialized = True
        self._fill(filled)

    def _fill(self, filled: int) -> None:
        self.keys = self.key_buffer[:, :, :filled]
        self.values = self.value_buffer[:, :, :filled]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        start = self.keys.size(-2)
        end = start + key_states.size(-2)
        if end > self.key_buffer.size(-2):
            raise ValueError(f"a preallocated KV cache of {self.key_buffer.size(-2)} positions "
                             f"cannot hold {end}")  # fmt: skip
        self.key_buffer[:, :, start:end].copy_(key_states)
        self.value_buffer[:, :, start:end].copy_(value_states)
        self._fill(end)
        return self.keys, self.values

    def get_max_length(self) -> int:
        return self.key_buffer.size(-2)

    def reset(self) -> None:
        self._fill(0)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._reindex(lambda buffer: buffer[indices])

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._reindex(lambda buffer: buffer.index_select(0, beam_idx.to(buffer.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._reindex(lambda buffer: buffer.repeat_interleave(repeats, dim=0))

    def _reindex(self, rows: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """New buffers of the rows `rows` picks (Hugging Face's row selections, done on the
        buffers rather than on the views, so that later tokens are written where they are read)."""
        filled = self.keys.size(-2)
        self.key_buffer, self.value_buffer = rows(self.key_buffer), rows(self.value_buffer)
        self._fill(filled)


def preallocated_cache(prefix: Cache, rows: torch.Tensor, capacity: int) -> Cache | None:
    """A cache of `PreallocatedLayer`s of `capacity` positions, row i holding the prefill cache
    `prefix`'s row `rows[i]` (one row per distinct prompt: the samples of a prompt copy its keys
    and values). None where a layer of `prefix` is not a plain dynamic layer (sliding-window,
    linear-attention or shared layers keep other state): the caller then keeps the dynamic
    cache."""
    if not prefix.layers or any(type(layer) is not DynamicLayer or not layer.is_initialized
                                for layer in prefix.layers):  # fmt: skip
        return None
    layers = []
    for source in prefix.layers:
        keys, values = source.keys, source.values
        filled = keys.size(-2)
        key_buffer = keys.new_empty((len(rows), keys.size(1), capacity, keys.size(3)))
        value_buffer = values.new_empty((len(rows), values.size(1), capacity, values.size(3)))
        key_buffer[:, :, :filled] = keys[rows]
        value_buffer[:, :, :filled] = values[rows]
        layers.append(PreallocatedLayer(key_buffer, value_buffer, filled))
    return Cache(layers=layers)


def supports_static_cache(model: PreTrainedModel) -> bool:
    """Whether every layer of this model keeps a plain static cache in Hugging Face's
    `StaticCache` (full attention; sliding-window and linear-attention layers keep other kinds,
    which `load_prefix` does not fill), with its write position in a tensor (transformers 5.x;
    earlier releases take it from a `cache_position` argument instead)."""
    try:
        layers = StaticCache(config=model.config, max_cache_len=1).layers
    except (ValueError, TypeError, AttributeError, KeyError):
        return False
    return all(
        type(layer).__name__ == "StaticLayer" and hasattr(layer, "cumulative_length")
        for layer in layers
    )


def static_cache_like(prefix: Cache, batch_size: int, max_len: int, config: Any) -> StaticCache:
    """A `StaticCache` of `batch_size` rows and `max_len` positions, allocated now with the heads,
    head size, dtype and device of the prefill cache `prefix` (so nothing is read from configs
    that name these differently per architecture). Its tensors keep their addresses for good:
    what a compiled decode step and CUDA graphs need."""
    cache = StaticCache(config=config, max_cache_len=max_len)
    for layer, source in zip(cache.layers, prefix.layers, strict=True):
        keys, values = source.keys, source.values
        layer.lazy_initialization(
            keys.new_empty((batch_size, keys.size(1), 0, keys.size(3))),
            values.new_empty((batch_size, values.size(1), 0, values.size(3))),
        )
    return cache


def load_prefix(cache: StaticCache, prefix: Cache, rows: torch.Tensor) -> None:
    """Copy the prefill cache `prefix` (one row per distinct prompt, all of one padded length)
    into the first `len(rows)` rows of `cache`, row i taking prompt `rows[i]`, and set the cache's
    write position after the prompt. Whatever an earlier generation left beyond it is masked by
    causality until overwritten."""
    for layer, source in zip(cache.layers, prefix.layers, strict=True):
        length = source.keys.size(2)
        layer.keys[: len(rows), :, :length].copy_(source.keys[rows])
        layer.values[: len(rows), :, :length].copy_(source.values[rows])
        layer.cumulative_length.fill_(length)
