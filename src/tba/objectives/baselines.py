"""Baseline RL post-training objectives, for comparison with Trajectory Balance.

All losses are pure functions on a batch of N responses (a `TokenBatch`), each belonging to a
prompt group given by integer ``group_ids`` (any values, any order; every group needs >= 2
members). Per-token tensors are (N, T), right-padded, with a 0/1 or boolean ``mask`` of real
response tokens (EOS included; every row needs >= 1). ``token_logp`` is the current policy's
per-token log-prob (the only input that is differentiated), ``behaviour_token_logp`` the
per-token log-prob under the policy that generated the sample (equal to ``token_logp.detach()``
on-policy), ``rewards`` and ``ref_logp`` (summed reference log-prob) are per sequence. Except for
DPO, the reward is KL-shaped so that every method targets the same distribution as TB,
``pi_ref(y|x) exp(r / beta)``:

    logp_i    = sum_t mask_it token_logp_it
    r_tilde_i = r_i - beta * stopgrad(logp_i - ref_logp_i)          (beta = 0 disables it)

With the current policy's ``logp_i`` in the KL term (the default), RLOO's gradient is exactly
VarGrad TB's times K/(K-1) on any batch, fresh or replayed. Trainers such as TRL's RLOO instead
fix the KL term when the sample is drawn: pass ``kl_logp`` (the behaviour policy's summed
log-probs) to the RLOO and clipped-ratio losses for that, ``r_tilde_i = r_i - beta (kl_logp_i -
ref_logp_i)``. On-policy the two are the same.

Losses (each takes the batch and ``beta``, and returns ``(loss, stats)``: a scalar float32 loss,
computed in float32, and a small dict of detached float metrics):

- :func:`dr_grpo_loss`  reads token_logp, behaviour_token_logp, mask, rewards, ref_logp,
  group_ids -- PPO-clip with group-mean baseline, no std or length normalisation (Dr. GRPO).
- :func:`grpo_loss`  the same -- PPO-clip with group-standardised advantage, per-response
  length normalisation (GRPO).
- :func:`rloo_loss`  token_logp, mask, rewards, ref_logp, group_ids -- on-policy REINFORCE
  with the leave-one-out baseline.
- :func:`proximal_rloo_loss`  token_logp, behaviour_token_logp, mask, rewards, ref_logp,
  group_ids -- RLOO with a clipped sequence-level importance ratio, for off-policy data.
- :func:`online_dpo_loss`  token_logp, mask, rewards, ref_logp, group_ids -- DPO on the
  best-vs-worst response of each group (beta is the DPO temperature; no KL-shaped reward).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from tba.objectives.common import (
    CLIP_EPS,
    TokenBatch,
    check_positive,
    clipped_objective,
    group_mean,
    masked,
    shaped_rewards,
    validate_grouped,
)

# ----------------------------------------------------------------------------- helpers


def _group_size(group_ids: Tensor) -> Tensor:
    """Per-element size K of the group each element belongs to (as float32)."""
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    return counts[inverse].float()


def _group_std(values: Tensor, group_ids: Tensor) -> Tensor:
    """Per-element population std (unbiased=False) of ``values`` over its group."""
    centred = values - group_mean(values, group_ids)
    return group_mean(centred.pow(2), group_ids).sqrt()


def _token_ppo(
    batch: TokenBatch,
    beta: float,
    clip_eps: float,
    standardise: bool,
    eps_std: float = 0.0,
    kl_logp: Tensor | None = None,
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """Shared (Dr.) GRPO body: masked per-token objective ``mask * o`` (N, T), lengths, stats."""
    token_logp, behaviour_token_logp, mask = batch.token_logp, batch.behaviour(), batch.mask
    rewards, (ref_logp, group_ids) = batch.rewards, batch.grouped()
    validate_grouped(
        mask,
        group_ids,
        {"token_logp": token_logp, "behaviour_token_logp": behaviour_token_logp},
        {"rewards": rewards, "ref_logp": ref_logp},
    )
    check_positive("beta", beta, allow_zero=True)
    check_positive("clip_eps", clip_eps)
    mask = mask.bool()
    token_logp = masked(token_logp, mask)
    log_ratio = token_logp - masked(behaviour_token_logp.detach(), mask)

    r_tilde, kl = shaped_rewards(rewards, token_logp.sum(dim=1), ref_logp, beta, kl_logp)
    advantage = r_tilde - group_mean(r_tilde, group_ids)
    if standardise:
        advantage = advantage / (_group_std(r_tilde, group_ids) + eps_std)
    objective, clipped = clipped_objective(log_ratio, advantage[:, None], clip_eps)
    objective = objective.masked_fill(~mask, 0.0)

    lengths = mask.sum(dim=1).float()
    stats = {
        "advantage_abs_mean": advantage.abs().mean(),
        "clip_frac": (clipped & mask).sum().float() / lengths.sum(),
        "kl": kl.mean(),
    }
    return objective, lengths, stats


def _rloo_advantage(r_tilde: Tensor, group_ids: Tensor) -> Tensor:
    """``A_i = r_tilde_i - mean_{j in g(i), j != i} r_tilde_j = K/(K-1) (r_tilde_i - mean_g)``."""
    size = _group_size(group_ids)
    return size / (size - 1.0) * (r_tilde - group_mean(r_tilde, group_ids))


# ----------------------------------------------------------------------------- losses


def dr_grpo_loss(
    batch: TokenBatch, *, beta: float, clip_eps: float = CLIP_EPS, kl_logp: Tensor | None = None
) -> tuple[Tensor, dict[str, Tensor]]:
    """Dr. GRPO: PPO-clip with a group-mean baseline, no std and no length normalisation.

        A_i       = r_tilde_i - mean_{j in g(i)} r_tilde_j
        rho_it    = exp(token_logp_it - behaviour_token_logp_it)
        o_it      = min(rho_it A_i, clip(rho_it, 1 - eps, 1 + eps) A_i)
        loss      = -(1 / N) sum_{i,t} mask_it o_it

    Dr. GRPO divides the token sum by a constant rather than by each response's length; the
    constant only scales the gradient, and 1 puts it in the units of every other objective here
    (so `max_grad_norm` clips it alike). On-policy (rho = 1) the gradient w.r.t. each real token
    log-prob is ``-A_i / N``: REINFORCE with a mean baseline on the KL-shaped reward.

    Stats: ``advantage_abs_mean``, ``clip_frac`` (fraction of real tokens whose clipped branch
    is active, i.e. whose gradient is zeroed) and ``kl`` (mean of logp - ref_logp).
    ``kl_logp``: the summed log-probs in the KL term of ``r_tilde`` (default: the current
    policy's, detached; the behaviour policy's fix it when the sample was drawn, as TRL does).
    """
    objective, _, stats = _token_ppo(batch, beta, clip_eps, standardise=False, kl_logp=kl_logp)
    loss = -objective.sum() / objective.shape[0]
    return loss, stats


def grpo_loss(
    batch: TokenBatch,
    *,
    beta: float,
    clip_eps: float = CLIP_EPS,
    eps_std: float = 1e-4,
    kl_logp: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GRPO: PPO-clip with a group-standardised advantage and per-response length normalisation.

        A_i    = (r_tilde_i - mean_g r_tilde) / (std_g r_tilde + eps_std)   (population std)
        o_it   = min(rho_it A_i, clip(rho_it, 1 - eps, 1 + eps) A_i),   rho_it as in Dr. GRPO
        loss   = -(1/N) sum_i (1/|y_i|) sum_t mask_it o_it,             |y_i| = sum_t mask_it

    On-policy the gradient w.r.t. each real token log-prob is ``-A_i / (N |y_i|)``.
    Stats and ``kl_logp`` as :func:`dr_grpo_loss`.
    """
    check_positive("eps_std", eps_std)
    objective, lengths, stats = _token_ppo(batch, beta, clip_eps, standardise=True,
                                           eps_std=eps_std, kl_logp=kl_logp)  # fmt: skip
    loss = -(objective.sum(dim=1) / lengths).mean()
    return loss, stats


