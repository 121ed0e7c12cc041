"""Pieces shared by the objectives: the micro-batch every loss takes (`TokenBatch`), per-prompt
group means, input checks, masking, the KL-shaped reward, the per-token KL penalty and the
PPO-style clipped surrogate. Every objective groups responses by an explicit integer prompt id,
never by reshaping a batch."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

LOG_RATIO_CLAMP = 20.0  # |log importance ratio| is clamped to this before exp (ratio <= ~4.9e8)
# The clipped ratio's band [1 - eps, 1 + eps] unless told otherwise: `train.clip_eps`'s default.
CLIP_EPS = 0.2


@dataclass
class TokenBatch:
    """N responses as the losses take them: per-token tensors (N, T), right-padded, with `mask`
    marking the real response tokens (EOS included; every row needs >= 1), and per-sequence
    tensors (N,). A loss reads what its formula needs; one it needs and the batch lacks is a
    `ValueError`."""

    token_logp: Tensor  # the current policy's (the input that is differentiated)
    mask: Tensor  # 0/1 or boolean
    rewards: Tensor  # the task's reward of each response
    behaviour_token_logp: Tensor | None = None  # the policy's that generated each sample
    ref_logp: Tensor | None = None  # the reference policy's, summed over each response
    group_ids: Tensor | None = None  # the integer prompt id of each response
    ref_token_logp: Tensor | None = None  # the reference policy's, per token

    def behaviour(self) -> Tensor:
        if self.behaviour_token_logp is None:
            raise ValueError("this loss needs per-token behaviour log-probs in every sample")
        return self.behaviour_token_logp

    def ref_tokens(self) -> Tensor:
        if self.ref_token_logp is None:
            raise ValueError("this loss needs per-token reference log-probs in every sample")
        return self.ref_token_logp

    def grouped(self) -> tuple[Tensor, Tensor]:
        """(ref_logp, group_ids): what a loss over groups reads beside the tokens."""
        if self.ref_logp is None or self.group_ids is None:
            raise ValueError("this loss needs each response's summed reference log-prob and its "
                             "group id")  # fmt: skip
        return self.ref_logp, self.group_ids


def group_mean(values: Tensor, group_ids: Tensor) -> Tensor:
    """Per-element mean of ``values`` over the group each element belongs to.

    ``out_i = mean_{j : g_j = g_i} values_j`` where ``g = group_ids``. Groups are formed by the
    explicit ids (any order, any values), never by reshaping. Differentiable in ``values``.
    """
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    sums = values.new_zeros(counts.numel()).index_add_(0, inverse, values)
    return (sums / counts.to(values.dtype))[inverse]


def validate_grouped(
    mask: Tensor,
    group_ids: Tensor,
    per_token: dict[str, Tensor],
    per_seq: dict[str, Tensor],
    singletons: bool = False,
) -> None:
    """Raise ``ValueError`` unless the inputs form a valid grouped batch of N x T tokens (every
    group with >= 2 members, unless `singletons` are allowed)."""
    validate_tokens(mask, per_token, {**per_seq, "group_ids": group_ids})
    check_group_ids(group_ids, singletons, "for a baseline")


def validate_tokens(mask: Tensor, per_token: dict[str, Tensor], per_seq: dict[str, Tensor]) -> None:
    """Raise ``ValueError`` unless the inputs form a valid batch of N x T tokens: per-token
    tensors of the mask's shape, per-sequence ones of shape (N,), a 0/1 mask with at least one
    real token in every row."""
    if mask.dim() != 2:
        raise ValueError(f"mask must be 2-D (N, T), got shape {tuple(mask.shape)}")
    for name, tensor in per_token.items():
        if tensor.shape != mask.shape:
            raise ValueError(
                f"{name} must have the shape of mask {tuple(mask.shape)}, got {tuple(tensor.shape)}"
            )
    n = mask.shape[0]
    for name, tensor in per_seq.items():
        if tensor.shape != (n,):
            raise ValueError(f"{name} must have shape (N,) = ({n},), got {tuple(tensor.shape)}")
    if n == 0:
        raise ValueError("the loss needs a non-empty batch")
    if not ((mask == 0) | (mask == 1)).all():
        raise ValueError("mask must be boolean or contain only 0 and 1")
    empty = (~mask.bool().any(dim=1)).nonzero().flatten()
    if empty.numel() > 0:
        raise ValueError(f"every sequence needs >= 1 real token; empty rows: {empty.tolist()}")


def check_group_ids(group_ids: Tensor, singletons: bool, purpose: str) -> None:
    """Integer ids, and (unless `singletons`) at least two sequences per group."""
    if group_ids.is_floating_point() or group_ids.is_complex():
        raise ValueError(f"group_ids must be an integer tensor, got {group_ids.dtype}")
    ids, counts = torch.unique(group_ids, return_counts=True)
    small = ids[counts < 2]
    if small.numel() > 0 and not singletons:
        raise ValueError(
            f"every group needs >= 2 sequences {purpose}; singleton group ids: {small.tolist()}"
        )


def check_positive(name: str, value: float, allow_zero: bool = False) -> None:
    if not (value >= 0 if allow_zero else value > 0):
        raise ValueError(f"{name} must be {'>=' if allow_zero else '>'} 0, got {value}")


def masked(token_values: Tensor, mask: Tensor) -> Tensor:
    """float32 copy with padding set to 0 (padding may hold anything, even -inf)."""
    return token_values.float().masked_fill(~mask, 0.0)


def token_kl(
    token_logp: Tensor, ref_token_logp: Tensor, mask: Tensor, kl_token_logp: Tensor | None
) -> Tensor:
    """Per-token ``stopgrad(log pi - log pi_ref)`` (N, T), 0 on padding: the per-token KL penalty
    of PPO and VinePPO, with the log-probs of ``kl_token_logp`` instead of ``token_logp`` when
    given (a KL term fixed when the sample was drawn)."""
    source = token_logp if kl_token_logp is None else kl_token_logp
    return masked(source.detach(), mask) - masked(ref_token_logp.detach(), mask)


def shaped_rewards(
    rewards: Tensor, logp: Tensor, ref_logp: Tensor, beta: float, kl_logp: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """``(r_tilde, kl)`` with ``kl = stopgrad(logp - ref_logp)`` and ``r_tilde = r - beta kl``,
    or ``r_tilde = r - beta (kl_logp - ref_logp)`` when ``kl_logp`` is given (a KL term fixed
    when the sample was drawn); ``kl`` is always the current policy's, for the stats."""
    kl = logp.detach() - ref_logp.detach().float()
    penalty = kl if kl_logp is None else kl_logp.detach().float() - ref_logp.detach().float()
    return rewards.detach().float() - beta * penalty, kl


def clipped_objective(
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
