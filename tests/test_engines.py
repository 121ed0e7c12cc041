"""The engine interface without vLLM: the built-in engine is the sampler it wraps, seeded and
resumable; the registry of engines and their settings, `searchers.engine`, a section of several
kinds (the vLLM engine's settings its own, what an engine spans and loads said by its settings
class); a run asking for vLLM where it is not installed stops in one line naming the extra.
An engine registered from this file carries an asynchronous run (slow). (tests/test_vllm.py runs
against a real vLLM.)"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Literal

import pytest
import torch

from tba.config import (
    ENGINE_SETTINGS,
    BuiltinEngineSettings,
    ConfigError,
    EngineSettings,
    VllmEngineSettings,
    dump_config,
    load_config,
)
from tba.policy.engines import ENGINES, BuiltinEngine, Engine, VllmEngine, register_engine
from tba.policy.engines.vllm import _runs, engine_dtype
from tba.policy.sampling import generate
from tba.run_dir import read_metrics

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
    [(["policy.dtype=float32"], "float32"), (["policy.dtype=bfloat16"], "bfloat16"),
     (["policy.dtype=bfloat16", "searchers.engine.dtype=float16"], "float16")],
)  # fmt: skip
def test_the_vllm_engines_settings_are_its_section_of_the_config(overrides, dtype):
    config = load_config(None, ["searchers.engine=vllm", "searchers.engine.kv_cache_gb=0.5",
                                "searchers.engine.tensor_parallel_size=2", *overrides])  # fmt: skip
    settings = config.searchers.engine
    assert isinstance(settings, VllmEngineSettings)
    assert engine_dtype(settings, config.policy.dtype) == dtype  # `auto`: the policy's
    assert settings.kv_cache_gb == 0.5 and settings.gpus() == 2
    assert not settings.quantized_base  # it loads full weights of its own
    assert load_config(None, ["searchers.engine.type=vllm"]).searchers.engine == (
        VllmEngineSettings()
    )


def test_every_engine_is_registered_with_its_settings():
    assert {"builtin": BuiltinEngine, "vllm": VllmEngine} == ENGINES
    assert {"builtin": BuiltinEngineSettings, "vllm": VllmEngineSettings} == ENGINE_SETTINGS
    builtin = load_config(None, []).searchers.engine
    assert builtin == BuiltinEngineSettings() and builtin.gpus() == 1 and builtin.quantized_base


def test_an_engines_section_dumps_and_loads_again(tmp_path):
    config = load_config(None, ["searchers.engine=vllm", "searchers.engine.enforce_eager=true"])
    path = tmp_path / "config.yaml"
    path.write_text(dump_config(config))
    assert load_config(path) == config


@pytest.mark.parametrize(
    ("overrides", "message"),
    [(["searchers.engine=sglang"], "invalid value for searchers.engine.type: unknown engine "
                                   "'sglang'; known: builtin, vllm"),
     (["searchers.engine.gpu_memory_utilization=0.5"],
      "invalid value for searchers.engine.gpu_memory_utilization: not a setting of the "
      "'builtin' engine (its settings: type)"),
     (["searchers.engine=vllm", "searchers.engine.gpu_memory_utilization=2"],
      "invalid value for searchers.engine.gpu_memory_utilization: Input should be less than or "
      "equal to 1 (got 2)"),
     (["searchers.count=1", "searchers.engine=vllm", "searchers.engine.tensor_parallel_size=2",
       "searchers.num_gpus=1"],
      "searchers.engine.tensor_parallel_size=2 needs searchers.num_gpus >= 2"),
     (["quantization.bits=4", "lora.r=8", "searchers.engine=vllm"],
      "the searchers' vllm engine takes full weights")],
)  # fmt: skip
def test_a_bad_engine_setting_is_one_line_naming_it(overrides, message):
    with pytest.raises(ConfigError) as caught:
        load_config(None, overrides)
    assert message in str(caught.value) and "\n" not in str(caught.value)


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


# ------------------------------------------------------------------ an engine added from outside

TINY = ["train.num_prompts=2", "train.group_size=2", "policy.max_new_tokens=4",
        "task.num_train=16", "task.num_eval=4", "task.num_eval_pass_k=2", "eval.pass_k=2",
        "eval.every=1000", "train.max_minutes=null", "searchers.num_cpus=1",
        "policy.num_threads=1", "checkpoint.every_minutes=null"]  # fmt: skip


def recording_engine() -> tuple[type[Engine], type[EngineSettings]]:
    """An engine that samples with the built-in one and writes each batch of responses it
    generates to a file of its process in `directory` (its one setting); defined in a function
    so that Ray sends it by value to the searchers."""

    class RecordingSettings(EngineSettings):
        type: Literal["recording"] = "recording"
        directory: str = ""

    class RecordingEngine(Engine):
        name = "recording"

        def __init__(self, inner: Engine, tokenizer, log: Path) -> None:
            self.inner, self.tokenizer, self.log = inner, tokenizer, log

        @classmethod
        def start(cls, model, tokenizer, *, seed, model_dir, policy, settings) -> Engine:
            inner = BuiltinEngine.start(model, tokenizer, seed=seed, model_dir=model_dir,
                                        policy=policy, settings=settings)  # fmt: skip
            return cls(inner, tokenizer, Path(settings.directory) / f"{os.getpid()}.jsonl")

        def generate(self, prompts, *, max_new_tokens, temperature):
            out = self.inner.generate(prompts, max_new_tokens=max_new_tokens,
                                      temperature=temperature)  # fmt: skip
            texts = self.tokenizer.batch_decode(out.response_ids, skip_special_tokens=True)
            with self.log.open("a") as file:
                file.write(json.dumps([text.strip() for text in texts]) + "\n")
            return out

        def load_weights(self, model) -> None:
            self.inner.load_weights(model)

    return RecordingEngine, RecordingSettings


@pytest.mark.slow
def test_an_engine_registered_from_outside_generates_an_asynchronous_runs_samples(
    tmp_path, policy_dir
):
    """Registered from this file, with no change to any module of tba: the run's searcher
    process starts it with its own settings, and every sample the run trained on came from it."""
    from tba.run import train

    engine, settings = recording_engine()
    register_engine(engine, settings)
    calls = tmp_path / "calls"
    calls.mkdir()
    try:
        config = load_config(None, [
            *TINY, "searchers.count=1", "train.max_steps=4", f"policy.model={policy_dir}",
            "task.name=math", f"output_dir={tmp_path / 'run'}", "log_completions=true",
            "searchers.engine.type=recording", f"searchers.engine.directory={calls}",
        ])  # fmt: skip
        run_dir = train(config)
    finally:
        ENGINES.pop("recording")
        ENGINE_SETTINGS.pop("recording")
    [log] = list(calls.iterdir())  # one searcher process, not this one
    assert int(log.stem) != os.getpid()
    recorded = {text for line in log.read_text().splitlines() for text in json.loads(line)}
    lines = (run_dir / "completions.jsonl").read_text().splitlines()
    completions = [json.loads(line)["completion"] for line in lines]
    assert completions and set(completions) <= recorded
    steps = [r for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]
    assert len(steps) == 4
