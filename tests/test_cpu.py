"""What the CPU multiplies natively (`tba.policy.cpu`), and `policy.dtype=auto`'s choice by it:
bf16 only on a CPU with bf16 matrix instructions and a model large enough, fp32 for the embedded
tiny policies wherever they run."""

from __future__ import annotations

import pytest

from tba.policy import cpu
from tba.policy.cpu import (
    cpu_flags,
    cpu_name,
    native_bf16,
    parameter_count,
    resolve_dtype,
)

AMX = {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}
AVX2 = {"avx", "avx2", "fma"}
CPUINFO = """processor\t: 0
model name\t: Intel(R) Xeon(R) Processor
flags\t\t: fpu sse avx2 avx512f avx512_bf16 amx_bf16 amx_tile

processor\t: 1
model name\t: Intel(R) Xeon(R) Processor
flags\t\t: fpu sse avx2 avx512f avx512_bf16 amx_bf16 amx_tile
"""


def test_the_cpus_name_and_flags_are_read_from_cpuinfo(tmp_path):
    path = tmp_path / "cpuinfo"
    path.write_text(CPUINFO)
    assert cpu_name(path) == "Intel(R) Xeon(R) Processor"
    assert cpu_flags(path) == {"fpu", "sse", "avx2", "avx512f", "avx512_bf16", "amx_bf16",
                               "amx_tile"}  # fmt: skip
    assert native_bf16(cpu_flags(path)) == ["amx_bf16", "avx512_bf16"]
    assert native_bf16(AVX2) == []
    missing = tmp_path / "none"
    assert cpu_flags(missing) == set() and cpu_name(missing) == "unknown"


def test_the_parameter_count_is_read_from_the_safetensors_headers(policy_dir, tiny_model):
    # Tied embeddings are saved once, and counted once, as `parameters()` counts them.
    assert parameter_count(policy_dir) == sum(p.numel() for p in tiny_model.parameters())
    assert parameter_count(policy_dir / "config.json") is None  # not a directory
    assert parameter_count(policy_dir.parent) is None  # no safetensors files


def test_auto_is_float32_for_the_tiny_policy_even_where_bf16_is_native(policy_dir):
    dtype, line = resolve_dtype("auto", "cpu", policy_dir, flags=AMX)
    assert dtype == "float32"
    assert line.startswith("policy.dtype=auto: float32 (the model has 0.") and "50M" in line


def test_auto_is_bfloat16_for_a_large_model_on_a_cpu_with_native_bf16(policy_dir, monkeypatch):
    monkeypatch.setattr(cpu, "BF16_MIN_PARAMETERS", 1000)  # the tiny policy counts as large
    dtype, line = resolve_dtype("auto", "cpu", policy_dir, flags=AMX)
    assert dtype == "bfloat16"
    assert line.startswith("policy.dtype=auto: bfloat16 (this CPU multiplies bf16 natively: "
                           "amx_bf16, avx512_bf16; the model has")  # fmt: skip
    # Not on a CPU without those instructions, nor on a GPU, nor where the size is unknown.
    assert resolve_dtype("auto", "cpu", policy_dir, flags=AVX2)[0] == "float32"
    assert "no bf16 matrix instructions" in resolve_dtype("auto", "cpu", policy_dir, AVX2)[1]
    assert resolve_dtype("auto", "cuda:0", policy_dir, flags=AMX) == (
        "float32", "policy.dtype=auto: float32 (on cuda:0: auto decides by CPUs only)")  # fmt: skip
    dtype, line = resolve_dtype("auto", "cpu", policy_dir.parent, flags=AMX)
    assert dtype == "float32" and "size cannot be read" in line


@pytest.mark.parametrize("setting", ["float32", "bfloat16"])
def test_a_dtype_set_is_kept_and_bf16_without_native_instructions_is_flagged(policy_dir,
                                                                             setting):  # fmt: skip
    assert resolve_dtype(setting, "cpu", policy_dir, flags=AMX) == (
        setting, f"policy.dtype={setting} (as set)")  # fmt: skip
    dtype, line = resolve_dtype(setting, "cpu", policy_dir, flags=AVX2)
    assert dtype == setting
    assert ("emulated, slower than float32" in line) == (setting == "bfloat16")
