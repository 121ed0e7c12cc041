"""Passing a KV cache into a model and reading it back, across transformers versions.

transformers 5.24 renamed the forward argument and output field `past_key_values` to `cache`
(the old name still works until 5.40, with a deprecation warning on every run). Models that have
not moved (older releases, remote code) only know the old name, so the name is read from the
model's own forward signature.
"""

from __future__ import annotations

import inspect
from typing import Any

from transformers import PreTrainedModel


def cache_keyword(model: PreTrainedModel) -> str:
    """The name this model's forward takes its KV cache by (read once per call site, not per
    token: `inspect.signature` is not free)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"


def returned_cache(output: Any) -> Any:
    """The KV cache a forward pass with `use_cache=True` returned."""
    cache = getattr(output, "cache", None)
    return cache if cache is not None else output.past_key_values
