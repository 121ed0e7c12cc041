"""What the trainer provides for an objective's needs (`tba.objectives.Needs`): a provider for
each need the trainer serves. A provider sets up what its need takes (modules, their optimizer
groups), fills its fields of each micro-batch's `LossInputs`, and keeps its state in the
trainer's checkpoints under a key of its own.

    PROVIDERS[need]                 the provider class of a field of `Needs`
    provider.groups                 its optimizer groups, after the policy's
    provider.provide(inputs, pass_) its fields of one micro-batch's inputs
    provider.state_tensors()        its tensors: `<key>.<name>` among the optimizer's
    provider.state()                its other state: `<key>_<name>` in the trainer's state

The trainer (`tba.trainer.Trainer`) builds one for each need its objective's `Needs` sets and its
settings want (`providers_for`), in the order of `PROVIDERS` (the order of their optimizer
groups), and calls their hooks at the points of a step each names; it never names a need. A
sharded trainer (`tba.runtime.fsdp`) takes its own class for a need where one rank's differs.

Two needs have no provider here: `step_values`, which the searchers estimate with each sample
(`tba.vine_values`) and the loss reads from `LossInputs.samples`, and `group_statistics`, which
lets a micro-batch's context samples join their groups (`Trainer._loss`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from transformers import PreTrainedModel

from tba.config import TrainConfig
from tba.core import Sample
from tba.objectives import LossInputs, Needs
from tba.policy.micro_batches import padded_rows
from tba.policy.values import Critic


@dataclass
class PolicyPass:
    """What the policy's forward pass over a micro-batch gave beside the loss's inputs."""

    logp: torch.Tensor  # each row's summed log-prob (N,), differentiable
    # The trained rows' last hidden states at their responses' positions (N, T, H), where the
    # pass kept them (`tba.policy.logprobs.token_logprobs_and_states`); else None.
    states: torch.Tensor | None
    trained: int  # the first rows, which are trained on; the others are context rows
    pad_id: int


class Provider:
    """What the trainer provides for one need, from its construction (for a run of `settings`
    on `model`, the policy) to its checkpoints. Every hook does nothing here: a provider
    overrides those its need takes."""

    key: ClassVar[str]  # the prefix of its state in the trainer's checkpoints

    def __init__(self, model: PreTrainedModel, settings: TrainConfig) -> None:
        self.groups: list[dict[str, Any]] = []  # its optimizer groups, after the policy's

    @classmethod
    def wanted(cls, settings: TrainConfig) -> bool:
        """Whether a run of these settings takes it, where its objective has the need."""
        return True

    def before_micro_batches(self) -> None:
        """What a step needs before its first micro-batch."""

    def provide(self, inputs: LossInputs, forward: PolicyPass) -> None:
        """Its fields of one micro-batch's inputs (`inputs.samples` are the rows, the trained
        ones first)."""

    def after_backward(self) -> None:
        """After each micro-batch's backward pass."""

    def after_micro_batches(self) -> None:
        """After the step's last backward pass and the ranks' sums, before the clip."""

    def clip(self, max_norm: float) -> dict[str, float]:
        """Clip its gradients apart from the policy's, and say how (metrics of the step, all of
        which must be finite for the step to update, as the policy's gradient norm)."""
        return {}

    def after_update(self) -> None:
        """After the optimizer updated (a step with a finite loss and gradient)."""

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Its tensors, for a checkpoint."""
        return {}

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Continue from `state_tensors()`."""

    def state(self) -> dict[str, Any]:
        """Its state besides tensors (JSON values), for a checkpoint."""
        return {}

    def load_state(self, state: dict[str, Any]) -> None:
        """Continue from `state()`."""


class LearnedLogZ(Provider):
    """`learned_log_z`, with `train.tb.log_z=learned`: log Z(x) learned with the policy (as in
    GFlowNet red-teaming), a linear head on the mean of the prompt's input embeddings, read
    without gradient into the policy, at its own learning rate (`train.tb.log_z_lr`). Its bias
    starts at the first batch's VarGrad estimate, mean(-delta), so that it does not spend its
    first hundreds of steps climbing from 0 to a log Z of -20."""

    key = "log_z"

    def __init__(self, model: PreTrainedModel, settings: TrainConfig) -> None:
        super().__init__(model, settings)
        self.embeddings = model.get_input_embeddings()
        # token ids -> input embeddings: the policy's own embedding layer, or (sharded) a lookup
        # in the table gathered for the step. The head owns no policy weight.
        self.embed: Callable[[torch.Tensor], torch.Tensor] = self.embeddings.forward
        first = next(model.parameters())
        self.head = torch.nn.Linear(self.embeddings.embedding_dim, 1, device=first.device)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)
        self.ready = False
        self.groups = [{"params": list(self.head.parameters()), "lr": settings.tb.log_z_lr}]

    @classmethod
    def wanted(cls, settings: TrainConfig) -> bool:
        return settings.tb.log_z == "learned"

    def provide(self, inputs: LossInputs, forward: PolicyPass) -> None:
        inputs.log_z = self.log_z(inputs.samples, forward.logp.detach(), inputs.ref_logp,
                                  inputs.rewards, inputs.beta)  # fmt: skip

    def log_z(self, samples: list[Sample], logp: torch.Tensor, ref_logp: torch.Tensor,
              rewards: torch.Tensor, beta: float) -> torch.Tensor:  # fmt: skip
        """log Z of each sample's prompt, shape (N,)."""
        if not self.ready:
            with torch.no_grad():
                self.head.bias.fill_(self._mean(rewards / beta - logp + ref_logp))
            self.ready = True
        device = self.head.weight.device
        with torch.no_grad():
            pooled = torch.stack([
                self.embed(torch.tensor(s.prompt_ids, device=device)).float().mean(0)
                for s in samples
            ])  # fmt: skip
        return self.head(pooled).squeeze(-1)

    def _mean(self, values: torch.Tensor) -> float:
        """The mean of `values` (when sharded: over every rank's)."""
        return float(values.mean())

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {f"head.{name}": value for name, value in self.head.state_dict().items()}

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        self.head.load_state_dict({name.removeprefix("head."): value
                                   for name, value in tensors.items()})  # fmt: skip

    def state(self) -> dict[str, Any]:
        return {"ready": self.ready}

    def load_state(self, state: dict[str, Any]) -> None:
        self.ready = state["ready"]


