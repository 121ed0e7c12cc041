"""What this machine's CPU multiplies natively, and the policy's dtype chosen by it
(`policy.dtype=auto`); how many cores a run has, and the training mode chosen by them and the
model's size (`train.mode=auto`, `resolve_mode`: see there).

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
import os
import struct
from collections.abc import Mapping
from pathlib import Path

import torch

NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")  # as /proc/cpuinfo names them
BF16_MIN_PARAMETERS = 50_000_000
CPUINFO = Path("/proc/cpuinfo")
# `train.mode=auto` (`resolve_mode`). On 2 cores SmolLM2-135M-Instruct (134.5M parameters) learned
# faster synchronously, the searcher in the trainer's process and each phase on both cores, than
# with one searcher process on one core and the trainer on the other (a training-reward target in
# 2.5 minutes against 6.5, and a better held-out reward after 8 minutes: docs/asynchrony.md): the
# matrix products of a model that large want every core in each phase. The embedded policies
# (about 1M parameters) learn faster asynchronously on 2 cores (docs/results/math.md): their
# steps are short enough that generating beside them pays. From 4 cores the searcher and the
# trainer each have two cores of their own, so asynchrony is kept there (the measurements above
# are of 2 cores).
SYNC_MIN_PARAMETERS = 50_000_000
ASYNC_MIN_CPUS = 4


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


def usable_cpus(ray_num_cpus: int | None = None) -> int:
    """The CPU cores a run may use: `ray.num_cpus` where it is set, else those this process may
    run on (its affinity, which a container or `taskset` limits; every core where the OS does
    not say)."""
    if ray_num_cpus is not None:
        return ray_num_cpus
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def resolve_mode(
    setting: str, searchers: int, searchers_set: bool, devices: Mapping[str, torch.device | str],
    policy_dir: str | Path, cpus: int, *, elsewhere: str | None = None,
    async_only: str | None = None,
) -> tuple[str, int, str | None]:  # fmt: skip
    """`train.mode` as `async` or `sync`, the searcher processes it runs with (`searchers.count`),
    and the one line that says why (None where the mode was set: the run's start says it).
    `auto` is `sync` where the run computes on the CPU alone, the model has
    `SYNC_MIN_PARAMETERS` or more and the run fewer than `ASYNC_MIN_CPUS` cores, else `async`;
    synchronous, a `searchers.count` not set (`searchers_set` false) becomes 0: the searcher in
    the trainer's process, as measured. An explicit `searchers.count=0` is `sync`.

    `searchers`: `searchers.count`; `devices`: each device setting of the run resolved, by its
    key (`policy.device`, `searchers.device`, ...); `policy_dir`: the policy's local path;
    `cpus`: the cores the run may use (`usable_cpus`); `elsewhere`: a setting that takes the run
    beyond one trainer process on this machine's cores (`ray.address=...`,
    `trainer.world_size=2`), which keeps it asynchronous; `async_only`: a setting that has an
    effect only asynchronously (the synchronous mode would refuse it), which does too."""
    if setting != "auto":
        return setting, searchers, None
    if searchers == 0:
        return "sync", 0, ("train.mode=auto: sync (searchers.count=0: the searcher runs in the "
                           "trainer's process, between its steps)")  # fmt: skip
    count = parameter_count(policy_dir)
    why = _why_async(devices, elsewhere, async_only, count, policy_dir, cpus)
    if why is not None:
        return "async", searchers, f"train.mode=auto: async ({why})"
    size = f"{count / 1e6:.1f}M parameters"
    cores = f"{cpus} CPU {'core' if cpus == 1 else 'cores'}"
    when = (f"asynchrony pays from {ASYNC_MIN_CPUS} cores, on a GPU or under "
            f"{SYNC_MIN_PARAMETERS / 1e6:.0f}M parameters")  # fmt: skip
    if searchers_set:
        return "sync", searchers, (f"train.mode=auto: sync (the model has {size} and the run "
                                   f"{cores}: generation, by the searchers.count={searchers} "
                                   f"searcher processes as set, and training take turns; "
                                   f"{when})")  # fmt: skip
    return "sync", 0, (f"train.mode=auto: sync, searchers.count=0 (the model has {size} and the "
                       f"run {cores}: one process generates and trains, each phase with every "
                       f"core; {when})")  # fmt: skip


def _why_async(
    devices: Mapping[str, torch.device | str], elsewhere: str | None, async_only: str | None,
    count: int | None, policy_dir: str | Path, cpus: int,
) -> str | None:  # fmt: skip
    """Why `train.mode=auto` is `async` for this run (`resolve_mode`'s arguments, `count`: the
    model's parameters), or None where it is `sync`."""
    gpu = next(((key, device) for key, device in devices.items()
                if torch.device(device).type != "cpu"), None)  # fmt: skip
    if gpu is not None:
        return f"{gpu[0]} is {gpu[1]}: off the CPU, generating beside training pays"
    if elsewhere is not None:
        return (f"{elsewhere}: auto chooses sync only for one trainer process on this machine's "
                "cores")  # fmt: skip
    if async_only is not None:
        return f"{async_only} has an effect only asynchronously"
    if count is None:
        return f"the model's size cannot be read: no safetensors weights in {policy_dir}"
    if count < SYNC_MIN_PARAMETERS:
        return (f"the model has {count / 1e6:.1f}M parameters, fewer than "
                f"{SYNC_MIN_PARAMETERS / 1e6:.0f}M: its steps are short enough that generating "
                "beside them pays")  # fmt: skip
    if cpus >= ASYNC_MIN_CPUS:
        return (f"{cpus} CPU cores: from {ASYNC_MIN_CPUS}, the searchers and the trainer each "
                "have cores of their own")  # fmt: skip
    return None
