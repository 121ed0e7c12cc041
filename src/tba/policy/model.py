"""Building, loading and moving policy weights.

The built-in policy is an ordinary Hugging Face `LlamaForCausalLM`, only tiny, so that every
code path it takes (forward, KV cache, `save_pretrained`, `from_pretrained`) is a real model's.
"""

from __future__ import annotations

import numpy as np
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, PreTrainedModel


def resolve_device(device: str) -> torch.device:
    """`auto` picks CUDA when present, else the CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def build_tiny_llama(
    vocab_size: int,
    *,
    pad_token_id: int,
    bos_token_id: int,
    eos_token_id: int,
    hidden_size: int = 128,
    num_layers: int = 4,
    num_heads: int = 4,
    max_positions: int = 256,
    seed: int = 0,
) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=4 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=max_positions,
        pad_token_id=pad_token_id,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def load_model(path: str, device: torch.device) -> PreTrainedModel:
    """Load a causal LM saved with `save_pretrained` (or any Hugging Face model id), in fp32."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.to(device)


def frozen_copy(model: PreTrainedModel) -> PreTrainedModel:
    """An independent copy in eval mode with gradients off (the reference policy)."""
    copy = type(model)(model.config).to(next(model.parameters()).device)
    copy.load_state_dict(model.state_dict())
    copy.eval().requires_grad_(False)
    return copy


def get_weights(model: torch.nn.Module) -> dict[str, np.ndarray]:
    """A snapshot of the weights as numpy arrays (the format that crosses process boundaries
    without copies); copied, so that later training steps do not change a published version."""
    return {name: t.detach().cpu().numpy().copy() for name, t in model.state_dict().items()}


def set_weights(model: torch.nn.Module, weights: dict[str, np.ndarray]) -> None:
    state = {name: torch.from_numpy(np.asarray(array)) for name, array in weights.items()}
    model.load_state_dict(state)