def rloo_loss(
    batch: TokenBatch, *, beta: float, kl_logp: Tensor | None = None
) -> tuple[Tensor, dict[str, Tensor]]:
    """On-policy REINFORCE with the leave-one-out (RLOO) baseline on the KL-shaped reward.

        A_i  = r_tilde_i - mean_{j in g(i), j != i} r_tilde_j = K/(K-1) (r_tilde_i - mean_g r_tilde)
        loss = -(1/N) sum_i A_i logp_i                  (K: size of the group of i)

    The gradient w.r.t. each real token log-prob of sequence i is ``-A_i / N``.
    Stats: ``advantage_abs_mean`` and ``kl``; ``kl_logp`` as in :func:`dr_grpo_loss`.
    """
    token_logp, mask, rewards = batch.token_logp, batch.mask, batch.rewards
    ref_logp, group_ids = batch.grouped()
    validate_grouped(
        mask, group_ids, {"token_logp": token_logp}, {"rewards": rewards, "ref_logp": ref_logp}
    )
    check_positive("beta", beta, allow_zero=True)
    logp = masked(token_logp, mask.bool()).sum(dim=1)
    r_tilde, kl = shaped_rewards(rewards, logp, ref_logp, beta, kl_logp)
    advantage = _rloo_advantage(r_tilde, group_ids)
    loss = -(advantage * logp).mean()
    return loss, {"advantage_abs_mean": advantage.abs().mean(), "kl": kl.mean()}


