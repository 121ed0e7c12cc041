"""Where the parts of a run go: the one module deciding placement.

- This process's devices: the trainer's (`trainer_device`, `policy.device`), the in-process
  searcher's (`searcher_device`, `searchers.device`), and whether that searcher samples with the
  trainer's own module (`shares_trainer_model`: same device, compared as devices).
- What each searcher process reserves from Ray: `searcher_gpus`, whose `searchers.num_gpus=auto`
  rule is `searcher_gpu_share` of the GPUs the trainer leaves (`trainer_gpus`): whole GPUs
  first, shares of them when the searchers outnumber them, a share of the trainer's own GPU
  on a one-GPU machine (docs/cluster.md, "GPUs of one machine"). A Ray searcher gets the device
  *settings* (its own and the reward models') and resolves them in its process, where Ray
  numbers the GPUs it reserved from 0; so do reward models, which load where they score.
- Which GPUs a local Ray instance gets (`local_ray_gpus`): all but the trainer's, where the
  trainer trains in this process on one of several.
- Before anything starts, that this machine has every device the run asks for, and that the
  searchers and trainer ranks fit on the local Ray instance's GPUs (`check_devices`).

The normalisation of a device setting into a `torch.device` (`cuda` is `cuda:<current index>`,
`auto` is CUDA when present, else the CPU) is `tba.policy.model.resolve_device`, one layer down
so that the processes loading models (reward models, Ray actors) share it; the static checks of
device strings against the GPUs a searcher sees are the configuration's
(`tba.config.check_searcher_devices`).
"""

from __future__ import annotations

import math
import os

import torch

from tba.config import RunConfig, check_searcher_devices
from tba.errors import ConfigError
from tba.policy.model import check_device, resolve_device
from tba.trainer import WeightVersions


def trainer_device(config: RunConfig) -> torch.device:
    """The device of a trainer in this process (`policy.device`)."""
    return resolve_device(config.policy.device)


def searcher_device(config: RunConfig) -> torch.device:
    """The device of the searcher in this process (`searchers.count=0`)."""
    return resolve_device(config.searchers.device)


def same_device(a: str | torch.device, b: str | torch.device) -> bool:
    """Whether two devices (settings or `torch.device`s) are one: `cuda` and `cuda:0` are, on a
    process whose current GPU is the first."""
    return resolve_device(a) == resolve_device(b)


def shares_trainer_model(config: RunConfig, trainer: WeightVersions) -> bool:
    """Whether the in-process searcher can sample with the trainer's own module: the trainer is
    in this process, on the searcher's device, and every generation comes right after a publish
    (`train.sync_every=1`), so that the module then holds exactly the published version."""
    if not trainer.trains_here or config.train.sync_every != 1:
        return False
    return same_device(searcher_device(config), next(trainer.model.parameters()).device)


def trainer_gpus(config: RunConfig) -> int:
    """The GPUs of this machine that the trainer holds, which `searchers.num_gpus=auto` leaves
    to it: its ranks' (`trainer.world_size` × `trainer.num_gpus`, rounded up; Ray reserves them),
    or, with one rank, this process's `policy.device` where that is a GPU (kept out of a local
    Ray instance, `local_ray_gpus`). With ranks, this process's own copy of the policy (on
    `policy.device`, for evaluation) is not counted: it shares a GPU."""
    tc = config.trainer
    if tc.world_size > 1:
        return math.ceil(tc.world_size * tc.num_gpus)
    return int(trainer_device(config).type == "cuda")


