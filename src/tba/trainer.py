"""The trainer: one optimizer step of the chosen objective on a batch of groups from the buffer.

The reference log-probs come with the samples; the trainer only runs the policy. Groups are kept
whole inside a micro-batch, because each group's log Z_hat (or baseline) is estimated from all its
members. The trainer takes the config's `train` section (`TrainConfig`) whole: `train.loss` names
the objective in `tba.objectives.OBJECTIVES`, and the objective reads its own settings from the
same section (`LossInputs.settings`). The trainer never tests the objective's name: it runs the
provider of each need the objective's `Needs` sets (`tba.needs`), which sets up what the need
takes, fills its fields of each micro-batch's `LossInputs` and keeps its state in the
checkpoints: a critic learned with the policy and each sample's V_old (`critic`, PPO), log Z(x)
learned with the policy (`learned_log_z`, TB with `train.tb.log_z=learned`), the samples'
per-token reference log-probs (`token_ref_logp`, PPO and VinePPO); `group_statistics` lets
context samples join their groups. `baseline_kl` picks the log-probs in the baselines'
KL-shaped reward: the `current` policy's (then RLOO's gradient is TB's) or the `behaviour`
policy's, fixed when the sample was drawn (as in TRL's RLOO).

Micro-batches are runs of whole groups, at most `train.micro_batch_groups` and at most
`train.micro_batch_tokens` tokens (`tba.policy.micro_batches`). Under a token budget their rows
run packed end to end where that runs fewer positions than padding and the policy keeps packed
rows apart (`tba.policy.logprobs`): that changes how the forward pass is computed, not the padded
(N, T) tensors the losses see. Each step reports the share of the positions its forward passes
ran that were padding (`padded_frac`). `train.gradient_checkpointing=auto` is decided at the first
step from an estimate of the step's activations and the device's free memory
(`tba.policy.activation_memory`), again while it is off; `checkpointing_note` says the decision
in one line, for the run's log.

A group can be part of what its generation made (S > K): with `train.group_baseline=generation`
the others (`Batch.context`) join it in the loss with detached log-probs, so that its log Z or
baseline comes from all S while only the K are trained; the reported `loss` then includes their
constant terms.

Gradient clipping: every objective but GRPO is in reward units per sequence (on-policy, each
sequence's log-prob gets gradient -A_i / N), so `max_grad_norm` clips them alike; GRPO's
standardised, length-normalised advantages are unitless. Each step reports the norm before
clipping (`grad_norm`) and the factor the clip applied (`clip_factor`, 1 when it did not bind),
and how far the batch is from the policy that generated it: `ratio_out_frac`, the share of
sequences whose ratio pi / pi_behaviour left [0.8, 1.2].

The optimizer (AdamW, with `weight_decay` on the matrices only; torch's, or bitsandbytes' with
8-bit moments: `train.optimizer`, `tba.policy.optimizers`) updates only trainable weights (with
LoRA: the adapters), and bf16 weights through fp32 master copies, or in place with Kahan
compensation (`train.master_weights`, `tba.policy.precision`); the loss is computed in fp32.
The learning rate warms up over `warmup_steps`, then stays or decays to 0 at the run's last step
(`lr_schedule`, `tba.lr_schedule.lr_factor`).
"""

from __future__ import annotations

import bisect
import math
import time
from typing import Any, ClassVar

import numpy as np
import torch
import torch.distributed as dist
from transformers import PreTrainedModel

from tba.config import RunConfig, TrainConfig
from tba.core import Sample
from tba.lr_schedule import LRSchedule, warmup_steps_for
from tba.needs import PROVIDERS, PolicyPass, Provider, providers_for
from tba.objectives import OBJECTIVES, LossInputs
from tba.policy.activation_memory import ModelShape, checkpointing_choice, rows_for
from tba.policy.batching import packed_positions, padded_positions
from tba.policy.logprobs import packs_rows, shares_prompts, token_logprobs_and_states
from tba.policy.micro_batches import (
    ForwardPositions,
    distinct_context,
    flattened,
    micro_batch_runs,
    padded_rows,
    padded_width,
    prompts_and_responses,
    stack_padded,
)
from tba.policy.model import (
    checkpoint_state,
    enable_checkpointing,
    get_weights,
    is_checkpointing,
    load_checkpoint_state,
    unwrapped,
)
from tba.policy.optimizers import build_optimizer, flat_param_state, load_optimizer_state
from tba.policy.precision import trainable_weights

