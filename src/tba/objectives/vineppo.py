"""VinePPO (Kazemnejad et al., *VinePPO: Refining Credit Assignment in RL Training of LLMs*,
arXiv 2410.01679): PPO's clipped ratio with no critic, on step advantages from Monte Carlo values
of each response's step prefixes.

A response is split into steps (`tba.vine_values` says where, and estimates the values: the searcher
that made the response samples continuations of every step prefix and scores them); the states
are the prompt (s_0) and the prompt with the first 1, 2, ... steps, and V(s_k) is the mean reward
of the continuations of s_k. Per-token tensors are (N, T), right-padded, with a 0/1 or boolean
``mask`` of real response tokens (EOS included; every row needs >= 1); the per-token KL penalty is
that of PPO (:mod:`tba.objectives.ppo`), in reward units:

    kl_it = stopgrad(token_logp_it) - ref_token_logp_it      (or the behaviour log-probs)

- :func:`vine_advantages` -- each step's advantage from the values of the states around it.
- :func:`token_step_advantages` -- the same from the samples' step ends and values (what the
  searchers store), per token.
- :func:`vineppo_loss` -- the clipped ratio on each token's step advantage plus the KL penalty to
  go, a sum over tokens divided by the number of sequences N (micro-batches add up exactly).
- :class:`VinePPOSettings` -- its own settings, the section `train.vineppo`: how the searchers
  split responses into steps and estimate the values of their prefixes.
"""

from __future__ import annotations

import torch
from pydantic import Field
from torch import Tensor

from tba.core import Sample
from tba.objectives.common import (
    CLIP_EPS,
    TokenBatch,
    check_positive,
    clipped_objective,
    masked,
    token_kl,
    validate_tokens,
)
from tba.section import Section


class VinePPOSettings(Section):
    """VinePPO's Monte Carlo values of step prefixes (`train.loss=vineppo`)."""

    rollouts: int = Field(
        9, ge=1, description="vineppo: continuations sampled per step prefix to estimate its value"
    )
    max_states: int = Field(
        25, ge=1, description="vineppo: step prefixes per response at most, the prompt included "
        "(more steps: evenly spaced step ends kept)",
    )
    delimiter: str = Field(
        "\n", min_length=1, description="vineppo: a step ends with the token whose text holds this",
    )


def reward_to_go(token_values: Tensor, mask: Tensor) -> Tensor:
    """``sum_{t' >= t} x_t'`` over real tokens (N, T), 0 on padding."""
    mask = mask.bool()
    values = token_values.masked_fill(~mask, 0.0)
    return values.flip(1).cumsum(1).flip(1).masked_fill(~mask, 0.0)


def step_index(step_ends: list[list[int]], width: int, device=None) -> Tensor:
    """(N, width) long: the step of each response token, 0, 1, ..., given each response's step
    ends (exclusive token indices, increasing, the last one its length); padding gets the last
    step's index (mask it)."""
    longest = max(len(ends) for ends in step_ends)
    padded = torch.tensor([ends + [ends[-1]] * (longest - len(ends)) for ends in step_ends],
                          device=device)  # fmt: skip
    columns = torch.arange(width, device=device)
    index = (columns[None, :, None] >= padded[:, None, :]).sum(-1)
    counts = torch.tensor([len(ends) for ends in step_ends], device=device)
    return torch.minimum(index, counts[:, None] - 1)