class TokenReferenceLogps(Provider):
    """`token_ref_logp`: the samples' per-token reference log-probs, which the searchers stored
    with them (`Sample.ref_token_logps`), right-padded like the policy's token log-probs."""

    key = "ref_token_logp"

    def provide(self, inputs: LossInputs, forward: PolicyPass) -> None:
        inputs.ref_token_logp = padded_rows([s.ref_token_logps for s in inputs.samples],
                                            inputs.mask.shape[1], inputs.rewards.device)


class CriticValues(Provider):
    """`critic`: a critic learned with the policy (`tba.policy.values.Critic`: a value head on
    the policy's last hidden state, or a separate critic LM, as `train.ppo` sets), its head at
    its own rate and a separate LM at `train.ppo.critic_lr` (by default the policy's); its
    gradient is clipped apart from the policy's (`value_grad_norm`). Each sample's values at its
    first use are stored with it (`Sample.old_values`, PPO's V_old) for its later uses."""

    key = "value"

    def __init__(self, model: PreTrainedModel, settings: TrainConfig) -> None:
        super().__init__(model, settings)
        ppo = settings.ppo
        self.critic = Critic(model, separate=ppo.value_model == "critic", head_lr=ppo.value_lr,
                             trunk_lr=settings.learning_rate if ppo.critic_lr is None
                             else ppo.critic_lr)  # fmt: skip
        self.groups = self.critic.groups

    def provide(self, inputs: LossInputs, forward: PolicyPass) -> None:
        samples = inputs.samples
        inputs.values = self.critic.values([s.prompt_ids for s in samples],
                                           [s.response_ids for s in samples],
                                           pad_id=forward.pad_id,
                                           policy_states=forward.states)  # fmt: skip
        store_old_values(samples[: forward.trained], inputs.values)
        inputs.old_values = padded_rows([s.old_values for s in samples], inputs.mask.shape[1],
                                        inputs.rewards.device)  # fmt: skip

    def after_backward(self) -> None:
        self.critic.grads_to_masters()

    def clip(self, max_norm: float) -> dict[str, float]:
        return {"value_grad_norm": float(torch.nn.utils.clip_grad_norm_(
            self.critic.parameters(), max_norm))}  # fmt: skip

    def after_update(self) -> None:
        self.critic.masters_to_model()

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return self.critic.state_tensors()

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        self.critic.load_state_tensors(tensors)


def store_old_values(samples: list[Sample], values: torch.Tensor) -> None:
    """PPO's V_old: the critic's values of each sample at its first use in training (its row of
    `values`, detached, to its response's length), kept with the sample (`Sample.old_values`,
    in the buffer and its checkpoints) for every later use; a sample that has them keeps them.
    `values`' first rows are `samples`'."""
    rows = values.detach().float().cpu()
    for index, s in enumerate(samples):
        if s.old_values is None:
            s.old_values = rows[index, : len(s.response_ids)].tolist()


# The provider of each need the trainer serves, in the order a trainer builds them.
PROVIDERS: dict[str, type[Provider]] = {
    "learned_log_z": LearnedLogZ,
    "token_ref_logp": TokenReferenceLogps,
    "critic": CriticValues,
}


def providers_for(
    needs: Needs, model: PreTrainedModel, settings: TrainConfig,
    classes: dict[str, type[Provider]] = PROVIDERS,
) -> dict[str, Provider]:  # fmt: skip
    """The providers, by need, of the needs that `needs` sets and `settings` want, built in the
    order of `classes` (a need's class in it; `PROVIDERS` unless a trainer has its own)."""
    return {need: provider(model, settings) for need, provider in classes.items()
            if getattr(needs, need) and provider.wanted(settings)}  # fmt: skip
