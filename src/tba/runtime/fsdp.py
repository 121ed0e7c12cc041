"""One rank of a sharded trainer: the policy split across N processes with FSDP2.

Every rank holds 1/N of each weight, of its gradient and of Adam's moments (`fully_shard` on
each decoder layer, then on the whole model for what is left: embeddings, final norm, head). A
layer's weights are gathered whole just for its forward and backward, and each gradient is
averaged across ranks and scattered back in shards. A step:

    rank r gets whole groups (B_r of the batch's B; a group's log Z or baseline needs all of it)
    loss_r = N * sum over r's micro-batches of  loss(micro-batch) * len(micro-batch) / N_batch
    backward -> gradients averaged over the N ranks, so that
        mean_r grad(loss_r) = grad(mean loss over the whole batch)  — the one-process gradient
    clip on the global norm (over every rank's shards), Adam on each rank's shards

(The factor N and FSDP's average rather than a plain sum: gloo has no pre-scaled sum, the
reduction FSDP uses for a sum with another divide factor.)

which is the one-process `Trainer.step` on the same batch, up to the order of floating-point
sums. Every rank must run the same collectives, so every rank runs the same number of
micro-batches: a rank with fewer runs padding ones that count for nothing.

The learned log Z head is small and replicated: each rank keeps a copy (`ReplicatedLogZ`, a sharded
trainer's provider of `Needs.learned_log_z`), its gradients are averaged across ranks, and it
reads the prompt embeddings from the embedding table gathered once a step.

With `param_dtype=torch.bfloat16` (`policy.dtype=bfloat16`), ranks keep fp32 weights and compute
in bf16 (FSDP2's mixed precision), reducing gradients in fp32: the fp32 shards are the master
weights. Checkpoints are `torch.distributed.checkpoint` directories, each rank writing its own
shards: a run resumes on the same or on another number of ranks (the shards are re-cut on load).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from transformers import PreTrainedModel

from tba.core import Sample
from tba.needs import PROVIDERS, LearnedLogZ, Provider
from tba.policy.micro_batches import micro_batch_split
from tba.policy.model import as_numpy
from tba.trainer import Trainer


def shard(model: PreTrainedModel, param_dtype: torch.dtype | None) -> None:
    """FSDP2 over `model`, in place: each decoder layer (the classes the model names as not to
    be split) its own unit, the root holding the rest; gradients averaged across ranks."""
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    layer_classes = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in layer_classes]
    if not layers:
        raise ValueError(f"{type(model).__name__} names no decoder layer class to shard by")
    for layer in layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)


def split_batch(
    groups: list[list[Sample]], world_size: int, micro_batch_groups: int | None
) -> tuple[list[list[list[Sample]]], int]:
    """The batch's `groups` in `world_size` contiguous shares of whole groups, as even as can be
    (the first ones one larger), and the micro-batches every rank runs: the most any share
    needs with `micro_batch_groups` groups in each (None: a share at once)."""
    size, extra = divmod(len(groups), world_size)
    bounds = np.cumsum([0] + [size + (rank < extra) for rank in range(world_size)])
    shares = [groups[bounds[rank] : bounds[rank + 1]] for rank in range(world_size)]
    chunk = micro_batch_groups
    return shares, max(math.ceil(len(share) / (chunk or len(share))) for share in shares)


def held_bytes(trainer: Trainer) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state a trainer holds in this process: its
    shards when sharded, everything otherwise."""

    def local(tensor: torch.Tensor) -> int:
        tensor = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        return tensor.numel() * tensor.element_size()

    params = list(trainer.model.parameters())
    return {
        "parameters": sum(local(p) for p in params),
        "gradients": sum(local(p.grad) for p in params if p.grad is not None),
        "optimizer": sum(local(value) for state in trainer.optimizer.state.values()
                         for value in state.values() if torch.is_tensor(value)),
    }  # fmt: skip