def proximal_rloo_loss(
    batch: TokenBatch, *, beta: float, clip_eps: float = CLIP_EPS, kl_logp: Tensor | None = None
) -> tuple[Tensor, dict[str, Tensor]]:
    """RLOO with a clipped sequence-level importance ratio to the behaviour policy (off-policy).

        A_i     = K/(K-1) (r_tilde_i - mean_g r_tilde)                   (as in :func:`rloo_loss`)
        rho_i   = exp(clamp(logp_i - behaviour_logp_i, -20, 20)),  behaviour_logp_i = masked sum
        loss    = -(1/N) sum_i min(rho_i A_i, clip(rho_i, 1 - eps, 1 + eps) A_i)

    The ratio is per sequence, not per token: the REINFORCE estimator's reward is a property of
    the whole response, so the correct importance weight for a sample drawn from the behaviour
    policy is ``pi(y|x) / mu(y|x)``, the product of the token ratios. It is computed in log space
    (difference of summed log-probs) and exponentiated only at the end; the log-ratio is clamped
    to [-20, 20] first, because a product of many token ratios overflows float32 easily (the
    clamp is inactive for any ratio in the clip range, so it only affects gradient-free cases or
    pathologically stale samples). On-policy (rho = 1) the gradient equals that of
    :func:`rloo_loss`, ``-A_i / N`` per real token.

    Stats: ``advantage_abs_mean``, ``clip_frac`` (fraction of *sequences* whose clipped branch is
    active) and ``kl``; ``kl_logp`` as in :func:`dr_grpo_loss`.
    """
    token_logp, behaviour_token_logp, mask = batch.token_logp, batch.behaviour(), batch.mask
    rewards, (ref_logp, group_ids) = batch.rewards, batch.grouped()
    validate_grouped(
        mask,
        group_ids,
        {"token_logp": token_logp, "behaviour_token_logp": behaviour_token_logp},
        {"rewards": rewards, "ref_logp": ref_logp},
    )
    check_positive("beta", beta, allow_zero=True)
    check_positive("clip_eps", clip_eps)
    mask = mask.bool()
    logp = masked(token_logp, mask).sum(dim=1)
    behaviour_logp = masked(behaviour_token_logp.detach(), mask).sum(dim=1)
    r_tilde, kl = shaped_rewards(rewards, logp, ref_logp, beta, kl_logp)
    advantage = _rloo_advantage(r_tilde, group_ids)
    objective, clipped = clipped_objective(logp - behaviour_logp, advantage, clip_eps)
    loss = -objective.mean()
    stats = {
        "advantage_abs_mean": advantage.abs().mean(),
        "clip_frac": clipped.float().mean(),
        "kl": kl.mean(),
    }
    return loss, stats


def _first_index_where(flag: Tensor, inverse: Tensor, num_groups: int) -> Tensor:
    """Per group, the smallest batch index i with ``flag[i]`` (all groups must have one)."""
    index = torch.arange(flag.numel(), device=flag.device)
    first = torch.full((num_groups,), flag.numel(), dtype=torch.long, device=flag.device)
    return first.scatter_reduce_(0, inverse[flag], index[flag], reduce="amin")


def online_dpo_loss(batch: TokenBatch, *, beta: float) -> tuple[Tensor, dict[str, Tensor]]:
    """Online DPO on the best-vs-worst response of each group.

    In each group, w is the max-reward and l the min-reward response (ties: first in batch
    order); groups whose max and min rewards are equal are skipped. Over the P remaining groups

        loss = (1/P) sum_groups -log sigmoid(beta ((logp_w - ref_w) - (logp_l - ref_l)))

    with ``beta`` the DPO temperature (no KL-shaped reward here). With P = 0 the loss is a zero
    that is still connected to ``token_logp`` (``backward()`` works, giving zero gradients).

    Stats: ``pairs`` (P), ``margin`` (mean beta-scaled implicit reward margin over the pairs, 0
    if none) and ``kl``.
    """
    token_logp, mask, rewards = batch.token_logp, batch.mask, batch.rewards
    ref_logp, group_ids = batch.grouped()
    validate_grouped(
        mask, group_ids, {"token_logp": token_logp}, {"rewards": rewards, "ref_logp": ref_logp}
    )
    check_positive("beta", beta)
    logp = masked(token_logp, mask.bool()).sum(dim=1)
    log_ratio = logp - ref_logp.detach().float()
    rewards = rewards.detach().float()

    _, inverse = torch.unique(group_ids, return_inverse=True)
    num_groups = int(inverse.max()) + 1
    best_reward = rewards.new_full((num_groups,), -torch.inf).scatter_reduce_(
        0, inverse, rewards, reduce="amax"
    )
    worst_reward = rewards.new_full((num_groups,), torch.inf).scatter_reduce_(
        0, inverse, rewards, reduce="amin"
    )
    best = _first_index_where(rewards == best_reward[inverse], inverse, num_groups)
    worst = _first_index_where(rewards == worst_reward[inverse], inverse, num_groups)
    keep = best_reward > worst_reward
    margin = beta * (log_ratio[best[keep]] - log_ratio[worst[keep]])

    pairs = margin.numel()
    loss = -F.logsigmoid(margin).mean() if pairs > 0 else logp.sum() * 0.0
    stats = {
        "pairs": torch.tensor(float(pairs), device=logp.device),
        "margin": margin.detach().mean() if pairs > 0 else torch.zeros((), device=logp.device),
        "kl": log_ratio.detach().mean(),
    }
    return loss, stats
