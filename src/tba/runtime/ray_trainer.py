"""The trainer as `trainer.world_size` processes (ranks) that shard the policy with FSDP2
(`tba.runtime.fsdp`), placed by Ray: `RankedTrainer` is what the run's loop steps, with the
interface of the one-process `Trainer`.

Why Ray and not `torchrun`: the searchers already run as Ray actors, so the ranks are placed by
the same scheduler, on this machine or across the nodes of a cluster, with the same config and
no launcher to run per node. The N ranks form one placement group (one bundle of
`trainer.num_cpus` CPUs and `trainer.num_gpus` GPUs each, packed onto as few nodes as fit), and
one `torch.distributed` process group: NCCL between ranks with a GPU, gloo between CPU ranks.
Rank 0 names the address the others meet at.

Per step the loop's batch is split into N contiguous shares of whole groups; each rank steps on
its share and the gradients are summed across ranks (`ShardedTrainer.step_share`). At a publish
the ranks gather the full weights once, onto rank 0, which returns them to this process: the
searchers' copy, and this process's own copy of the policy, which evaluation, snapshots and the
final save read (the ranks' shards never leave them otherwise).

A rank that dies or does not answer within `ray.sync_timeout_s` ends the run with one line
naming it; every rank is then stopped (no process is left behind), and the newest checkpoint,
written before the failure, is intact.
"""

from __future__ import annotations

import datetime
import os
import socket
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from transformers import PreTrainedModel

from tba.config import RunConfig
from tba.core import EventLogger, Sample
from tba.errors import TrainingError, first_line
from tba.policy.model import load_policy, resolve_device, set_weights
from tba.quiet import quiet_libraries
from tba.runtime.fsdp import ShardedTrainer, split_batch
from tba.runtime.ray_actor import normal_priority
from tba.trainer import WeightVersions, trainer_settings

DTYPES = {"float32": None, "bfloat16": torch.bfloat16}
DEATH_GRACE_S = 5.0  # after a rank fails: how long the others have to report theirs


class TrainerRank:
    """One rank, in its own process (a Ray actor)."""

    def __init__(self, rank: int, world_size: int, num_threads: int) -> None:
        torch.set_num_threads(num_threads)
        normal_priority()
        quiet_libraries()
        self.rank, self.world_size = rank, world_size
        self.trainer: ShardedTrainer | None = None

    def address(self) -> tuple[str, int]:
        """Where the process group meets (asked of rank 0): this node's address, a free port."""
        import ray  # a Ray actor's process: Ray is there, and was imported by Ray itself

        with socket.socket() as probe:
            probe.bind(("", 0))
            port = probe.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def start(
        self, host: str, port: int, policy_dir: str, settings: dict[str, Any], dtype: str,
        gradient_checkpointing: bool | str, timeout_s: float,
    ) -> dict[str, Any]:  # fmt: skip
        """Join the process group and load this rank's shards of the policy."""
        cuda = torch.cuda.is_available()  # Ray shows a rank only the GPUs it reserved
        dist.init_process_group(
            "nccl" if cuda else "gloo", init_method=f"tcp://{host}:{port}", rank=self.rank,
            world_size=self.world_size, timeout=datetime.timedelta(seconds=timeout_s),
        )  # fmt: skip
        device = torch.device("cuda", 0) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(device)
        model = load_policy(policy_dir, device, dtype="float32",
                            gradient_checkpointing=gradient_checkpointing)  # fmt: skip
        self.trainer = ShardedTrainer(model, param_dtype=DTYPES[dtype], **settings)
        return {"pid": os.getpid(), "device": str(device), "host": socket.gethostname()}

    def step(self, groups: list[list[Sample]], beta: float, total: int,
             num_micro_batches: int) -> dict[str, float]:  # fmt: skip
        return self._trainer.step_share(groups, beta, total=total,
                                        num_micro_batches=num_micro_batches)  # fmt: skip

    def weights(self) -> dict[str, np.ndarray]:
        return self._trainer.weights()

    def save(self, directory: str) -> dict[str, Any]:
        return self._trainer.save_shards(directory)

    def load(self, directory: str, state: dict[str, Any]) -> None:
        self._trainer.load_shards(directory, state)

    @property
    def _trainer(self) -> ShardedTrainer:
        if self.trainer is None:
            raise RuntimeError("the rank has not started")
        return self.trainer


