"""The trainer: one optimizer step of the chosen objective on a batch of groups from the buffer.

The reference log-probs come with the samples; the trainer only runs the policy. Groups are kept
whole inside a micro-batch, because each group's log Z_hat is estimated from all its members.
"""

from __future__ import annotations

import time

import numpy as np
import torch
from transformers import PreTrainedModel

from tba.buffer import Sample
from tba.objectives import tb_loss
from tba.policy.logprobs import sequence_logprobs
from tba.policy.model import get_weights


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
    ) -> None:
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
        loss_sum = log_z_sum = kl_sum = 0.0
        for first in range(0, len(groups), chunk):
            flat = [s for group in groups[first : first + chunk] for s in group]
            logp = sequence_logprobs(
                self.model,
                [s.prompt_ids for s in flat],
                [s.response_ids for s in flat],
                pad_id=self.pad_id,
                temperature=self.temperature,
            )
            ref_logp = torch.tensor([s.ref_logp for s in flat], device=logp.device)
            rewards = torch.tensor([s.reward for s in flat], device=logp.device)
            group_ids = torch.tensor([s.prompt_id for s in flat], device=logp.device)
            loss, log_z = tb_loss(logp, ref_logp, rewards, group_ids, beta)
            # Weighted so that the accumulated gradient is that of the mean over the whole batch.
            (loss * len(flat) / total).backward()
            loss_sum += loss.item() * len(flat)
            log_z_sum += log_z.sum().item()
            kl_sum += (logp.detach() - ref_logp).sum().item()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        self.optimizer.step()
        self.schedule.step()
        self.step_count += 1
        tokens = sum(len(s.prompt_ids) + len(s.response_ids) for g in groups for s in g)
        elapsed = time.time() - start
        return {
            "loss": loss_sum / total,
            "log_z": log_z_sum / total,
            "kl": kl_sum / total,
            "grad_norm": float(grad_norm),
            "train_seconds": elapsed,
            "train_tokens_per_s": tokens / elapsed,
        }