def searcher_gpu_share(searchers: int, free: int, engine: int = 1) -> float:
    """The GPUs each of `searchers` processes reserves under `searchers.num_gpus=auto`, where
    the trainer leaves `free` whole GPUs of this machine and each searcher's engine spans
    `engine` (`searchers.engine`'s `gpus()`):

    - searchers × engine <= free: `engine` whole GPUs each (1 for an engine that uses one device,
      as the builtin sampler does; more would sit idle), the GPUs left over stay free;
    - more searchers than free GPUs: 1 / k of a GPU each, k = ceil(searchers / free) on each
      GPU (not free / searchers, which Ray could not pack without splitting a searcher across
      two GPUs), rounded down to Ray's resolution (1e-4) so that k fit in one;
    - no free GPU (one GPU, the trainer's): 1 / (searchers + 1) of it each, beside the trainer.

    ValueError where an engine spans several GPUs and they are not there: a vLLM engine with
    tensor parallelism needs whole GPUs."""
    if engine > 1 and searchers * engine > free:
        raise ValueError(f"{searchers} searcher(s) whose engines span {engine} GPUs each need "
                         f"{searchers * engine} whole GPUs, and the trainer leaves "
                         f"{max(free, 0)} of this machine's")  # fmt: skip
    if free <= 0:
        return 1.0 / (searchers + 1)
    if searchers <= free:
        return float(engine)
    return math.floor(1e4 / math.ceil(searchers / free)) / 1e4


def searcher_gpus(config: RunConfig) -> tuple[float, str]:
    """`searchers.num_gpus` as a number, and how `auto` chose it: where a local Ray instance
    has a GPU to give, `searcher_gpu_share` of the GPUs the trainer leaves (`trainer_gpus`);
    none without searcher processes, on a cluster (`ray.address`: its GPUs are not this
    machine's to count, and are counted only once Ray has started, after the device checks),
    with `searchers.device=cpu` or on a machine without CUDA. ConfigError where `auto` finds no
    way: an engine that spans several GPUs (a vLLM engine's tensor parallelism) without the
    whole GPUs for it, or trainer ranks that reserve every GPU."""
    sc = config.searchers
    if sc.num_gpus != "auto":
        return sc.num_gpus, ""
    if sc.count == 0:
        return 0.0, "no searcher processes"
    if config.ray.address is not None:
        return 0.0, "a cluster's GPUs (ray.address) are yours to set"
    if sc.device == "cpu":
        return 0.0, "searchers.device=cpu"
    if not torch.cuda.is_available():
        return 0.0, "this machine has no CUDA device"
    gpus, held, tc = torch.cuda.device_count(), trainer_gpus(config), config.trainer
    free = max(gpus - held, 0)
    engine = sc.engine.gpus()
    if tc.world_size > 1 and free == 0 and engine == 1:
        left = gpus - tc.world_size * tc.num_gpus  # of the one GPU, beside fractional ranks
        if gpus == 1 and left > 0:
            share = math.floor(1e4 * left / sc.count) / 1e4  # to Ray's 1e-4, rounded down
            return share, "what the trainer's ranks leave of the GPU"
        raise ConfigError(
            f"searchers.num_gpus=auto: the trainer's {tc.world_size} ranks reserve this "
            f"machine's {gpus} GPU(s) (trainer.num_gpus={tc.num_gpus:g}); set "
            "searchers.num_gpus (0, with searchers.device=cpu: the searchers on the CPU), or "
            "give the ranks fewer GPUs"
        )  # fmt: skip
    try:
        share = searcher_gpu_share(sc.count, free, engine)
    except ValueError as error:
        spans = sc.engine.gpus_named()  # key=value
        raise ConfigError(f"searchers.num_gpus=auto: {error} ({spans}); set searchers.count, "
                          f"{spans.partition('=')[0]} or trainer.world_size to fit") from None
    if free == 0:
        return share, "a share of the trainer's GPU"
    if share >= 1:
        return share, f"{share:g} of the {free} GPU(s) the trainer leaves, each"
    return share, f"the {free} GPU(s) the trainer leaves, shared"


def local_ray_gpus(config: RunConfig) -> tuple[int, str] | None:
    """The GPUs a local Ray instance gets, as (their number, `CUDA_VISIBLE_DEVICES` for Ray),
    where the trainer trains in this process on one of several GPUs: all the others, so that
    Ray places no searcher on the trainer's (Ray numbers the GPUs it sees from 0 and would
    otherwise hand out the trainer's first). None: Ray takes every GPU it sees (no GPU or only
    one, trainer ranks, a trainer on the CPU, or a cluster, `ray.address`)."""
    if config.ray.address is not None or config.trainer.world_size > 1:
        return None
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device = trainer_device(config)
    if gpus < 2 or device.type != "cuda":
        return None
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")  # this process's numbering of them
    ids = [gpu.strip() for gpu in listed.split(",")][:gpus] if listed else None
    ids = ids or [str(index) for index in range(gpus)]
    others = [gpu for index, gpu in enumerate(ids) if index != device.index]
    return len(others), ",".join(others)


