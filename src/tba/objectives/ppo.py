"""Token-level PPO with a learned value, and VinePPO with Monte Carlo values instead of a critic.

Both work on per-token tensors (N, T), right-padded, with a 0/1 or boolean ``mask`` of real
response tokens (EOS included; every row needs >= 1). ``token_logp`` is the current policy's
per-token log-prob (the only input differentiated, with PPO's ``values``),
``behaviour_token_logp`` that of the policy that generated the sample, ``ref_token_logp`` the
reference policy's, and ``rewards`` the task's reward per sequence. The KL penalty is per token,
in the units of every other objective here (``beta`` times nats, reward units):

    kl_it = stopgrad(token_logp_it) - ref_token_logp_it      (or the behaviour log-probs: kl_logp)
    r_it  = -beta kl_it + [t = last real token of i] R_i

so that ``sum_t r_it = R_i - beta KL_i``, the KL-shaped reward of the baselines and TB's target.

- :func:`ppo_loss` -- GAE (gamma, lambda) on the critic's values, advantages whitened over the
  batch, PPO's clipped ratio to the behaviour policy, and the clipped value loss.
- :func:`vineppo_loss` -- the clipped ratio on each token's step advantage (from
  :func:`vine_advantages`, Monte Carlo values of step prefixes) plus the KL penalty to go.

Every loss is a sum over tokens divided by the number of sequences N, like Dr. GRPO's: the mean
over sequences of a per-sequence quantity, so that micro-batches add up to the batch exactly.
"""

from __future__ import annotations

import torch
from torch import Tensor

from tba.objectives.common import check_positive, clipped_objective, masked, validate_tokens

WHITEN_EPS = 1e-8


# ----------------------------------------------------------------------------- pieces


def token_rewards(rewards: Tensor, token_kl: Tensor, mask: Tensor, beta: float) -> Tensor:
    """Per-token rewards (N, T): ``r_t = -beta kl_t``, plus ``R`` at the last real token; 0 on
    padding. ``mask`` is right-padded (real tokens first)."""
    mask = mask.bool()
    last = mask.sum(dim=1, keepdim=True) - 1
    out = (-beta * token_kl).masked_fill(~mask, 0.0)
    return out.scatter_add(1, last, rewards.to(out.dtype)[:, None])


