"""Device settings: the names a device setting takes, and the CUDA devices a searcher process
can see. Whether this machine has a device is checked as a run starts
(`tba.policy.model.check_devices`)."""

from __future__ import annotations

import math
import re
from typing import Annotated, Any

from pydantic import AfterValidator

DEVICE_PATTERN = re.compile(r"auto|cpu|mps|cuda(:\d+)?")


def _device_name(device: str) -> str:
    """A device torch knows, written as the settings take it; whether this machine has it is
    checked as a run starts (`tba.policy.model.check_devices`)."""
    if not DEVICE_PATTERN.fullmatch(device):
        raise ValueError("a device is auto (CUDA when present), cpu, cuda, cuda:N (the GPU of "
                         "index N) or mps")  # fmt: skip
    return device


Device = Annotated[str, AfterValidator(_device_name)]


def cuda_index(device: str) -> int | None:
    """The GPU index a device setting names (`cuda`: 0), None for anything but CUDA."""
    kind, _, index = device.partition(":")
    return (int(index) if index else 0) if kind == "cuda" else None


def _check_searcher_devices(config: Any) -> None:
    """Ray shows a searcher process only the GPUs it reserves (`searchers.num_gpus`), as
    cuda:0 upwards: a CUDA device it is not given cannot be there, on any machine. `config`: a
    `RunConfig`."""
    sc = config.searchers
    if sc.count == 0:
        return
    # An engine that spans several GPUs (a vLLM engine with tensor parallelism) spans that many
    # whole GPUs of its process.
    engine = sc.engine.gpus()
    if sc.num_gpus != "auto" and engine > 1 and sc.num_gpus < engine:
        raise ValueError(f"{sc.engine.gpus_named()} needs searchers.num_gpus >= {engine} "
                         "(or auto): each searcher's engine spans that many whole GPUs, and it "
                         f"sees only those it reserves (searchers.num_gpus={sc.num_gpus:g})")
    # Where there is a GPU, `auto` gives each searcher whole GPUs (one, or as many as its engine
    # spans) or a share of one (`tba.runtime.placement.searcher_gpus`): cuda:0 at most, or
    # cuda:0 to cuda:<engine GPUs - 1>; where there is none, the run's start says so
    # (`tba.runtime.placement.check_devices`).
    check_searcher_devices(config, engine if sc.num_gpus == "auto" else sc.num_gpus)


def check_searcher_devices(config: Any, num_gpus: float, why: str = "") -> None:
    """ValueError unless the searchers' and reward models' CUDA devices (of `config`, a
    `RunConfig`) are among the `num_gpus` (rounded up) that Ray shows each searcher process;
    `why`: how `auto` came to that number."""
    visible = math.ceil(num_gpus)
    for key, device in (("searchers.device", config.searchers.device),
                        ("task.reward_device", config.task.reward_device)):  # fmt: skip
        index = cuda_index(device)
        if index is None:
            continue
        if visible == 0:
            raise ValueError(f"{key}={device} needs searchers.num_gpus > 0{why}: Ray shows a "
                             "searcher process only the GPUs it reserves (or set "
                             f"{key}=cpu)")  # fmt: skip
        if index >= visible:
            seen = "cuda:0" if visible == 1 else f"cuda:0 to cuda:{visible - 1}"
            raise ValueError(f"{key}={device}: a searcher sees only the GPUs it reserves "
                             f"(searchers.num_gpus={num_gpus:g}), as {seen}")  # fmt: skip
