"""Real model shapes without a download: Qwen2.5's public configurations, built with random
weights. What the memory and GPU benchmarks measure a real size with."""

from __future__ import annotations

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

# From each model's published config.json (Qwen/Qwen2.5-*): the fields that set its size.
QWEN25 = {
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                         tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                         tie_word_embeddings=True),
    "qwen2.5-3b": dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                       num_attention_heads=16, num_key_value_heads=2, vocab_size=151936,
                       tie_word_embeddings=True),
    "qwen2.5-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                       tie_word_embeddings=False),
}  # fmt: skip

# The same vocabulary at a width and depth a 2-core CPU steps through in seconds: the logits
# are most of such a model's memory.
NARROW = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
              num_key_value_heads=1, vocab_size=151936, tie_word_embeddings=True)  # fmt: skip


def qwen_config(
    name: str, *, pad_token_id: int = 0, eos_token_id: int = 1, **changes
) -> Qwen2Config:
    """The configuration `name` (a key of QWEN25, or "narrow"), with `changes`."""
    fields = NARROW if name == "narrow" else QWEN25[name]
    return Qwen2Config(**(fields | changes), rope_theta=1e6, rms_norm_eps=1e-6,
                       max_position_embeddings=32768, pad_token_id=pad_token_id,
                       bos_token_id=eos_token_id, eos_token_id=eos_token_id)  # fmt: skip


def random_qwen(
    config: Qwen2Config, device: torch.device | str, dtype: torch.dtype, seed: int = 0
) -> Qwen2ForCausalLM:
    """A model of `config` with random weights, made on `device` in `dtype` (a 7B model is made
    on the GPU in seconds, on a CPU in minutes)."""
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return Qwen2ForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(previous)


def parameters(config: Qwen2Config) -> int:
    """The parameter count of a model of `config`, without making it."""
    with torch.device("meta"):
        return sum(p.numel() for p in Qwen2ForCausalLM(config).parameters())
