"""Baseline RL post-training objectives, for comparison with Trajectory Balance.

All losses are pure functions on a batch of N responses, each belonging to a prompt group given by
integer ``group_ids`` (any values, any order; every group needs >= 2 members). Per-token tensors
are (N, T), right-padded, with a 0/1 or boolean ``mask`` of real response tokens (EOS included;
every row needs >= 1). ``token_logp`` is the current policy's per-token log-prob (the only input
that is differentiated), ``behaviour_token_logp`` the per-token log-prob under the policy that
generated the sample (equal to ``token_logp.detach()`` on-policy), ``rewards`` and ``ref_logp``
(summed reference log-prob) are per sequence. Except for DPO, the reward is KL-shaped so that
every method targets the same distribution as TB, ``pi_ref(y|x) exp(r / beta)``:

    logp_i    = sum_t mask_it token_logp_it
    r_tilde_i = r_i - beta * stopgrad(logp_i - ref_logp_i)          (beta = 0 disables it)

Losses (each returns ``(loss, stats)``: a scalar float32 loss, computed in float32, and a small
dict of detached float metrics):

- :func:`dr_grpo_loss`  token_logp, behaviour_token_logp, mask, rewards, ref_logp, group_ids, beta
  -- PPO-clip with group-mean baseline, no std or length normalisation (Dr. GRPO).
- :func:`grpo_loss`  same inputs -- PPO-clip with group-standardised advantage, per-response
  length normalisation (GRPO).
- :func:`rloo_loss`  token_logp, mask, rewards, ref_logp, group_ids, beta -- on-policy REINFORCE
  with the leave-one-out baseline.
- :func:`proximal_rloo_loss`  token_logp, behaviour_token_logp, mask, rewards, ref_logp,
  group_ids, beta -- RLOO with a clipped sequence-level importance ratio, for off-policy data.
- :func:`online_dpo_loss`  token_logp, mask, rewards, ref_logp, group_ids, beta -- DPO on the
  best-vs-worst response of each group (beta is the DPO temperature; no KL-shaped reward).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from tba.objectives.tb import group_mean

LOG_RATIO_CLAMP = 20.0  # |log importance ratio| is clamped to this before exp (ratio <= ~4.9e8)


# ----------------------------------------------------------------------------- helpers


def _validate(
    mask: Tensor, group_ids: Tensor, per_token: dict[str, Tensor], per_seq: dict[str, Tensor]
) -> None:
    """Raise ``ValueError`` unless the inputs form a valid grouped batch of N x T tokens."""
    if mask.dim() != 2:
        raise ValueError(f"mask must be 2-D (N, T), got shape {tuple(mask.shape)}")
    for name, tensor in per_token.items():
        if tensor.shape != mask.shape:
            raise ValueError(
                f"{name} must have the shape of mask {tuple(mask.shape)}, got {tuple(tensor.shape)}"
            )
    n = mask.shape[0]
    for name, tensor in {**per_seq, "group_ids": group_ids}.items():
        if tensor.shape != (n,):
            raise ValueError(f"{name} must have shape (N,) = ({n},), got {tuple(tensor.shape)}")
    if n == 0:
        raise ValueError("the loss needs a non-empty batch")
    if group_ids.is_floating_point() or group_ids.is_complex():
        raise ValueError(f"group_ids must be an integer tensor, got {group_ids.dtype}")
    if not ((mask == 0) | (mask == 1)).all():
        raise ValueError("mask must be boolean or contain only 0 and 1")
    empty = (~mask.bool().any(dim=1)).nonzero().flatten()
    if empty.numel() > 0:
        raise ValueError(f"every sequence needs >= 1 real token; empty rows: {empty.tolist()}")
    ids, counts = torch.unique(group_ids, return_counts=True)
    small = ids[counts < 2]
    if small.numel() > 0:
        raise ValueError(
            "every group needs >= 2 sequences for a baseline; "
            f"singleton group ids: {small.tolist()}"
        )


def _check_positive(name: str, value: float, allow_zero: bool = False) -> None:
    if not (value >= 0 if allow_zero else value > 0):
        raise ValueError(f"{name} must be {'>=' if allow_zero else '>'} 0, got {value}")


def _masked(token_values: Tensor, mask: Tensor) -> Tensor:
    """float32 copy with padding set to 0 (padding may hold anything, even -inf)."""
    return token_values.float().masked_fill(~mask, 0.0)


def _group_size(group_ids: Tensor) -> Tensor:
    """Per-element size K of the group each element belongs to (as float32)."""
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    return counts[inverse].float()


def _group_std(values: Tensor, group_ids: Tensor) -> Tensor:
    """Per-element population std (unbiased=False) of ``values`` over its group."""
    centred = values - group_mean(values, group_ids)
    return group_mean(centred.pow(2), group_ids).sqrt()


def _shaped_rewards(
    rewards: Tensor, logp: Tensor, ref_logp: Tensor, beta: float
) -> tuple[Tensor, Tensor]:
    """``(r_tilde, kl)`` with ``kl = stopgrad(logp - ref_logp)`` and ``r_tilde = r - beta kl``."""
    kl = logp.detach() - ref_logp.detach().float()
    return rewards.detach().float() - beta * kl, kl


def _clipped_objective(
    log_ratio: Tensor, advantage: Tensor, clip_eps: float
) -> tuple[Tensor, Tensor]:
    """PPO-clip ``o = min(rho A, clip(rho, 1-eps, 1+eps) A)`` with ``rho = exp(log_ratio)``.

    Returns ``(o, clipped)``, where ``clipped`` marks entries whose clipped branch is active
    (strictly smaller, so their gradient is zero). The log-ratio is clamped to
    ``[-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP]`` before ``exp`` so a stale sample cannot overflow.
    """
    ratio = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
    unclipped = ratio * advantage
    clipped_value = ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps) * advantage
    clipped = clipped_value < unclipped
    return torch.where(clipped, clipped_value, unclipped), clipped


def _token_ppo(
    token_logp: Tensor,
    behaviour_token_logp: Tensor,
    mask: Tensor,
    rewards: Tensor,
    ref_logp: Tensor,
    group_ids: Tensor,
    beta: float,
    clip_eps: float,
    standardise: bool,
    eps_std: float = 0.0,
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """Shared (Dr.) GRPO body: masked per-token objective ``mask * o`` (N, T), lengths, stats."""
    _validate(
        mask,
        group_ids,
        {"token_logp": token_logp, "behaviour_token_logp": behaviour_token_logp},
        {"rewards": rewards, "ref_logp": ref_logp},
    )
    _check_positive("beta", beta, allow_zero=True)
    _check_positive("clip_eps", clip_eps)
    mask = mask.bool()
    token_logp = _masked(token_logp, mask)
    log_ratio = token_logp - _masked(behaviour_token_logp.detach(), mask)

    r_tilde, kl = _shaped_rewards(rewards, token_logp.sum(dim=1), ref_logp, beta)
    advantage = r_tilde - group_mean(r_tilde, group_ids)
    if standardise:
        advantage = advantage / (_group_std(r_tilde, group_ids) + eps_std)
    objective, clipped = _clipped_objective(log_ratio, advantage[:, None], clip_eps)
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
    token_logp: Tensor,
    behaviour_token_logp: Tensor,
    mask: Tensor,
    rewards: Tensor,
    ref_logp: Tensor,
    group_ids: Tensor,
    *,
    beta: float,
    clip_eps: float = 0.2,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Dr. GRPO: PPO-clip with a group-mean baseline, no std and no length normalisation.

        A_i       = r_tilde_i - mean_{j in g(i)} r_tilde_j
        rho_it    = exp(token_logp_it - behaviour_token_logp_it)
        o_it      = min(rho_it A_i, clip(rho_it, 1 - eps, 1 + eps) A_i)
        loss      = -(1 / (N T_max)) sum_{i,t} mask_it o_it,      T_max = mask.shape[1]

    On-policy (rho = 1) the gradient w.r.t. each real token log-prob is ``-A_i / (N T_max)``:
    REINFORCE with a mean baseline on the KL-shaped reward, scaled by the constant ``1/T_max``.

    Stats: ``advantage_abs_mean``, ``clip_frac`` (fraction of real tokens whose clipped branch
    is active, i.e. whose gradient is zeroed) and ``kl`` (mean of logp - ref_logp).
    """
    objective, _, stats = _token_ppo(
        token_logp,
        behaviour_token_logp,
        mask,
        rewards,
        ref_logp,
        group_ids,
        beta,
        clip_eps,
        standardise=False,
    )
    loss = -objective.sum() / objective.numel()
    return loss, stats