RATIO_BAND = 0.2  # `ratio_out_frac`: share of sequences whose ratio left [0.8, 1.2]
# What the trainer's checkpoints keep of the optimizer beside its groups' states: the fp32
# masters of bf16 weights, or their Kahan compensations (`tba.policy.precision`).
WEIGHT_KEYS = ("master", "kahan")


def trainer_settings(config: RunConfig, pad_id: int, total_steps: int | None) -> dict[str, Any]:
    """`Trainer`'s arguments (all but the model) as `config` sets them, for a run of
    `total_steps` optimizer steps (None: no step limit)."""
    return {"settings": config.train, "pad_id": pad_id,
            "temperature": config.policy.temperature, "total_steps": total_steps}  # fmt: skip


def decay_groups(params: list[torch.nn.Parameter], learning_rate: float,
                 weight_decay: float) -> list[dict[str, Any]]:  # fmt: skip
    """The policy's optimizer groups: with weight decay, the matrices (linear layers,
    embeddings, LoRA's A and B) decay and the vectors (biases, norm weights) do not, as in
    transformers' Trainer; without, one group."""
    if weight_decay == 0:
        return [{"params": params, "lr": learning_rate, "weight_decay": 0.0}]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "lr": learning_rate,
         "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim < 2], "lr": learning_rate, "weight_decay": 0.0},
    ]  # fmt: skip
    return [group for group in groups if group["params"]]


class WeightVersions:
    """The trainer's clock: optimizer steps taken, and the weight versions published (each
    tagged with the step it was published at), to tell how far behind a sample is."""

    # Whether `model` is the module being trained, in this process (not a copy gathered from
    # ranks elsewhere): what can be shared with searchers without a copy.
    trains_here = True

    def __init__(self) -> None:
        self.version = 0  # weight version: bumped at every publish
        self.publish_steps = [0]  # [v]: optimizer steps taken when version v was published
        self.step_count = 0
        self.skipped_steps = 0  # non-finite loss or gradient: no update

    def steps_behind(self, version: int) -> int:
        """Optimizer steps taken since the weights of `version` were published: how far a
        sample of that version is from the policy being trained."""
        return self.step_count - self.publish_steps[version]

    def oldest_version_within(self, steps: int) -> int:
        """The oldest version published at most `steps` optimizer steps ago; the newest published
        one when none is (its samples are all the searchers have)."""
        return min(bisect.bisect_left(self.publish_steps, self.step_count - steps), self.version)

    def publish(self) -> tuple[int, int]:
        """The weights as they are now as the next version: (version, optimizer steps taken).
        Whoever hands them to the searchers reads them now (`weights`, or the module itself)."""
        self.version += 1
        self.publish_steps.append(self.step_count)
        return self.version, self.step_count

    def versions_state(self) -> dict[str, Any]:
        return {"version": self.version, "publish_steps": self.publish_steps,
                "step_count": self.step_count, "skipped_steps": self.skipped_steps}  # fmt: skip

    def load_versions_state(self, state: dict[str, Any]) -> None:
        self.version = state["version"]
        self.publish_steps = list(state["publish_steps"])
        self.step_count = state["step_count"]
        self.skipped_steps = state["skipped_steps"]


