"""PPO's critic as a model: `tba.objectives.ppo.ValueHead` (V(s_t), a linear head on a causal
LM's last hidden state, started at zero) on the LM it reads.

The head is PPO's and lives with its loss; this adapter is the model plumbing the objectives'
layer cannot import: which LM's hidden states the head reads, and that LM's weights. The LM is
the policy itself (the default: the value loss then also trains the policy's layers, as TRL's
value head does) or a separate critic, a trainable copy of the starting policy with its own fp32
master weights. The trainer's provider of `Needs.critic` (`tba.needs.CriticValues`) builds one
and trains it with the policy.

A head on the policy reads the hidden states of the policy's own forward pass (the one its
log-probs come from): no second pass. A separate critic runs its own, hidden states only.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import PreTrainedModel

from tba.objectives.ppo import ValueHead
from tba.policy.logprobs import response_hidden
from tba.policy.model import disable_dropout, frozen_copy
from tba.policy.precision import MasterWeights


class Critic:
    """The value head (and, when `separate`, the LM it reads): `values` of a batch, the
    optimizer's parameter groups, and what a checkpoint keeps."""

    def __init__(
        self, policy: PreTrainedModel, *, separate: bool, head_lr: float, trunk_lr: float
    ) -> None:
        device = next(policy.parameters()).device
        self.head = ValueHead(policy.get_input_embeddings().embedding_dim, device=device)
        self.groups: list[dict[str, Any]] = [{"params": list(self.head.parameters()),
                                              "lr": head_lr}]  # fmt: skip
        self.trunk = policy
        self.trunk_is_policy = not separate
        self.masters: MasterWeights | None = None
        if separate:
            self.trunk = frozen_copy(policy).train().requires_grad_(True)
            disable_dropout(self.trunk)
            self.masters = MasterWeights(list(self.trunk.parameters()))
            self.groups.insert(0, {"params": self.masters.params, "lr": trunk_lr})

    def values(
        self,
        prompts: list[list[int]],
        responses: list[list[int]],
        *,
        pad_id: int,
        policy_states: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """V(s_t) for every response token t (N, T), right-padded with zeros, fp32,
        differentiable in the head and the LM. `policy_states`: the policy's last hidden states
        at those positions (N, T, H), from its own forward pass, for a head on the policy."""
        hidden = policy_states if self.trunk_is_policy else None
        if hidden is None:
            hidden, _, _ = response_hidden(self.trunk, prompts, responses, pad_id=pad_id,
                                           share_prompts=False)  # fmt: skip
        return self.head(hidden, torch.tensor([len(r) for r in responses], device=hidden.device))

    def parameters(self) -> list[torch.nn.Parameter]:
        """What the optimizer updates (and the clip bounds): head, and a separate LM's weights."""
        return [p for group in self.groups for p in group["params"]]

    def grads_to_masters(self) -> None:
        if self.masters is not None:
            self.masters.grads_to_masters()

    def masters_to_model(self) -> None:
        if self.masters is not None:
            self.masters.masters_to_model()

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The head's weights, and a separate LM's with its fp32 masters of 16-bit weights."""
        tensors = {f"head.{name}": value for name, value in self.head.state_dict().items()}
        if self.masters is not None:
            for name, value in self.trunk.state_dict().items():
                tensors[f"trunk.{name}"] = value
            pairs = zip(self.masters.params, self.masters.model_params)
            for index, (master, param) in enumerate(pairs):
                if master is not param:
                    tensors[f"master.{index}"] = master.detach()
        return tensors

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        parts: dict[str, dict[str, torch.Tensor]] = {"head": {}, "trunk": {}, "master": {}}
        for key, value in tensors.items():
            part, name = key.split(".", 1)
            parts[part][name] = value
        self.head.load_state_dict(parts["head"])
        if self.masters is not None:
            self.trunk.load_state_dict(parts["trunk"])
            for index, value in parts["master"].items():
                self.masters.params[int(index)].data.copy_(value)