def grpo_loss(
    token_logp: Tensor,
    behaviour_token_logp: Tensor,
    mask: Tensor,
    rewards: Tensor,
    ref_logp: Tensor,
    group_ids: Tensor,
    *,
    beta: float,
    clip_eps: float = 0.2,
    eps_std: float = 1e-4,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GRPO: PPO-clip with a group-standardised advantage and per-response length normalisation.

        A_i    = (r_tilde_i - mean_g r_tilde) / (std_g r_tilde + eps_std)   (population std)
        o_it   = min(rho_it A_i, clip(rho_it, 1 - eps, 1 + eps) A_i),   rho_it as in Dr. GRPO
        loss   = -(1/N) sum_i (1/|y_i|) sum_t mask_it o_it,             |y_i| = sum_t mask_it

    On-policy the gradient w.r.t. each real token log-prob is ``-A_i / (N |y_i|)``.
    Stats as :func:`dr_grpo_loss`.
    """
    _check_positive("eps_std", eps_std)
    objective, lengths, stats = _token_ppo(
        token_logp,
        behaviour_token_logp,
        mask,
        rewards,
        ref_logp,
        group_ids,
        beta,
        clip_eps,
        standardise=True,
        eps_std=eps_std,
    )
    loss = -(objective.sum(dim=1) / lengths).mean()
    return loss, stats


def rloo_loss(
    token_logp: Tensor,
    mask: Tensor,
    rewards: Tensor,
    ref_logp: Tensor,
    group_ids: Tensor,
    *,
    beta: float,
) -> tuple[Tensor, dict[str, Tensor]]:
    """On-policy REINFORCE with the leave-one-out (RLOO) baseline on the KL-shaped reward.

        A_i  = r_tilde_i - mean_{j in g(i), j != i} r_tilde_j = K/(K-1) (r_tilde_i - mean_g r_tilde)
        loss = -(1/N) sum_i A_i logp_i                  (K: size of the group of i)

    The gradient w.r.t. each real token log-prob of sequence i is ``-A_i / N``.
    Stats: ``advantage_abs_mean`` and ``kl``.
    """
    _validate(
        mask, group_ids, {"token_logp": token_logp}, {"rewards": rewards, "ref_logp": ref_logp}
    )
    _check_positive("beta", beta, allow_zero=True)
    logp = _masked(token_logp, mask.bool()).sum(dim=1)
    r_tilde, kl = _shaped_rewards(rewards, logp, ref_logp, beta)
    advantage = _rloo_advantage(r_tilde, group_ids)
    loss = -(advantage * logp).mean()
    return loss, {"advantage_abs_mean": advantage.abs().mean(), "kl": kl.mean()}


def proximal_rloo_loss(
    token_logp: Tensor,
    behaviour_token_logp: Tensor,
    mask: Tensor,
    rewards: Tensor,
    ref_logp: Tensor,
    group_ids: Tensor,
    *,
    beta: float,
    clip_eps: float = 0.2,
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
    active) and ``kl``.
    """
    _validate(
        mask,
        group_ids,
        {"token_logp": token_logp, "behaviour_token_logp": behaviour_token_logp},
        {"rewards": rewards, "ref_logp": ref_logp},
    )
    _check_positive("beta", beta, allow_zero=True)
    _check_positive("clip_eps", clip_eps)
    mask = mask.bool()
    logp = _masked(token_logp, mask).sum(dim=1)
    behaviour_logp = _masked(behaviour_token_logp.detach(), mask).sum(dim=1)
    r_tilde, kl = _shaped_rewards(rewards, logp, ref_logp, beta)
    advantage = _rloo_advantage(r_tilde, group_ids)
    objective, clipped = _clipped_objective(logp - behaviour_logp, advantage, clip_eps)
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


def online_dpo_loss(
    token_logp: Tensor,
    mask: Tensor,
    rewards: Tensor,
    ref_logp: Tensor,
    group_ids: Tensor,
    *,
    beta: float,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Online DPO on the best-vs-worst response of each group.

    In each group, w is the max-reward and l the min-reward response (ties: first in batch
    order); groups whose max and min rewards are equal are skipped. Over the P remaining groups

        loss = (1/P) sum_groups -log sigmoid(beta ((logp_w - ref_w) - (logp_l - ref_l)))

    with ``beta`` the DPO temperature (no KL-shaped reward here). With P = 0 the loss is a zero
    that is still connected to ``token_logp`` (``backward()`` works, giving zero gradients).

    Stats: ``pairs`` (P), ``margin`` (mean beta-scaled implicit reward margin over the pairs, 0
    if none) and ``kl``.
    """
    _validate(
        mask, group_ids, {"token_logp": token_logp}, {"rewards": rewards, "ref_logp": ref_logp}
    )
    _check_positive("beta", beta)
    logp = _masked(token_logp, mask.bool()).sum(dim=1)
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