def vine_advantages(
    state_values: Tensor, steps: Tensor, num_steps: Tensor, rewards: Tensor, mask: Tensor
) -> tuple[Tensor, Tensor]:
    """VinePPO's step advantages from Monte Carlo values of the step prefixes.

    A response of n steps visits the states s_0 (the prompt), s_1, ..., s_{n-1} (the prompt and
    its first steps); ``state_values`` (N, S >= n) holds their estimates V(s_k) (padding
    ignored), ``steps`` (N, T) each token's step, ``num_steps`` (N,) n. The reward R comes at
    the end, after which nothing is left to earn:

        A_k = r_k + V(s_{k+1}) - V(s_k),     r_k = [k = n - 1] R,   V(s_n) = 0

    so that ``sum_k A_k = R - V(s_0)`` exactly. Returns ``(token advantages (N, T), 0 on
    padding; step advantages (N, S), 0 past each response's n steps)``."""
    mask = mask.bool()
    values = state_values
    columns = torch.arange(values.shape[1], device=values.device)
    last = columns[None, :] == (num_steps[:, None] - 1)
    live = columns[None, :] < num_steps[:, None]
    following = torch.cat([values[:, 1:], values.new_zeros(values.shape[0], 1)], dim=1)
    following = torch.where(last, rewards.to(values.dtype)[:, None], following)
    step_advantages = ((following - values) * live).masked_fill(~live, 0.0)
    token_advantages = step_advantages.gather(1, steps.clamp(min=0))
    return token_advantages.masked_fill(~mask, 0.0), step_advantages


def token_step_advantages(samples: list[Sample], mask: Tensor, rewards: Tensor) -> Tensor:
    """Each response token's step advantage (N, T), 0 on padding, from the samples' step ends and
    Monte Carlo step values (`Sample.step_ends`, `Sample.step_values`)."""
    if any(s.step_values is None for s in samples):
        raise ValueError("vineppo needs every sample's Monte Carlo step values")
    device = mask.device
    ends = [s.step_ends for s in samples]
    longest = max(len(e) for e in ends)
    values = torch.tensor([s.step_values + [0.0] * (longest - len(s.step_values))
                           for s in samples], device=device)  # fmt: skip
    steps = step_index(ends, mask.shape[1], device)
    counts = torch.tensor([len(e) for e in ends], device=device)
    return vine_advantages(values, steps, counts, rewards, mask)[0]


def vineppo_loss(
    batch: TokenBatch,
    step_advantages: Tensor,
    *,
    beta: float,
    clip_eps: float = CLIP_EPS,
    kl_token_logp: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """VinePPO: PPO's clipped ratio on each token's step advantage (``step_advantages`` (N, T),
    :func:`vine_advantages`: Monte Carlo values of the task reward) and the KL penalty to go, on
    the batch's ``token_logp``, ``behaviour_token_logp``, ``mask`` and ``ref_token_logp``:

        A_t    = A_step(t) - beta sum_{t' >= t} kl_t'
        loss   = -(1/N) sum_{i,t} min(rho_t A_t, clip(rho_t, 1 - eps, 1 + eps) A_t)

    The Monte Carlo values estimate the task reward only, so the KL part of the return keeps no
    baseline (it is known exactly for the sampled response). No whitening: the advantages are in
    reward units. ``kl_token_logp``: the log-probs of the KL term (default the current policy's,
    detached; the behaviour policy's fix it when the sample was drawn). Stats:
    ``advantage_mean``, ``advantage_std``, ``clip_frac`` and ``kl``.
    """
    token_logp, behaviour_token_logp, mask = batch.token_logp, batch.behaviour(), batch.mask
    ref_token_logp = batch.ref_tokens()
    validate_tokens(
        mask,
        {"token_logp": token_logp, "behaviour_token_logp": behaviour_token_logp,
         "step_advantages": step_advantages, "ref_token_logp": ref_token_logp},
        {},
    )  # fmt: skip
    check_positive("beta", beta, allow_zero=True)
    check_positive("clip_eps", clip_eps)
    mask = mask.bool()
    token_logp = masked(token_logp, mask)
    kl = token_kl(token_logp, ref_token_logp, mask, kl_token_logp)
    advantages = masked(step_advantages.detach(), mask) - beta * reward_to_go(kl, mask)
    log_ratio = token_logp - masked(behaviour_token_logp.detach(), mask)
    objective, clipped = clipped_objective(log_ratio, advantages, clip_eps)
    loss = -objective.masked_fill(~mask, 0.0).sum() / mask.shape[0]
    real = advantages[mask]
    stats = {
        "advantage_mean": real.mean(),
        "advantage_std": real.std(unbiased=False),
        "clip_frac": (clipped & mask).sum() / mask.sum(),
        "kl": kl.sum(dim=1).mean(),
    }
    return loss, stats
