"""Devices compared as devices, and where the parts of a run go (`tba.runtime.placement`), on
faked CUDA machines: torch is told it has GPUs, no GPU is touched."""

from __future__ import annotations

import math
import os
from types import SimpleNamespace

import pytest
import torch

from tba.config import load_config
from tba.errors import ConfigError
from tba.policy.model import resolve_device
from tba.runtime.placement import (
    check_devices,
    local_ray_gpus,
    ray_gpus_needed,
    same_device,
    searcher_gpu_share,
    searcher_gpus,
    shares_trainer_model,
    trainer_gpus,
)
from tba.trainer import Trainer

SHARED = ["train.mode=sync", "searchers.count=0", "policy.device=cuda", "searchers.device=cuda"]


def fake_cuda(monkeypatch, gpus: int, current: int | None = 0) -> None:
    """A machine with `gpus` CUDA devices; `current`: this process's GPU once CUDA has started
    (None: CUDA has not started, and asking would start it)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: current is not None)

    def current_device() -> int:
        assert current is not None, "naming a device must not start CUDA"
        return current

    monkeypatch.setattr(torch.cuda, "current_device", current_device)


def on_device(device: str) -> Trainer:
    """A trainer in this process whose parameters sit on `device` (only its module is read)."""
    trainer = object.__new__(Trainer)
    parameter = SimpleNamespace(device=torch.device(device))
    trainer.model = SimpleNamespace(parameters=lambda: iter([parameter]))
    return trainer


@pytest.mark.parametrize("current", [0, None])
def test_cuda_is_the_current_gpu_with_its_index(monkeypatch, current):
    fake_cuda(monkeypatch, gpus=2, current=current)
    assert torch.device("cuda") != torch.device("cuda:0")  # why torch's own comparison fails
    assert resolve_device("cuda") == resolve_device("cuda:0") == torch.device("cuda", 0)
    assert resolve_device(torch.device("cuda")) == torch.device("cuda", 0)
    assert same_device("cuda", torch.device("cuda:0"))
    assert not same_device("cuda:1", "cuda:0")
    assert not same_device("cuda", "cpu")


def test_cuda_follows_the_gpu_this_process_has_chosen(monkeypatch):
    fake_cuda(monkeypatch, gpus=2, current=1)
    assert resolve_device("cuda") == torch.device("cuda", 1)
    assert same_device("cuda", "cuda:1")
    assert not same_device("cuda", "cuda:0")


def test_auto_resolves_as_before(monkeypatch):
    fake_cuda(monkeypatch, gpus=1)
    assert resolve_device("auto") == torch.device("cuda", 0)
    fake_cuda(monkeypatch, gpus=0, current=None)
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")  # a CPU tensor's device has no index
    assert resolve_device("mps") == torch.device("mps", 0)  # as an MPS tensor's device says
    assert resolve_device("cuda:1") == torch.device("cuda", 1)


def test_the_searcher_shares_the_trainers_module_on_cuda(monkeypatch):
    """`searchers.device=cuda` with the trainer's parameters on `cuda:0`: one module, not a
    second copy synced through numpy."""
    fake_cuda(monkeypatch, gpus=2)
    config = load_config(None, SHARED)
    assert shares_trainer_model(config, on_device("cuda:0"))
    assert not shares_trainer_model(config, on_device("cuda:1"))
    assert not shares_trainer_model(config, on_device("cpu"))
    assert shares_trainer_model(load_config(None, [*SHARED, "searchers.device=auto"]),
                                on_device("cuda:0"))  # fmt: skip
    assert not shares_trainer_model(load_config(None, [*SHARED, "train.sync_every=2"]),
                                    on_device("cuda:0"))  # fmt: skip


def test_devices_this_machine_has_are_checked_by_index(monkeypatch):
    fake_cuda(monkeypatch, gpus=2)
    check_devices(load_config(None, ["policy.device=cuda:1", "task.reward_device=cuda"]))
    fake_cuda(monkeypatch, gpus=1)
    with pytest.raises(ConfigError, match=r"policy.device=cuda:1: this machine has 1 CUDA "
                       r"device\(s\), cuda:0"):  # fmt: skip
        check_devices(load_config(None, ["policy.device=cuda:1"]))


# The layouts of docs/cluster.md ("GPUs of one machine"), searchers.num_gpus=auto, the trainer in
# this process on cuda:0: (GPUs, searchers) -> each searcher's reservation.
LAYOUTS = {
    (1, 1): 1 / 2, (1, 2): 1 / 3, (1, 3): 1 / 4, (1, 7): 1 / 8,  # beside the trainer
    (2, 1): 1.0, (2, 2): 0.5, (2, 3): 0.3333, (2, 7): 0.1428,  # the other GPU, shared
    (4, 1): 1.0, (4, 2): 1.0, (4, 3): 1.0, (4, 7): 0.3333,  # 7 on 3 GPUs: 3, 3 and 1
    (8, 1): 1.0, (8, 2): 1.0, (8, 3): 1.0, (8, 7): 1.0,
}  # fmt: skip


@pytest.mark.parametrize(("gpus", "count"), sorted(LAYOUTS))
def test_searchers_take_the_gpus_the_trainer_leaves(monkeypatch, gpus, count):
    """Whole GPUs other than the trainer's first, one a searcher; more searchers than those
    GPUs share them, k = ceil(count / free) to a GPU; on one GPU, 1 / (count + 1) of it beside
    the trainer. Each searcher sees what it reserves as `cuda:0` upwards."""
    fake_cuda(monkeypatch, gpus=gpus, current=None)
    config = load_config(None, [f"searchers.count={count}", "searchers.device=cuda"])
    share, why = searcher_gpus(config)
    assert share == pytest.approx(LAYOUTS[gpus, count])
    assert share == searcher_gpu_share(count, gpus - trainer_gpus(config))
    assert trainer_gpus(config) == 1
    if gpus == 1:
        assert why == "a share of the trainer's GPU"
        assert local_ray_gpus(config) is None  # Ray has the one GPU, the trainer beside them
        assert (count + 1) * share == pytest.approx(1.0)
    else:
        # The local Ray instance gets every GPU but the trainer's, and the searchers fit there.
        assert local_ray_gpus(config) == (gpus - 1, ",".join(str(i) for i in range(1, gpus)))
        per_gpu = round(1 / share) if share < 1 else 1
        assert share * per_gpu <= 1.0  # Ray's resolution: k shares fit in one GPU
        assert ray_gpus_needed(config) == -(-count // per_gpu) <= gpus - 1
        assert why.startswith(("1 of the", "the ")) and f"{gpus - 1} GPU(s)" in why
    check_devices(config)
    # In its process, a searcher's `cuda` (and `auto`) is the first GPU Ray gave it.
    fake_cuda(monkeypatch, gpus=math.ceil(share), current=None)
    assert resolve_device("cuda") == resolve_device("auto") == torch.device("cuda", 0)
    fake_cuda(monkeypatch, gpus=gpus, current=None)
    with pytest.raises(ConfigError, match="a searcher sees only the GPUs it reserves"):
        check_devices(load_config(None, [f"searchers.count={count}", "searchers.device=cuda:1"]))


@pytest.mark.parametrize(("gpus", "count", "expected", "needed"), [
    (4, 1, 1.0, 3), (4, 2, 1.0, 4), (4, 3, 0.5, 4), (8, 3, 1.0, 5), (8, 7, 0.5, 6),
])  # fmt: skip
def test_trainer_ranks_keep_their_gpus(monkeypatch, gpus, count, expected, needed):
    """`trainer.world_size=2`, a GPU each: the searchers take the others; Ray places ranks and
    searchers alike, on every GPU (none is kept out of it)."""
    fake_cuda(monkeypatch, gpus=gpus, current=None)
    config = load_config(None, [f"searchers.count={count}", "trainer.world_size=2",
                                "trainer.num_gpus=1"])  # fmt: skip
    assert trainer_gpus(config) == 2
    assert searcher_gpus(config)[0] == pytest.approx(expected)
    assert local_ray_gpus(config) is None
    assert ray_gpus_needed(config) == needed <= gpus
    check_devices(config)


def test_trainer_ranks_that_take_every_gpu_leave_the_searchers_a_line(monkeypatch):
    fake_cuda(monkeypatch, gpus=2, current=None)
    ranks = ["trainer.world_size=2", "trainer.num_gpus=1"]
    with pytest.raises(ConfigError, match=r"the trainer's 2 ranks reserve this machine's 2 GPU"):
        searcher_gpus(load_config(None, ranks))
    assert searcher_gpus(load_config(None, [*ranks, "searchers.num_gpus=0",
                                            "searchers.device=cpu"]))[0] == 0  # fmt: skip
    fake_cuda(monkeypatch, gpus=1, current=None)  # ranks of a quarter GPU: the rest is shared
    config = load_config(None, ["trainer.world_size=2", "trainer.num_gpus=0.25",
                                "searchers.count=2"])  # fmt: skip
    assert searcher_gpus(config)[0] == pytest.approx(0.25)
    assert ray_gpus_needed(config) == 1
    check_devices(config)


@pytest.mark.parametrize(("gpus", "count", "fits"), [(8, 3, True), (4, 1, True), (4, 2, False),
                                                     (2, 1, False)])  # fmt: skip
def test_a_vllm_searcher_reserves_its_tensor_parallel_gpus(monkeypatch, gpus, count, fits):
    """`searchers.engine.tensor_parallel_size=2`: two whole GPUs each, never a share."""
    fake_cuda(monkeypatch, gpus=gpus, current=None)
    settings = [f"searchers.count={count}", "searchers.engine=vllm",
                "searchers.engine.tensor_parallel_size=2", "searchers.device=cuda:1"]  # fmt: skip
    config = load_config(None, settings)  # cuda:1: the engine's second GPU, which it sees
    assert config.searchers.engine.gpus() == 2
    if fits:
        assert searcher_gpus(config) == (2.0, f"2 of the {gpus - 1} GPU(s) the trainer leaves, "
                                              "each")  # fmt: skip
        assert ray_gpus_needed(config) == 2 * count
        check_devices(config)
    else:
        with pytest.raises(ConfigError, match=rf"{count} searcher\(s\) whose engines span 2 GPUs "
                           rf"each need {2 * count} whole GPUs, and the trainer leaves "
                           rf"{gpus - 1} of this machine's \(searchers.engine.tensor_parallel_"
                           rf"size=2\); set searchers.count, searchers.engine.tensor_parallel_"
                           rf"size or trainer.world_size"):  # fmt: skip
            check_devices(config)
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=2 needs searchers.num_gpus >= 2"):
        load_config(None, [*settings, "searchers.num_gpus=1"])
    with pytest.raises(ConfigError, match="a searcher sees only the GPUs it reserves"):
        load_config(None, [*settings[:-1], "searchers.device=cuda:2"])


def test_explicit_settings_win(monkeypatch):
    """A number in `searchers.num_gpus` is what each searcher reserves; the trainer's GPU stays
    out of the local Ray instance all the same, and what does not fit there is one line."""
    fake_cuda(monkeypatch, gpus=8, current=None)
    config = load_config(None, ["searchers.count=4", "searchers.num_gpus=0.5"])
    assert searcher_gpus(config) == (0.5, "")
    assert ray_gpus_needed(config) == 2
    check_devices(config)
    fake_cuda(monkeypatch, gpus=4, current=None)
    # The paper's layout: the trainer on the last GPU, the searchers on the three others.
    paper = ["searchers.count=3", "searchers.num_gpus=1", "policy.device=cuda:3"]
    assert local_ray_gpus(load_config(None, paper)) == (3, "0,1,2")
    check_devices(load_config(None, paper))
    too_many = load_config(None, ["searchers.count=4", "searchers.num_gpus=1"])
    with pytest.raises(ConfigError, match=r"searchers.count=4 × searchers.num_gpus=1 need 4 "
                       r"GPU\(s\) of the local Ray instance, which has 3 \(this machine's 4 "
                       r"less the trainer's cuda:0, kept out of Ray\)"):  # fmt: skip
        check_devices(too_many)
    # A trainer on the CPU leaves Ray every GPU, and `auto` gives the searchers all of them.
    on_cpu = load_config(None, ["searchers.count=4", "searchers.num_gpus=1", "policy.device=cpu"])
    assert local_ray_gpus(on_cpu) is None and trainer_gpus(on_cpu) == 0
    check_devices(on_cpu)
    assert searcher_gpus(load_config(None, ["searchers.count=4", "policy.device=cpu"]))[0] == 1
    # A cluster's GPUs are not counted here; no searcher processes, no GPUs.
    assert searcher_gpus(load_config(None, ["ray.address=auto"]))[0] == 0
    assert searcher_gpus(load_config(None, ["searchers.count=0", "train.mode=sync"]))[0] == 0
    assert local_ray_gpus(load_config(None, ["ray.address=auto"])) is None


def test_the_trainers_gpu_is_left_out_in_this_processs_numbering(monkeypatch):
    fake_cuda(monkeypatch, gpus=4, current=None)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert local_ray_gpus(load_config(None, ["policy.device=cuda:2"])) == (3, "4,5,7")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-a, GPU-b")
    fake_cuda(monkeypatch, gpus=2, current=None)
    assert local_ray_gpus(load_config(None, [])) == (1, "GPU-b")


def test_the_local_ray_instance_is_asked_for_the_gpus_placement_gives(monkeypatch):
    """What `ray.init` is asked for (Ray is not started: its `init` is replaced), and the
    `CUDA_VISIBLE_DEVICES` its processes inherit, this process's own restored after."""
    import ray

    from tba.runtime import ray_cluster

    for name in ("RAY_USAGE_STATS_ENABLED", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER",
                 "RAY_worker_niceness", "RAY_ADDRESS"):  # fmt: skip
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    fake_cuda(monkeypatch, gpus=4, current=None)
    asked = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **options: asked.append(
        (options, os.environ["CUDA_VISIBLE_DEVICES"])))  # fmt: skip
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    monkeypatch.setattr(ray_cluster, "_reap_when_gone", lambda ray: None)
    config = load_config(None, ["searchers.count=3"])
    with ray_cluster.ray_session(config, gpus=local_ray_gpus(config)):
        pass
    (options, visible), = asked
    assert options["num_gpus"] == 3 and visible == "1,2,3"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"
    asked.clear()
    with ray_cluster.ray_session(config, gpus=None):  # every GPU, as Ray counts them
        pass
    assert "num_gpus" not in asked[0][0] and asked[0][1] == "0,1,2,3"