class ReplicatedLogZ(LearnedLogZ):
    """The learned log Z head, one copy per rank: it reads the prompt embeddings from the table
    gathered once a step, its first bias is the mean over every rank's first micro-batch, and its
    gradients are averaged across ranks by hand."""

    def before_micro_batches(self) -> None:
        table = self.embeddings.weight
        table = table.full_tensor() if isinstance(table, DTensor) else table
        self.embed = functools.partial(F.embedding, weight=table.detach())

    def after_micro_batches(self) -> None:
        for param in self.head.parameters():
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            dist.all_reduce(param.grad)
            param.grad /= float(dist.get_world_size())

    def _mean(self, values: torch.Tensor) -> float:
        total = torch.tensor([float(values.sum()), values.numel()], dtype=torch.float64)
        dist.all_reduce(total)
        return float(total[0] / total[1])


class ShardedTrainer(Trainer):
    """`Trainer` on this rank's shards; `step_share` takes this rank's share of a batch. The
    process group must be initialised (`torch.distributed.init_process_group`)."""

    def __init__(
        self, model: PreTrainedModel, *, param_dtype: torch.dtype | None = None, **kwargs: Any
    ) -> None:
        if any(p.dtype != torch.float32 for p in model.parameters()):
            raise ValueError("load the policy in fp32: the shards are the fp32 master weights")
        shard(model, param_dtype)
        self.publish_dtype = param_dtype or torch.float32
        super().__init__(model, **kwargs)
        self.gradient_scale = float(dist.get_world_size())  # FSDP averages: scaled back to a sum

    provider_classes: dict[str, type[Provider]] = {**PROVIDERS, "learned_log_z": ReplicatedLogZ}

    def step_share(
        self, groups: list[list[Sample]], beta: float, *, total: int, num_micro_batches: int
    ) -> dict[str, float]:
        """One optimizer step, with this rank's `groups` (at least one) of a batch of `total`
        samples; every rank runs `num_micro_batches`, the most any rank needs."""
        chunk = self.micro_batch_groups or len(groups)
        own = micro_batch_split(groups, chunk)
        padding = num_micro_batches - len(own)
        return self._step(own + [groups[0]] * padding, beta, total, padding)

    def weights(self) -> dict[str, np.ndarray]:
        """The whole policy, gathered from every rank's shards (a collective: every rank calls
        it), on rank 0 only (the others get {}), in the dtype the policy runs in."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_model_state_dict(self.model, options=options)
        return as_numpy({k: v.to(self.publish_dtype) for k, v in state.items()}) if state else {}

    # ----------------------------------------------------------------------------- checkpoints

    def save_shards(self, directory: str) -> dict[str, Any]:
        """Write this rank's shards of the weights and of Adam's state to `directory` (every
        rank calls it with the same directory); returns what is not a tensor, the same on every
        rank."""
        state = self.state_dict()
        dcp.save({"model": state.pop("model"), "optimizer": state.pop("optimizer")},
                 checkpoint_id=directory)  # fmt: skip
        return state

    def load_shards(self, directory: str, state: dict[str, Any]) -> None:
        """Continue from `save_shards(directory)` and what it returned, written by any number of
        ranks."""
        self._create_optimizer_state()
        target = self.state_dict()  # this rank's tensors, filled in place by the load
        tensors = {"model": target["model"], "optimizer": target["optimizer"]}
        dcp.load(tensors, checkpoint_id=directory)
        self.load_state_dict({**state, **tensors})

    def _create_optimizer_state(self) -> None:
        """Adam creates its moments at its first step; a load needs them to exist to fill them:
        one step with zero gradients and a zero learning rate (the load overwrites it all)."""
        if self.optimizer.state:
            return
        rates = [group["lr"] for group in self.optimizer.param_groups]
        for group in self.optimizer.param_groups:
            group["lr"] = 0.0
            for param in group["params"]:
                param.grad = torch.zeros_like(param)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        for group, rate in zip(self.optimizer.param_groups, rates):
            group["lr"] = rate

    # ------------------------------------------------------------------- the collectives

    def _sum_over_ranks(self, sums: dict[str, float]) -> dict[str, float]:
        keys = sorted(sums)  # the same order on every rank
        values = torch.tensor([sums[key] for key in keys], dtype=torch.float64)
        dist.all_reduce(values)
        return dict(zip(keys, values.tolist()))

    def _clip_grad_norm(self) -> float:
        norm = torch.nn.utils.clip_grad_norm_(self.masters.params, self.max_grad_norm)
        return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)
