"""The engine interface without vLLM: the built-in engine is the sampler it wraps, seeded and
resumable; the vLLM engine's settings come from the config; a run asking for vLLM where it is not
installed stops in one line naming the extra. (tests/test_vllm.py runs against a real vLLM.)"""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
import torch

from tba.config import load_config
from tba.policy.engines import BuiltinEngine, _runs
from tba.policy.sampling import generate
from tba.searcher import SearchSettings

PROMPTS = [[5, 6, 7], [5, 6, 7], [8, 9], [5, 6, 7]]


def test_the_builtin_engine_is_the_seeded_sampler(tiny_model, tokenizer):
    engine = BuiltinEngine(tiny_model, tokenizer.eos_token_id, tokenizer.pad_token_id, seed=3)
    out = engine.generate(PROMPTS, max_new_tokens=8, temperature=0.8)
    generator = torch.Generator().manual_seed(3)
    expected = generate(tiny_model, PROMPTS, eos_id=tokenizer.eos_token_id,
                        pad_id=tokenizer.pad_token_id, max_new_tokens=8, temperature=0.8,
                        generator=generator)  # fmt: skip
    assert out.response_ids == expected.response_ids
    assert out.token_logps == expected.token_logps
    assert out.truncated == expected.truncated


def test_the_builtin_engine_resumes_its_random_state(tiny_model, tokenizer):
    engine = BuiltinEngine(tiny_model, tokenizer.eos_token_id, tokenizer.pad_token_id, seed=0)
    engine.generate(PROMPTS, max_new_tokens=4, temperature=1.0)
    state = engine.state_dict()
    after = engine.generate(PROMPTS, max_new_tokens=8, temperature=1.0)
    again = BuiltinEngine(tiny_model, tokenizer.eos_token_id, tokenizer.pad_token_id, seed=99)
    again.load_state_dict(state)
    assert again.generate(PROMPTS, max_new_tokens=8, temperature=1.0).response_ids == (
        after.response_ids
    )


def test_consecutive_copies_of_a_prompt_are_one_request():
    assert _runs(PROMPTS) == [([5, 6, 7], 2), ([8, 9], 1), ([5, 6, 7], 1)]
    assert _runs([]) == []


@pytest.mark.parametrize(
    ("overrides", "dtype"),
    [([], "float32"), (["policy.dtype=bfloat16"], "bfloat16"),
     (["policy.dtype=bfloat16", "searchers.vllm.dtype=float16"], "float16")],
)  # fmt: skip
def test_the_vllm_settings_follow_the_config(overrides, dtype):
    config = load_config(None, ["searchers.engine=vllm", "searchers.vllm.kv_cache_gb=0.5",
                                "searchers.vllm.tensor_parallel_size=2", *overrides])  # fmt: skip
    settings = SearchSettings.from_config(config)
    assert settings.engine == "vllm"
    assert settings.vllm.dtype == dtype  # `auto`: the policy's
    assert settings.vllm.kv_cache_gb == 0.5 and settings.vllm.tensor_parallel_size == 2


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed")
def test_a_missing_vllm_is_one_line_naming_the_extra(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "tba.cli", "train", "searchers.engine=vllm",
         f"policy.model={tmp_path / 'no-such-model'}", f"output_dir={tmp_path / 'run'}"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "tba[vllm]" in lines[0], done.stderr
    assert not (tmp_path / "run").exists()
