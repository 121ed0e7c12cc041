"""Shared fixtures: the character tokenizer and a tiny, randomly initialised Llama policy."""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

from tba.policy.model import build_tiny_llama  # noqa: E402
from tba.policy.tokenizer import build_char_tokenizer  # noqa: E402

# The test machine is shared with running experiments: stay on one core.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tokenizer():
    return build_char_tokenizer()


@pytest.fixture
def tiny_model(tokenizer):
    """A fresh tiny policy per test (tests may change its weights), on the CPU, in eval mode."""
    model = build_tiny_llama(
        len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        hidden_size=32,
        num_layers=2,
        num_heads=2,
        seed=0,
    )
    return model.to("cpu").eval()


@pytest.fixture
def policy_dir(tmp_path, tiny_model, tokenizer) -> Path:
    """The tiny policy and its tokenizer saved as a directory `from_pretrained` reads."""
    path = tmp_path / "policy"
    tiny_model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