def ray_gpus_needed(config: RunConfig) -> int:
    """The fewest whole GPUs of a local Ray instance that the searcher processes and trainer
    ranks fit on, each one's share of a GPU on one GPU (a bound checked before anything starts,
    not Ray's placement): whole GPUs apart, equal shares k to a GPU."""
    sc, tc = config.searchers, config.trainer
    asks = [(sc.count, searcher_gpus(config)[0] if sc.count else 0.0)]
    if tc.world_size > 1:
        asks.append((tc.world_size, tc.num_gpus))
    whole, bins, shared = 0, 0, 0.0
    for count, gpus in asks:
        if gpus >= 1:
            whole += count * math.ceil(gpus)
        elif gpus > 0:
            bins = max(bins, math.ceil(count / math.floor(1 / gpus + 1e-9)))
            shared += count * gpus
    return whole + max(bins, math.ceil(shared - 1e-9))


def searcher_devices_given(config: RunConfig) -> float:
    """The GPUs each searcher process reserves (`searcher_gpus`); ConfigError in one line where
    their devices (their own, the reward models') need a GPU that this does not give them."""
    gpus, why = searcher_gpus(config)
    try:
        auto = f" (`auto` gave 0: {why})" if gpus == 0 and why else ""
        check_searcher_devices(config, gpus, auto)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    return gpus


def check_devices(config: RunConfig) -> None:
    """Every device setting of a run that this machine must have, checked before anything
    starts: the trainer's and the reward models', and the searchers' where they run here (in
    this process, or in a local Ray instance, which has this machine's GPUs to give)."""
    check_device(config.policy.device, "policy.device")
    check_device(config.task.reward_device, "task.reward_device")
    reserved = 0.0  # by each searcher process
    if config.searchers.count == 0:  # in this process
        check_device(config.searchers.device, "searchers.device")
    else:
        reserved = searcher_devices_given(config)
    ranked = config.trainer.world_size > 1  # the trainer's ranks are Ray actors too
    asked = {"searchers.num_gpus": reserved,
             "trainer.num_gpus": config.trainer.num_gpus if ranked else 0.0}  # fmt: skip
    local_gpus = [key for key, gpus in asked.items() if gpus > 0 and config.ray.address is None]
    if local_gpus and torch.cuda.device_count() == 0:
        raise ConfigError(f"{local_gpus[0]} > 0, but this machine has no CUDA device for its "
                          f"local Ray instance to give; set {local_gpus[0]}=0, or ray.address "
                          "to a cluster with GPUs")  # fmt: skip
    if local_gpus:
        _check_ray_fits(config, reserved)


def _check_ray_fits(config: RunConfig, reserved: float) -> None:
    """The searchers and trainer ranks fit on the GPUs of the local Ray instance
    (`local_ray_gpus`): one line now, not a run waiting `ray.start_timeout_s` for Ray."""
    kept = local_ray_gpus(config)
    has = kept[0] if kept else torch.cuda.device_count()
    needed = ray_gpus_needed(config)
    if needed <= has:
        return
    sc, tc = config.searchers, config.trainer
    asks = [f"searchers.count={sc.count} × searchers.num_gpus={reserved:g}"] if sc.count else []
    if tc.world_size > 1:
        asks.append(f"trainer.world_size={tc.world_size} × trainer.num_gpus={tc.num_gpus:g}")
    where = "this machine's"
    if kept:
        where = (f"this machine's {torch.cuda.device_count()} less the trainer's "
                 f"{trainer_device(config)}, kept out of Ray")  # fmt: skip
    raise ConfigError(f"{' and '.join(asks)} need {needed} GPU(s) of the local Ray instance, "
                      f"which has {has} ({where}); ask for fewer, or train on the CPU "
                      "(policy.device=cpu)")  # fmt: skip