class Trainer(WeightVersions):
    """The policy being trained, its optimizer and its weight versions: `step` on a batch,
    `publish` a new version of its weights (read with `weights`, or as the module itself), and
    `state_dict` for checkpoints."""

    # The provider of each need it serves (`tba.needs`); a sharded trainer's differ where one
    # rank's provider does (`tba.runtime.fsdp`).
    provider_classes: ClassVar[dict[str, type[Provider]]] = PROVIDERS

    # The last decision about gradient checkpointing, as one line for the run's log: set at the
    # first step, and again when a later step turns checkpointing on (`_settle_checkpointing`).
    checkpointing_note: str | None = None
    _packing: bool | None = None  # whether the policy keeps packed rows apart (asked once)
    _positions: ForwardPositions | None = None  # the step's forward passes, counted

    def __init__(
        self,
        model: PreTrainedModel,
        settings: TrainConfig,
        *,
        pad_id: int,
        temperature: float,
        total_steps: int | None = None,
    ) -> None:
        """`settings`: the config's `train` section, whose objective (`loss`) the trainer steps
        and which that objective reads its settings from; `temperature`: the policy's, at which
        log-probs are taken; `total_steps`: the run's step limit (None: none), for the learning
        rate's schedule and a warmup given as a ratio of it."""
        self.settings = settings
        self.loss = settings.loss
        self.objective = OBJECTIVES[settings.loss]
        self.model = model.train()
        self.pad_id = pad_id
        self.temperature = temperature
        self.max_grad_norm = settings.max_grad_norm
        self.micro_batch_groups = settings.micro_batch_groups
        self.gradient_scale = 1.0  # ranks whose gradients are averaged scale theirs up by N
        # Only the trainable weights (with LoRA: the adapters); bf16 ones through fp32 masters, or
        # (train.master_weights=none) themselves, with Kahan compensation.
        self.masters = trainable_weights([p for p in model.parameters() if p.requires_grad],
                                         settings.master_weights)  # fmt: skip
        groups = decay_groups(self.masters.params, settings.learning_rate, settings.weight_decay)
        # What the objective's needs take (a critic, a learned log Z, ...), by need: each
        # trained at its own rates, in groups after the policy's.
        self.providers: dict[str, Provider] = providers_for(
            self.objective.needs, model, settings, self.provider_classes)  # fmt: skip
        for provider in self.providers.values():
            groups += provider.groups
        # Adam (AdamW: weight decay decoupled from the gradient's moments, and only where a
        # group asks for it): torch's, or bitsandbytes' with 8-bit moments (train.optimizer).
        self.optimizer = build_optimizer(settings.optimizer, groups,
                                         next(model.parameters()).device)  # fmt: skip
        # Adam's first updates move every weight by about the full learning rate whatever the
        # gradient's signal-to-noise; a linear warmup makes those first moves smaller. Then the
        # rate stays, or decays to 0 at the last step.
        warmup_steps = warmup_steps_for(total_steps, settings.warmup_steps, settings.warmup_ratio)
        # An unknown schedule fails here; a resume with another step limit extends it smoothly.
        self.schedule = LRSchedule(self.optimizer, settings.lr_schedule, warmup_steps, total_steps)
        super().__init__()

    def weights(self) -> dict[str, np.ndarray]:
        """The weights as they are now, as numpy arrays (a copy, for another process)."""
        return get_weights(self.model)

    def step(
        self, groups: list[list[Sample]], beta: float, context: list[list[Sample]] | None = None
    ) -> dict[str, float]:
        """One optimizer step on the batch's groups; `context[i]`, if given, are samples that
        enter group i's log Z or baseline without being trained on (`Batch.context`). The
        micro-batches are runs of whole groups, at most `train.micro_batch_groups` of them and
        at most `train.micro_batch_tokens` tokens (`micro_batch_runs`)."""
        runs = micro_batch_runs(groups, self.micro_batch_groups, self.settings.micro_batch_tokens)
        micro_batches = [flattened(groups[run]) for run in runs]
        contexts = [flattened(context[run]) for run in runs] if context else None
        return self._step(micro_batches, beta, total=sum(len(g) for g in groups),
                          contexts=contexts)  # fmt: skip

    def _step(
        self, micro_batches: list[list[Sample]], beta: float, total: int, padding: int = 0,
        contexts: list[list[Sample]] | None = None,
    ) -> dict[str, float]:  # fmt: skip
        """Accumulate the gradient of the mean loss over `total` samples, micro-batch by
        micro-batch, then clip and step. The last `padding` micro-batches only keep collectives
        in step across ranks (`tba.runtime.fsdp`): they count for nothing. `contexts[i]`: the
        samples that only enter the group statistics of micro-batch i."""
        start = time.time()
        self._settle_checkpointing(micro_batches[: len(micro_batches) - padding])
        self.optimizer.zero_grad(set_to_none=True)
        self.model.zero_grad(set_to_none=True)
        providers = self.providers.values()
        for provider in providers:
            provider.before_micro_batches()
        self._positions = ForwardPositions()
        sums: dict[str, float] = {"tokens": 0.0}
        for index, samples in enumerate(micro_batches):
            counted = index < len(micro_batches) - padding
            loss, stats = self._loss(samples, beta, contexts[index] if contexts else [])
            # Weighted so that the accumulated gradient is that of the mean over the whole batch.
            (loss * (len(samples) / total * self.gradient_scale if counted else 0.0)).backward()
            self.masters.grads_to_masters()
            for provider in providers:
                provider.after_backward()
            if not counted:
                continue
            for key, value in {"loss": loss.item(), **stats}.items():
                sums[key] = sums.get(key, 0.0) + float(value) * len(samples)
            sums["tokens"] += sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
        sums |= {"positions_run": self._positions.run, "positions_real": self._positions.real}
        sums = self._sum_over_ranks(sums)
        for provider in providers:
            provider.after_micro_batches()
        grad_norm = self._clip_grad_norm()
        clipped_apart = {}  # the providers' gradients, clipped apart from the policy's
        for provider in providers:
            clipped_apart |= provider.clip(self.max_grad_norm)
        # One inf or NaN would poison Adam's moments for good: skip the update instead.
        finite = math.isfinite(sums["loss"]) and math.isfinite(grad_norm) and all(
            math.isfinite(value) for value in clipped_apart.values())  # fmt: skip
        learning_rate = self.optimizer.param_groups[0]["lr"]  # the policy's, by its schedule
        if finite:
            self.masters.step(self.optimizer)  # and the model's weights from what it updated
            for provider in providers:
                provider.after_update()
            self.schedule.step()
        else:
            self.optimizer.zero_grad(set_to_none=True)
            self.skipped_steps += 1
        self.step_count += 1
        tokens = sums.pop("tokens")
        run, real = sums.pop("positions_run"), sums.pop("positions_real")
        elapsed = time.time() - start
        return {
            **{key: value / total for key, value in sums.items()},
            "grad_norm": grad_norm,  # before clipping
            **clipped_apart,
            "clip_factor": min(1.0, self.max_grad_norm / (grad_norm + 1e-6)),
            "learning_rate": learning_rate,
            "skipped": float(not finite),
            "train_seconds": elapsed,
            "train_tokens_per_s": tokens / elapsed,
            # The share of the positions the policy's forward passes ran that were padding.
            "padded_frac": 1.0 - real / run if run else 0.0,
            "checkpointing": float(is_checkpointing(self.model)),
        }

    # -------------------------------------------------- micro-batches: layout and checkpointing

    def _settle_checkpointing(self, micro_batches: list[list[Sample]]) -> None:
        """Gradient checkpointing as `train.gradient_checkpointing` sets it: `auto` decides from
        the model's shape, the step's micro-batches (with a token budget, the budget) and the
        device's free memory (`checkpointing_choice`), at the first step and at each later one
        while it is off, since a later batch may be longer; once on, it stays on. A policy
        loaded with it keeps it."""
        if is_checkpointing(self.model):
            if self.checkpointing_note is None:
                self.checkpointing_note = "gradient checkpointing on: the policy was loaded with it"
            return
        setting = self.settings.gradient_checkpointing
        if not micro_batches or (self.checkpointing_note is not None and setting != "auto"):
            return
        rows, tokens = self._activation_extent(micro_batches)
        on, note = checkpointing_choice(setting, next(self.model.parameters()).device,
                                        ModelShape.of(self.model), rows, tokens,
                                        ranks=_ranks())  # fmt: skip
        if on:
            enable_checkpointing(unwrapped(self.model))
        if on or self.checkpointing_note is None:
            self.checkpointing_note = note

    def _activation_extent(self, micro_batches: list[list[Sample]]) -> tuple[int, int]:
        """(rows, tokens) of the largest forward pass of a micro-batch without checkpointing: a
        padded one's rows, each as long as its longest prompt plus its longest response; with a
        token budget, rows as long as the longest row that hold the budget (or the largest
        micro-batch, where one group alone is over it)."""
        layouts = [(len(samples), padded_width(samples)) for samples in micro_batches]
        rows, tokens = max(layouts, key=lambda layout: layout[0] * layout[1])
        budget = self.settings.micro_batch_tokens
        if budget is None:
            return rows, tokens
        width = max(len(s.prompt_ids) + len(s.response_ids) for samples in micro_batches
                    for s in samples)  # fmt: skip
        largest = max(self._forward_positions(samples) for samples in micro_batches)
        return rows_for(max(budget, largest), width), width

    def _forward_positions(self, samples: list[Sample]) -> int:
        """Token positions a forward pass of `samples` runs without checkpointing."""
        prompts, responses = prompts_and_responses(samples)
        if self._packs(prompts, responses):
            return packed_positions(prompts, responses)
        return padded_positions(prompts, responses, share_prompts=False)

    def _packs(self, prompts: list[list[int]], responses: list[list[int]]) -> bool:
        """Whether these rows run packed (`tba.policy.logprobs.packed_token_logprobs_and_states`):
        under a token budget, with one trainer rank (ranks must run the same passes), where
        packing runs fewer positions than padding, and if the policy keeps packed rows apart
        (`packs_rows`: transformers 5 does it for Llama, Qwen2 and GPT-2, among others)."""
        if self.settings.micro_batch_tokens is None or _ranks() > 1:
            return False
        padded = padded_positions(prompts, responses, shares_prompts(self.model))
        if packed_positions(prompts, responses) >= padded:
            return False
        if self._packing is None:
            self._packing = packs_rows(self.model)
        return self._packing

    # One process holds the whole model: nothing to add up (`tba.runtime.fsdp` does).
    def _sum_over_ranks(self, sums: dict[str, float]) -> dict[str, float]:
        return sums

    def _clip_grad_norm(self) -> float:
        return float(torch.nn.utils.clip_grad_norm_(self.masters.params, self.max_grad_norm))

    # ----------------------------------------------------------------------------- checkpoints

    def state_dict(self) -> dict[str, Any]:
        """`model` and `optimizer`: tensors (Adam's moments, fp32 masters, and each provider's
        under its key: `<key>.<name>`); everything else JSON values (a provider's other state:
        `<key>_<name>`)."""
        optimizer = self.optimizer.state_dict()
        tensors, scalars = {}, {}
        for index, values in optimizer["state"].items():
            for name, value in flat_param_state(values).items():
                target = tensors if torch.is_tensor(value) else scalars
                target[f"{index}.{name}"] = value
        # fp32 masters of bf16 weights (rounding would lose them), or their compensation.
        tensors.update(self.masters.state_tensors())
        state = {
            "model": dict(checkpoint_state(self.model)),
            "optimizer": tensors,
            "param_groups": optimizer["param_groups"],
            "optimizer_scalars": scalars,
            "schedule": self.schedule.state_dict(),  # its lambda is code: saved as null
            **self.versions_state(),
        }
        for provider in self.providers.values():
            tensors.update({f"{provider.key}.{name}": value
                            for name, value in provider.state_tensors().items()})  # fmt: skip
            state.update({f"{provider.key}_{name}": value
                          for name, value in provider.state().items()})  # fmt: skip
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        load_checkpoint_state(self.model, state["model"])
        optimizer: dict[int, dict] = {}
        weights: dict[str, torch.Tensor] = {}  # fp32 masters, or the compensation of bf16 weights
        parts: dict[str, dict[str, torch.Tensor]] = {}  # the providers', by key
        for key, value in [*state["optimizer"].items(), *state["optimizer_scalars"].items()]:
            index, name = key.split(".", 1)
            if index in WEIGHT_KEYS:
                weights[key] = value
            elif index.isdigit():
                optimizer.setdefault(int(index), {})[name] = value
            else:
                parts.setdefault(index, {})[name] = value
        for provider in self.providers.values():
            provider.load_state_tensors(parts.get(provider.key, {}))
            provider.load_state({name: state[f"{provider.key}_{name}"]
                                 for name in provider.state()})  # fmt: skip
        self.masters.load_state_tensors(weights)
        load_optimizer_state(self.optimizer, optimizer, state["param_groups"])
        self.schedule.load_state_dict(state["schedule"])
        self.load_versions_state(state)

    def _loss(
        self, trained: list[Sample], beta: float, context: list[Sample]
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """The objective on one micro-batch, and its metrics (means over its samples; the
        objective's own over the groups' members, `context` included)."""
        if context and not self.objective.needs.group_statistics:
            raise ValueError(f"{self.loss} has no group statistics for context samples to enter")
        context = distinct_context(context, trained)
        rows = trained + context
        device = next(self.model.parameters()).device
        ref_logp = torch.tensor([s.ref_logp for s in rows], device=device)
        rewards = torch.tensor([s.reward for s in rows], device=device)
        group_ids = torch.tensor([s.prompt_id for s in rows], device=device)
        token_logp, mask, states = self._token_logprobs(trained)
        if context:
            with torch.no_grad():
                context_logp, context_mask, _ = self._token_logprobs(context)
            token_logp = stack_padded(token_logp, context_logp)
            mask = stack_padded(mask, context_mask)
        logp = token_logp.sum(dim=1)
        behaviour_logp = torch.tensor([s.behaviour_logp for s in rows], device=device)
        log_ratio = logp[: len(trained)].detach() - behaviour_logp[: len(trained)]
        band = math.log(1.0 - RATIO_BAND), math.log(1.0 + RATIO_BAND)
        drift = {
            "ratio_out_frac": float(((log_ratio < band[0]) | (log_ratio > band[1])).float().mean()),
            "log_ratio_abs": float(log_ratio.abs().mean()),
        }
        inputs = LossInputs(
            token_logp=token_logp, mask=mask, rewards=rewards, ref_logp=ref_logp,
            group_ids=group_ids, beta=beta, settings=self.settings, samples=rows,
            behaviour_token_logp=padded_rows([s.behaviour_token_logps for s in rows],
                                             token_logp.shape[1], device),
            kl_logp=behaviour_logp if self.settings.baseline_kl == "behaviour" else None,
        )  # fmt: skip
        forward = PolicyPass(logp, states, trained=len(trained), pad_id=self.pad_id)
        for provider in self.providers.values():
            provider.provide(inputs, forward)
        loss, stats = self.objective(inputs)
        stats = {**{key: float(value) for key, value in stats.items()}, **drift}
        if context:
            # Context rows' log-probs are detached: each adds a constant to the loss and nothing
            # to its gradient. Every objective that takes them is a mean over rows, so this factor
            # makes the gradient that of the mean over the trained rows, their groups'
            # statistics whole; the loss reported is the mean over the groups' members.
            stats["loss"] = loss.item()
            loss = loss * (len(rows) / len(trained))
        return loss, stats

    def _token_logprobs(
        self, samples: list[Sample]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The policy's per-token log-probs of `samples` (`token_logprobs_and_states`), their
        rows packed where `_packs` says so, padded otherwise; the positions run counted."""
        prompts, responses = prompts_and_responses(samples)
        packed = self._packs(prompts, responses)
        if self._positions is not None:
            self._positions.add(prompts, responses, packed, shares_prompts(self.model))
        return token_logprobs_and_states(self.model, prompts, responses, pad_id=self.pad_id,
                                         temperature=self.temperature, packed=packed)  # fmt: skip


def _ranks() -> int:
    """Trainer ranks stepping together (`tba.runtime.fsdp`): 1 unless a process group is up."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