class RankedTrainer(WeightVersions):
    """`trainer.world_size` ranks behind the one-process trainer's interface: `step`, `publish`
    and `weights`, `model`, `state_dict` (for a checkpoint: the ranks write their shards) and
    `load_state_dict`. Needs a Ray session (`ray_cluster.ray_session`); `close` stops the
    ranks."""

    def __init__(self, config: RunConfig, policy_dir: Path, pad_id: int,
                 log_event: EventLogger, total_steps: int | None) -> None:  # fmt: skip
        import ray  # a run with several ranks runs Ray, started by `ray_session` before this
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        super().__init__()
        self._ray = ray
        tc = config.trainer
        self.world_size = tc.world_size
        self.micro_batch_groups = config.train.micro_batch_groups
        self.timeout = config.ray.sync_timeout_s
        self.ranks: list[Any] = []
        bundle = {"CPU": tc.num_cpus} | ({"GPU": tc.num_gpus} if tc.num_gpus else {})
        self.group = ray.util.placement_group([bundle] * self.world_size, strategy="PACK")
        start = time.time()
        if not ray.wait([self.group.ready()], timeout=config.ray.start_timeout_s)[0]:
            self.close()
            raise TrainingError(
                f"Ray cannot place the trainer's {self.world_size} ranks of {bundle} within "
                f"{config.ray.start_timeout_s:g} s (ray.start_timeout_s): fewer CPUs or GPUs "
                "than that are free (`ray status`)"
            )
        actor = ray.remote(TrainerRank)
        threads = tc.num_threads or max(1, round(tc.num_cpus))
        self.ranks = [
            actor.options(
                num_cpus=tc.num_cpus, num_gpus=tc.num_gpus, max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.group, placement_group_bundle_index=rank),
            ).remote(rank, self.world_size, threads)
            for rank in range(self.world_size)
        ]  # fmt: skip
        host, port = self._wait([self.ranks[0].address.remote()], "address",
                                config.ray.start_timeout_s)[0]  # fmt: skip
        settings = trainer_settings(config, pad_id, total_steps)
        started = self._call("start", host, port, str(policy_dir), settings, config.policy.dtype,
                             config.train.gradient_checkpointing, self.timeout,
                             timeout=config.ray.start_timeout_s)  # fmt: skip
        log_event("trainer_ranks_ready", world_size=self.world_size, seconds=time.time() - start,
                  ranks=started)  # fmt: skip
        # This process's copy of the policy: what evaluation, snapshots and the final save read.
        self._model = load_policy(str(policy_dir), resolve_device(config.policy.device),
                                  dtype=config.policy.dtype)  # fmt: skip
        self._model_step = 0

    # --------------------------------------------------------------- the Trainer interface

    def step(
        self, groups: list[list[Sample]], beta: float, context: list[list[Sample]] | None = None
    ) -> dict[str, float]:
        if context:  # every rank must run the same passes: the config keeps them apart
            raise ValueError("train.group_baseline=generation trains on one process")
        shares, num_micro_batches = split_batch(groups, self.world_size, self.micro_batch_groups)
        total = sum(len(group) for group in groups)
        refs = [rank.step.remote(share, beta, total, num_micro_batches)
                for rank, share in zip(self.ranks, shares)]  # fmt: skip
        stats = self._wait(refs, "step", self.timeout)[0]
        self.step_count += 1
        self.skipped_steps += int(stats["skipped"])
        return stats

    trains_here = False  # the ranks train; `model` is this process's copy

    def weights(self) -> dict[str, np.ndarray]:
        """The weights as the ranks hold them now, gathered (this process's copy follows)."""
        weights = self._call("weights")[0]
        self._adopt(weights)
        return weights

    @property
    def model(self) -> PreTrainedModel:
        """The policy as trained so far (gathered from the ranks when it changed)."""
        if self._model_step != self.step_count:
            self._adopt(self._call("weights")[0])
        return self._model

    def state_dict(self) -> dict[str, Any]:
        """The versions, and `save_shards(directory)`: every rank writes its shards of the
        weights and of Adam's state there (`tba.checkpoint` calls it), which returns the rest of
        the trainer's state (the same on every rank)."""
        return {"world_size": self.world_size, **self.versions_state(),
                "save_shards": lambda directory: self._call("save", directory)[0]}  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._call("load", state["shards_dir"], state["shards"])
        self.load_versions_state(state)

    def close(self) -> None:
        """Stop every rank's process, then free their placement."""
        for rank in self.ranks:
            self._ray.kill(rank, no_restart=True)
        self.ranks = []
        self._ray.util.remove_placement_group(self.group)

    # ------------------------------------------------------------------------ internals

    def _adopt(self, weights: dict[str, np.ndarray]) -> None:
        set_weights(self._model, weights)
        self._model_step = self.step_count

    def _call(self, method: str, *args: Any, timeout: float | None = None) -> list[Any]:
        """`method` on every rank (all must call a collective), their answers in rank order."""
        refs = [getattr(rank, method).remote(*args) for rank in self.ranks]
        return self._wait(refs, method, timeout or self.timeout)

    def _wait(self, refs: list[Any], what: str, timeout: float) -> list[Any]:
        """The answers to `refs` (one per rank); a rank that died, failed or did not answer
        within `timeout` stops every rank and ends the run in one line."""
        ray = self._ray
        deadline = time.time() + timeout
        pending, answers, failures = list(refs), {}, {}
        while pending and not failures:
            ready, pending = ray.wait(pending, num_returns=1,
                                      timeout=max(0.0, deadline - time.time()))  # fmt: skip
            if not ready:
                late = ", ".join(str(refs.index(ref)) for ref in pending)
                raise self._failed(f"trainer rank {late} did not finish `{what}` within "
                                   f"{timeout:g} s (ray.sync_timeout_s)")  # fmt: skip
            self._collect(refs, ready, answers, failures)
        if failures:
            # One rank's death fails the others' collectives too: let them report, then name
            # the one that died rather than one that lost its peer.
            ready, _ = ray.wait(pending, num_returns=len(pending), timeout=DEATH_GRACE_S)
            self._collect(refs, ready, answers, failures)
            died = {rank: e for rank, e in failures.items()
                    if isinstance(e, ray.exceptions.RayActorError)}  # fmt: skip
            rank = min(died or failures)
            error = failures[rank]
            if rank in died:
                raise self._failed(f"trainer rank {rank} died during `{what}`: "
                                   f"{first_line(error)}")  # fmt: skip
            raise self._failed(f"trainer rank {rank} failed during `{what}`: "
                               f"{first_line(error.cause)}")  # fmt: skip
        return [answers[rank] for rank in range(len(refs))]

    def _collect(self, refs: list[Any], ready: list[Any], answers: dict, failures: dict) -> None:
        errors = (self._ray.exceptions.RayActorError, self._ray.exceptions.RayTaskError)
        for ref in ready:
            try:
                answers[refs.index(ref)] = self._ray.get(ref)
            except errors as error:
                failures[refs.index(ref)] = error

    def _failed(self, message: str) -> TrainingError:
        self.close()
        return TrainingError(message)

