"""What this machine's CPU multiplies natively, and the policy's dtype chosen by it
(`policy.dtype=auto`).

bf16 pays on a CPU only where it has bf16 matrix instructions (AVX512-BF16, or AMX's tiles):
there a bf16 matrix product runs at up to twice (AVX512-BF16) or many times (AMX) the fp32 rate,
and the weights stream from memory at half the bytes. Without them PyTorch converts bf16 to fp32
and back around every product: on an AVX2-only CPU SmolLM2-135M generated 2.5x slower in bf16
than in fp32 (docs/results/smollm2.md). So `auto` is bf16 where the CPU has those instructions
and the model is large enough for its matrix products to decide the speed (`BF16_MIN_PARAMETERS`),
else fp32:

- the embedded tiny policies (0.8M parameters) stay in fp32: their steps are made of small
  products and per-operation overhead, where bf16 has little to win, and their results (the
  default job's, the tests') were all measured in fp32;
- a model whose size cannot be read (no safetensors weights: a GGUF file, `.bin` weights) stays
  in fp32, as before `auto`;
- on a GPU `auto` is fp32 too, as before: this rule is about CPUs.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")  # as /proc/cpuinfo names them
BF16_MIN_PARAMETERS = 50_000_000
CPUINFO = Path("/proc/cpuinfo")


def cpu_flags(cpuinfo: Path = CPUINFO) -> set[str]:
    """The instruction-set flags of the first CPU in `cpuinfo` (Linux's /proc/cpuinfo); none
    where it cannot be read (another OS)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return set(value.split())
    return set()


def cpu_name(cpuinfo: Path = CPUINFO) -> str:
    """The CPU's model name from `cpuinfo`, or `unknown`."""
    try:
        lines = cpuinfo.read_text().splitlines()
    except OSError:
        return "unknown"
    names = (value.strip() for key, _, value in (line.partition(":") for line in lines)
             if key.strip() == "model name")  # fmt: skip
    return next(names, "unknown")


def native_bf16(flags: set[str]) -> list[str]:
    """The bf16 matrix instructions among `flags` (empty: bf16 runs emulated)."""
    return [flag for flag in NATIVE_BF16_FLAGS if flag in flags]


def parameter_count(policy_dir: str | Path) -> int | None:
    """The number of weights in a model directory's safetensors files, read from their headers
    (no tensor is loaded); None where there are none (a GGUF file, `.bin` weights, not a
    directory)."""
    path = Path(policy_dir)
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
    if not files:
        return None
    return sum(_safetensors_numel(file) for file in files)


def _safetensors_numel(file: Path) -> int:
    """The elements of every tensor a safetensors file holds: its header is an 8-byte
    little-endian length, then that many bytes of JSON giving each tensor's shape."""
    with file.open("rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(length))
    total = 0
    for name, entry in header.items():
        if name != "__metadata__":
            total += int(torch.Size(entry["shape"]).numel())
    return total


def resolve_dtype(
    setting: str, device: torch.device | str, policy_dir: str | Path,
    flags: set[str] | None = None,
) -> tuple[str, str]:  # fmt: skip
    """`policy.dtype` as a dtype name, and the one line that says why (for the run's log).
    `setting`: `auto`, `float32` or `bfloat16`; `device`: the trainer's, resolved (`cpu`,
    `cuda:0`, ...); `policy_dir`: the policy's local path (`tba.tasks.resolve_policy`); `flags`:
    the CPU's (default: this machine's)."""
    flags = cpu_flags() if flags is None else flags
    native = native_bf16(flags)
    if setting != "auto":
        emulated = setting == "bfloat16" and torch.device(device).type == "cpu" and not native
        warning = ("; this CPU has no bf16 matrix instructions (avx512_bf16, amx_bf16): bf16 "
                   "runs emulated, slower than float32") if emulated else ""  # fmt: skip
        return setting, f"policy.dtype={setting} (as set{warning})"
    if torch.device(device).type != "cpu":
        return "float32", f"policy.dtype=auto: float32 (on {device}: auto decides by CPUs only)"
    if not native:
        return "float32", ("policy.dtype=auto: float32 (this CPU has no bf16 matrix instructions, "
                           "avx512_bf16 or amx_bf16: bf16 would run emulated)")  # fmt: skip
    count = parameter_count(policy_dir)
    if count is None:
        return "float32", (f"policy.dtype=auto: float32 (the model's size cannot be read: no "
                           f"safetensors weights in {policy_dir})")  # fmt: skip
    size = f"{count / 1e6:.1f}M parameters"
    if count < BF16_MIN_PARAMETERS:
        return "float32", (f"policy.dtype=auto: float32 (the model has {size}, fewer than "
                           f"{BF16_MIN_PARAMETERS / 1e6:.0f}M: bf16 does not pay)")  # fmt: skip
    return "bfloat16", (f"policy.dtype=auto: bfloat16 (this CPU multiplies bf16 natively: "
                        f"{', '.join(native)}; the model has {size})")  # fmt: skip
