"""Passing a KV cache into a model and reading it back, across transformers versions.

transformers 5.24 renamed the forward argument and output field `past_key_values` to `cache`
(the old name still works until 5.40, with a deprecation warning on every run). Models that have
not moved (older releases, remote code) only know the old name, so the name is read from the
model's own forward signature.

The static path of sampling (`tba.policy.static_sampling`) decodes into Hugging Face's
`StaticCache`: preallocated keys and values that a compiled decode step writes in place. The
prompts' prefill still runs with the default dynamic cache (one row per distinct prompt), and is
then copied into the static one, one row per sample.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from transformers import Cache, PreTrainedModel, StaticCache


def cache_keyword(model: PreTrainedModel) -> str:
    """The name this model's forward takes its KV cache by (read once per call site, not per
    token: `inspect.signature` is not free)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"


def returned_cache(output: Any) -> Any:
    """The KV cache a forward pass with `use_cache=True` returned."""
    cache = getattr(output, "cache", None)
    return cache if cache is not None else output.past_key_values


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