def gae(
    rewards: Tensor, values: Tensor, mask: Tensor, gamma: float = 1.0, lam: float = 0.95
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation on right-padded per-token ``rewards`` and ``values``
    (N, T), ``values[t] = V(s_t)``, the state before token t:

        delta_t = r_t + gamma V(s_{t+1}) - V(s_t)      V(s_{T_i}) = 0 after the last real token
        A_t     = sum_{l >= 0} (gamma lam)^l delta_{t+l}       (over real tokens)
        G_t     = A_t + V(s_t)                                  (the value targets)

    Returns ``(A, G)``, 0 on padding. lam = 1 gives the discounted reward-to-go minus V, lam = 0
    the one-step TD error. Whatever padding holds is ignored."""
    mask = mask.bool()
    rewards = rewards.masked_fill(~mask, 0.0)
    values = values.masked_fill(~mask, 0.0)
    advantages = torch.zeros_like(values)
    next_value = values.new_zeros(values.shape[0])
    next_advantage = values.new_zeros(values.shape[0])
    for t in reversed(range(values.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantages[:, t] = (delta + gamma * lam * next_advantage) * mask[:, t]
        next_value, next_advantage = values[:, t], advantages[:, t]
    return advantages, (advantages + values).masked_fill(~mask, 0.0)


def whiten(values: Tensor, mask: Tensor, eps: float = WHITEN_EPS) -> Tensor:
    """``(x - mean) / sqrt(var + eps)`` with the mean and (population) variance over every real
    token of the batch; 0 on padding."""
    mask = mask.bool()
    real = values[mask]
    mean = real.mean()
    var = (real - mean).pow(2).mean()
    return ((values - mean) * torch.rsqrt(var + eps)).masked_fill(~mask, 0.0)


def clipped_value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, clip: float
) -> tuple[Tensor, Tensor]:
    """PPO's clipped value loss per token (N, T), 0 on padding, and where the clipped branch is
    the larger one (its gradient then goes through the clip, zero outside the band):

        V_clip = V_old + clamp(V - V_old, -clip, clip)
        l_t    = 1/2 max((V - G)^2, (V_clip - G)^2)
    """
    mask = mask.bool()
    old_values, returns = old_values.detach(), returns.detach()
    clipped_values = old_values + (values - old_values).clamp(-clip, clip)
    plain = (values - returns).pow(2)
    clipped_loss = (clipped_values - returns).pow(2)
    clipped = (clipped_loss > plain) & mask
    loss = 0.5 * torch.where(clipped, clipped_loss, plain)
    return loss.masked_fill(~mask, 0.0), clipped


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> Tensor:
    """``1 - Var(G - V) / Var(G)`` over real tokens: 1 for a perfect critic, 0 for a constant
    one (NaN when every return is the same)."""
    mask = mask.bool()
    target = returns.detach()[mask]
    residual = target - values.detach()[mask]
    return 1.0 - residual.var(unbiased=False) / target.var(unbiased=False)


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


def _token_kl(
    token_logp: Tensor, ref_token_logp: Tensor, mask: Tensor, kl_token_logp: Tensor | None
) -> Tensor:
    source = token_logp if kl_token_logp is None else kl_token_logp
    return masked(source.detach(), mask) - masked(ref_token_logp.detach(), mask)


# ----------------------------------------------------------------------------- losses


def ppo_loss(
    token_logp: Tensor,
    behaviour_token_logp: Tensor,
    mask: Tensor,
    rewards: Tensor,
    ref_token_logp: Tensor,
    values: Tensor,
    *,
    beta: float,
    clip_eps: float = 0.2,
    gamma: float = 1.0,
    gae_lambda: float = 0.95,
    value_clip: float = 0.2,
    value_coef: float = 0.1,
    old_values: Tensor | None = None,
    kl_token_logp: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Token-level PPO with a learned value (``values``: the critic's V(s_t), (N, T)).

        r_t       per-token rewards (module docstring); V_old = stopgrad(old_values or values)
        A, G      = gae(r, V_old, gamma, gae_lambda)             (G: the value targets)
        A_w       = (A - mean A) / std A                          over every real token
        rho_t     = exp(token_logp_t - behaviour_token_logp_t)
        policy    = -(1/N) sum_{i,t} min(rho A_w, clip(rho, 1 - eps, 1 + eps) A_w)
        value     =  (1/N) sum_{i,t} 1/2 max((V - G)^2, (V_old + clip(V - V_old, +-c) - G)^2)
        loss      = policy + value_coef * value

    ``kl_token_logp``: the log-probs of the KL term (default the current policy's, detached; the
    behaviour policy's fix it when the sample was drawn). Stats: ``policy_loss``,
    ``value_loss``, ``explained_variance``, ``advantage_mean`` and ``advantage_std`` (before
    whitening), ``value_mean``, ``clip_frac``, ``value_clip_frac`` (shares of real tokens) and
    ``kl`` (mean summed KL per sequence).
    """
    validate_tokens(
        mask,
        {"token_logp": token_logp, "behaviour_token_logp": behaviour_token_logp,
         "ref_token_logp": ref_token_logp, "values": values},
        {"rewards": rewards},
    )  # fmt: skip
    check_positive("beta", beta, allow_zero=True)
    check_positive("clip_eps", clip_eps)
    check_positive("value_clip", value_clip)
    if not 0.0 <= gae_lambda <= 1.0 or not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma and gae_lambda must lie in [0, 1], got {gamma}, {gae_lambda}")
    mask = mask.bool()
    n = mask.shape[0]
    token_logp = masked(token_logp, mask)
    token_kl = _token_kl(token_logp, ref_token_logp, mask, kl_token_logp)
    old = masked((values if old_values is None else old_values).detach(), mask)
    advantages, returns = gae(token_rewards(rewards, token_kl, mask, beta), old, mask, gamma,
                              gae_lambda)  # fmt: skip
    log_ratio = token_logp - masked(behaviour_token_logp.detach(), mask)
    objective, clipped = clipped_objective(log_ratio, whiten(advantages, mask), clip_eps)
    policy_loss = -objective.masked_fill(~mask, 0.0).sum() / n
    value_terms, value_clipped = clipped_value_loss(masked(values, mask), old, returns, mask,
                                                    value_clip)  # fmt: skip
    value_loss = value_terms.sum() / n
    tokens = mask.sum().float()
    real_advantages = advantages[mask]
    stats = {
        "policy_loss": policy_loss.detach(),
        "value_loss": value_loss.detach(),
        "explained_variance": explained_variance(values, returns, mask),
        "advantage_mean": real_advantages.mean(),
        "advantage_std": real_advantages.std(unbiased=False),
        "value_mean": old[mask].mean(),
        "clip_frac": (clipped & mask).sum() / tokens,
        "value_clip_frac": value_clipped.sum() / tokens,
        "kl": token_kl.sum(dim=1).mean(),
    }
    return policy_loss + value_coef * value_loss, stats


def vineppo_loss(
    token_logp: Tensor,
    behaviour_token_logp: Tensor,
    mask: Tensor,
    step_advantages: Tensor,
    ref_token_logp: Tensor,
    *,
    beta: float,
    clip_eps: float = 0.2,
    kl_token_logp: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """VinePPO: PPO's clipped ratio on each token's step advantage (``step_advantages`` (N, T),
    :func:`vine_advantages`: Monte Carlo values of the task reward) and the KL penalty to go:

        A_t    = A_step(t) - beta sum_{t' >= t} kl_t'
        loss   = -(1/N) sum_{i,t} min(rho_t A_t, clip(rho_t, 1 - eps, 1 + eps) A_t)

    The Monte Carlo values estimate the task reward only, so the KL part of the return keeps no
    baseline (it is known exactly for the sampled response). No whitening: the advantages are in
    reward units. ``kl_token_logp`` as in :func:`ppo_loss`. Stats: ``advantage_mean``,
    ``advantage_std``, ``clip_frac`` and ``kl``.
    """
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
    token_kl = _token_kl(token_logp, ref_token_logp, mask, kl_token_logp)
    advantages = masked(step_advantages.detach(), mask) - beta * reward_to_go(token_kl, mask)
    log_ratio = token_logp - masked(behaviour_token_logp.detach(), mask)
    objective, clipped = clipped_objective(log_ratio, advantages, clip_eps)
    loss = -objective.masked_fill(~mask, 0.0).sum() / mask.shape[0]
    real = advantages[mask]
    stats = {
        "advantage_mean": real.mean(),
        "advantage_std": real.std(unbiased=False),
        "clip_frac": (clipped & mask).sum() / mask.sum(),
        "kl": token_kl.sum(dim=1).mean(),
    }
    return loss, stats
