"""Token-level PPO with a learned value: PPO's clipped surrogate (Schulman et al., *Proximal
Policy Optimization Algorithms*, arXiv 1707.06347) on advantages from generalised advantage
estimation (Schulman et al., *High-Dimensional Continuous Control Using Generalized Advantage
Estimation*, arXiv 1506.02438) over a critic's values, with its clipped value loss.

Per-token tensors are (N, T), right-padded, with a 0/1 or boolean ``mask`` of real response
tokens (EOS included; every row needs >= 1). ``token_logp`` is the current policy's per-token
log-prob (the only input differentiated, with ``values``), ``behaviour_token_logp`` that of the
policy that generated the sample, ``ref_token_logp`` the reference policy's, and ``rewards`` the
task's reward per sequence. The KL penalty is per token, in the units of every other objective
(``beta`` times nats, reward units; VinePPO's is the same, :mod:`tba.objectives.vineppo`):

    kl_it = stopgrad(token_logp_it) - ref_token_logp_it      (or the behaviour log-probs: kl_logp)
    r_it  = -beta kl_it + [t = last real token of i] R_i

so that ``sum_t r_it = R_i - beta KL_i``, the KL-shaped reward of the baselines and TB's target.

- :class:`ValueHead` -- the critic's learned part: V(s_t) = w . h_t + b on an LM's last hidden
  states, started at zero. Which LM it reads (the policy's own forward pass, or a separate
  trainable copy of the policy with its fp32 master weights) is model plumbing, which this layer
  cannot import: `tba.policy.values.Critic` wraps this head with it.
- :func:`ppo_loss` -- GAE (gamma, lambda) on the critic's values at the sample's first use
  (V_old), advantages whitened over the batch, PPO's clipped ratio to the behaviour policy, and
  the value loss clipped around V_old: a sum over tokens divided by the number of sequences N,
  like Dr. GRPO's, so that micro-batches add up to the batch exactly.
- :class:`PPOSettings` -- its own settings, the section `train.ppo`: the critic's kind and
  learning rates, GAE's lambda and the value loss's clip and weight.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field
from torch import Tensor

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

WHITEN_EPS = 1e-8
# The defaults of `ppo_loss` and of their settings in `train.ppo`.
GAE_LAMBDA = 0.95
VALUE_CLIP = 0.2
VALUE_COEF = 0.1


class PPOSettings(Section):
    """PPO's critic and value loss (`train.loss=ppo`)."""

    value_model: Literal["head", "critic"] = Field(
        "head", description="ppo: the critic is a linear head on the policy's last hidden "
        "state (the value loss also trains the policy's layers) or on a separate `critic` LM, "
        "a trainable copy of the starting policy (trained at train.ppo.critic_lr)",
    )
    value_lr: float = Field(1e-3, gt=0, description="ppo: Adam learning rate of the value head")
    critic_lr: float | None = Field(
        None, gt=0, description="ppo: Adam learning rate of the separate critic LM "
        "(value_model=critic; null: train.learning_rate). On the built-in math task a critic "
        "at 3e-4 learned faster than at the policy's rate (docs/objective.md)",
    )
    gae_lambda: float = Field(
        GAE_LAMBDA, ge=0, le=1, description="ppo: lambda of GAE (gamma is 1; 1: Monte Carlo "
        "returns)"
    )
    value_clip: float = Field(
        VALUE_CLIP, gt=0, description="ppo: the value loss's clip around V_old, the critic's "
        "values at the sample's first use in training (binds on its later uses: "
        "buffer.fresh_uses > 1, replay)",
    )
    value_coef: float = Field(VALUE_COEF, ge=0, description="ppo: weight of the value loss")


# ----------------------------------------------------------------------------- pieces


def token_rewards(rewards: Tensor, token_kl: Tensor, mask: Tensor, beta: float) -> Tensor:
    """Per-token rewards (N, T): ``r_t = -beta kl_t``, plus ``R`` at the last real token; 0 on
    padding. ``mask`` is right-padded (real tokens first)."""
    mask = mask.bool()
    last = mask.sum(dim=1, keepdim=True) - 1
    out = (-beta * token_kl).masked_fill(~mask, 0.0)
    return out.scatter_add(1, last, rewards.to(out.dtype)[:, None])


def gae(
    rewards: Tensor, values: Tensor, mask: Tensor, gamma: float = 1.0, lam: float = GAE_LAMBDA
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
    spread = target.var(unbiased=False)
    if spread == 0:  # nothing to explain: undefined, not -inf
        return torch.full_like(spread, float("nan"))
    return 1.0 - residual.var(unbiased=False) / spread


# ----------------------------------------------------------------------------- the critic


class ValueHead(torch.nn.Linear):
    """PPO's critic on an LM's last hidden states (N, T, H): ``V(s_t) = w . h_t + b``, read at
    the position of the logits that predict response token t, so that s_t is the prompt and the
    response's first t tokens. Started at zero: the first values are 0 whatever the hidden
    states. A linear layer (H -> 1), so its weights are those of ``torch.nn.Linear``."""

    def __init__(self, width: int, device: torch.device | None = None) -> None:
        super().__init__(width, 1, device=device)
        torch.nn.init.zeros_(self.weight)
        torch.nn.init.zeros_(self.bias)

    def forward(self, hidden: Tensor, lengths: Tensor) -> Tensor:
        """V(s_t) for every response token (N, T), fp32, 0 past each response's ``lengths``."""
        real = torch.arange(hidden.size(1), device=hidden.device) < lengths[:, None]
        return super().forward(hidden.float()).squeeze(-1) * real


# ----------------------------------------------------------------------------- losses


def ppo_loss(
    batch: TokenBatch,
    values: Tensor,
    *,
    beta: float,
    clip_eps: float = CLIP_EPS,
    gamma: float = 1.0,
    gae_lambda: float = GAE_LAMBDA,
    value_clip: float = VALUE_CLIP,
    value_coef: float = VALUE_COEF,
    old_values: Tensor | None = None,
    kl_token_logp: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Token-level PPO with a learned value (``values``: the critic's V(s_t), (N, T)), on the
    batch's ``token_logp``, ``behaviour_token_logp``, ``mask``, ``rewards`` and
    ``ref_token_logp``.

    ``old_values`` is PPO's V_old: the critic's values when the sample was first trained on
    (the trainer stores them with the sample, `tba.core.Sample.old_values`), given for every
    later use of it (``buffer.fresh_uses`` > 1, replay); None (a first use) takes ``values``
    detached. As in CleanRL's and TRL's PPO, whose advantages and returns are computed once per
    rollout from the rollout's values and reused across epochs and minibatches, GAE runs on V_old,
    so a sample keeps its value targets ``G`` across uses, and the value clip is around V_old: on
    a first use V = V_old and the clip cannot bind. (The rewards' KL term is the current policy's
    unless ``kl_token_logp`` fixes it at sampling; with it the advantages too are the first
    use's, whitening aside.)

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
    token_logp, behaviour_token_logp, mask = batch.token_logp, batch.behaviour(), batch.mask
    rewards, ref_token_logp = batch.rewards, batch.ref_tokens()
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
    kl = token_kl(token_logp, ref_token_logp, mask, kl_token_logp)
    old = masked((values if old_values is None else old_values).detach(), mask)
    advantages, returns = gae(token_rewards(rewards, kl, mask, beta), old, mask, gamma,
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
        "kl": kl.sum(dim=1).mean(),
    }
    return policy_loss + value_coef * value_loss, stats

