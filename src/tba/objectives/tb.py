"""VarGrad Trajectory Balance loss for sequence-level RL post-training.

For a prompt x with sampled responses y_1..y_K (one "group"), the Trajectory Balance (TB)
constraint for the KL-regularised target ``pi*(y|x) ∝ pi_ref(y|x) exp(r(x, y) / beta)`` is

    log Z(x) + log pi(y_i|x) = log pi_ref(y_i|x) + r_i / beta.

The VarGrad variant replaces the learned log-partition function by its per-group estimate, so the
loss is the (batch-averaged) variance of the per-sequence log-ratio within each group.
"""

from __future__ import annotations

import torch
from torch import Tensor


def group_mean(values: Tensor, group_ids: Tensor) -> Tensor:
    """Per-element mean of ``values`` over the group each element belongs to.

    ``out_i = mean_{j : g_j = g_i} values_j`` where ``g = group_ids``. Groups are formed by the
    explicit ids (any order, any values), never by reshaping. Differentiable in ``values``.
    """
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    sums = values.new_zeros(counts.numel()).index_add_(0, inverse, values)
    return (sums / counts.to(values.dtype))[inverse]


def _validate(
    logp: Tensor, ref_logp: Tensor, rewards: Tensor, group_ids: Tensor, beta: float
) -> None:
    """Raise ``ValueError`` unless the inputs form a valid TB batch."""
    named = {"logp": logp, "ref_logp": ref_logp, "rewards": rewards, "group_ids": group_ids}
    for name, tensor in named.items():
        if tensor.dim() != 1:
            raise ValueError(
                f"{name} must be 1-D (one entry per sequence), got {tuple(tensor.shape)}"
            )
    lengths = {name: tensor.numel() for name, tensor in named.items()}
    if len(set(lengths.values())) != 1:
        raise ValueError(f"all inputs must have the same length, got {lengths}")
    if lengths["logp"] == 0:
        raise ValueError("tb_loss needs a non-empty batch")
    if group_ids.is_floating_point() or group_ids.is_complex():
        raise ValueError(f"group_ids must be an integer tensor, got {group_ids.dtype}")
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    ids, counts = torch.unique(group_ids, return_counts=True)
    small = ids[counts < 2]
    if small.numel() > 0:
        raise ValueError(
            "every group needs >= 2 sequences to estimate log Z; "
            f"singleton group ids: {small.tolist()}"
        )


def tb_loss(
    logp: Tensor, ref_logp: Tensor, rewards: Tensor, group_ids: Tensor, beta: float
) -> tuple[Tensor, Tensor]:
    """VarGrad Trajectory Balance loss.

    All inputs are 1-D of length N (one entry per sequence): ``logp`` is the summed log-prob of
    each response under the policy, ``ref_logp`` the same under the frozen reference, ``rewards``
    the scalar rewards and ``group_ids`` the integer prompt id x of each sequence. With

        delta_i     = logp_i - ref_logp_i - r_i / beta
        log Z_hat(x) = stopgrad( mean_{i in x} ( r_i / beta - (logp_i - ref_logp_i) ) )
                     = stopgrad( -mean_{i in x} delta_i )
        loss        = (1/N) sum_i ( log Z_hat(x_i) + delta_i )^2

    the gradient is ``d loss / d logp_i = (2/N) (log Z_hat(x_i) + delta_i)``, i.e. a policy
    gradient with advantage ``-(log Z_hat + delta_i) = (r_i - r_bar)/beta - (KL_i - KL_bar)``
    where ``KL_i = logp_i - ref_logp_i`` and bars are group means.

    Computation is in float32 whatever the input dtype. Every group needs >= 2 members.

    Returns:
        ``(loss, log_z)``: the scalar float32 loss and the detached per-sequence
        ``log Z_hat(x_i)`` of shape (N,).
    """
    _validate(logp, ref_logp, rewards, group_ids, beta)
    logp = logp.float()
    ref_logp = ref_logp.detach().float()
    rewards = rewards.detach().float()

    delta = logp - ref_logp - rewards / beta
    log_z = -group_mean(delta.detach(), group_ids)
    loss = (log_z + delta).pow(2).mean()
    return loss, log_z
