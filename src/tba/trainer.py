"""The trainer: one optimizer step of the chosen objective on a batch of groups from the buffer.

The reference log-probs come with the samples; the trainer only runs the policy. Groups are kept
whole inside a micro-batch, because each group's log Z_hat (or baseline) is estimated from all its
members. `loss` picks the objective: `tb` (VarGrad Trajectory Balance) or one of the baselines of
`tba.objectives.baselines`, which share everything else.
"""

from __future__ import annotations

import time

import numpy as np
import torch
from transformers import PreTrainedModel

from tba.buffer import Sample
from tba.objectives import (
    dr_grpo_loss,
    grpo_loss,
    online_dpo_loss,
    proximal_rloo_loss,
    rloo_loss,
    tb_loss,
)
from tba.policy.logprobs import sequence_logprobs, token_logprobs
from tba.policy.model import get_weights

LOSSES = ("tb", "dr_grpo", "grpo", "rloo", "proximal_rloo", "online_dpo")
CLIPPED = {"dr_grpo": dr_grpo_loss, "grpo": grpo_loss, "proximal_rloo": proximal_rloo_loss}
UNCLIPPED = {"rloo": rloo_loss, "online_dpo": online_dpo_loss}


class Trainer:
    def __init__(
        self,
        model: PreTrainedModel,
        *,
        pad_id: int,
        temperature: float,
        learning_rate: float,
        max_grad_norm: float,
        warmup_steps: int = 0,
        micro_batch_groups: int | None = None,
        loss: str = "tb",
        clip_eps: float = 0.2,
    ) -> None:
        if loss not in LOSSES:
            raise ValueError(f"unknown loss {loss!r}; available: {', '.join(LOSSES)}")
        self.loss = loss
        self.clip_eps = clip_eps
        self.model = model.train()
        self.pad_id = pad_id
        self.temperature = temperature
        self.max_grad_norm = max_grad_norm
        self.micro_batch_groups = micro_batch_groups
        self.optimizer = torch.optim.Adam(model.parameters(), lr=learning_rate)
        # Adam's first updates move every weight by about the full learning rate whatever the
        # gradient's signal-to-noise; a linear warmup makes those first moves smaller.
        self.schedule = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: min(1.0, (step + 1) / (warmup_steps + 1))
        )
        self.version = 0  # weight version: bumped at every publish
        self.step_count = 0

    def weights(self) -> dict[str, np.ndarray]:
        return get_weights(self.model)

    def publish(self) -> tuple[dict[str, np.ndarray], int]:
        """The current weights as the next version, for the searchers."""
        self.version += 1
        return self.weights(), self.version

    def step(self, groups: list[list[Sample]], beta: float) -> dict[str, float]:
        start = time.time()
        total = sum(len(g) for g in groups)
        chunk = self.micro_batch_groups or len(groups)
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = {}
        for first in range(0, len(groups), chunk):
            flat = [s for group in groups[first : first + chunk] for s in group]
            loss, stats = self._loss(flat, beta)
            # Weighted so that the accumulated gradient is that of the mean over the whole batch.
            (loss * len(flat) / total).backward()
            for key, value in {"loss": loss.item(), **stats}.items():
                sums[key] = sums.get(key, 0.0) + float(value) * len(flat)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        self.optimizer.step()
        self.schedule.step()
        self.step_count += 1
        tokens = sum(len(s.prompt_ids) + len(s.response_ids) for g in groups for s in g)
        elapsed = time.time() - start
        return {
            **{key: value / total for key, value in sums.items()},
            "grad_norm": float(grad_norm),
            "train_seconds": elapsed,
            "train_tokens_per_s": tokens / elapsed,
        }

    def _loss(self, flat: list[Sample], beta: float) -> tuple[torch.Tensor, dict[str, float]]:
        """The objective on one micro-batch, and its metrics (means over its samples)."""
        prompts = [s.prompt_ids for s in flat]
        responses = [s.response_ids for s in flat]
        device = next(self.model.parameters()).device
        ref_logp = torch.tensor([s.ref_logp for s in flat], device=device)
        rewards = torch.tensor([s.reward for s in flat], device=device)
        group_ids = torch.tensor([s.prompt_id for s in flat], device=device)
        if self.loss == "tb":
            logp = sequence_logprobs(
                self.model, prompts, responses, pad_id=self.pad_id, temperature=self.temperature
            )
            loss, log_z = tb_loss(logp, ref_logp, rewards, group_ids, beta)
            kl = (logp.detach() - ref_logp).mean()
            return loss, {"log_z": float(log_z.mean()), "kl": float(kl)}
        token_logp, mask = token_logprobs(
            self.model, prompts, responses, pad_id=self.pad_id, temperature=self.temperature
        )
        if self.loss in CLIPPED:
            behaviour = _behaviour_token_logps(flat, token_logp.shape[1], device)
            loss, stats = CLIPPED[self.loss](
                token_logp, behaviour, mask, rewards, ref_logp, group_ids,
                beta=beta, clip_eps=self.clip_eps,
            )  # fmt: skip
        else:
            loss, stats = UNCLIPPED[self.loss](
                token_logp, mask, rewards, ref_logp, group_ids, beta=beta
            )
        return loss, {key: float(value) for key, value in stats.items()}


def _behaviour_token_logps(flat: list[Sample], width: int, device) -> torch.Tensor:
    """(N, width) right-padded with zeros, like the policy's token log-probs."""
    padded = torch.zeros(len(flat), width)
    for row, s in enumerate(flat):
        if s.behaviour_token_logps is None:
            raise ValueError("this loss needs per-token behaviour log-probs in every sample")
        padded[row, : len(s.behaviour_token_logps)] = torch.tensor(s.behaviour_token_logps)
    return padded.to(device)
