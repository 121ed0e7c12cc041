"""VarGrad Trajectory Balance, in reward units, with an optional trust region: the objective of
TBA (Bartoldson et al., *Trajectory Balance with Asynchrony: Decoupling Exploration and Learning
for Fast, Scalable LLM Post-Training*, NeurIPS 2025, arXiv 2503.18929).

For a prompt x with sampled responses y_1..y_K (one "group"), the Trajectory Balance (TB)
constraint for the KL-regularised target ``pi*(y|x) ∝ pi_ref(y|x) exp(r(x, y) / beta)`` is

    log Z(x) + log pi(y_i|x) = log pi_ref(y_i|x) + r_i / beta.

The VarGrad variant replaces the learned log-partition function by its per-group estimate, so the
loss is the within-group variance of ``log pi - log pi_ref - r / beta``.

Units. The paper's loss is in nats (``r / beta``): its gradient is ``2 / beta`` times that of
REINFORCE, so its norm (hundreds at beta = 0.05) swamps any gradient-norm clip, every step gets
clipped to the same length and clipping means something else for every objective and every beta.
Here the residual is multiplied by beta (reward units) and the loss by ``1 / (2 beta)``: the
minimiser and the direction of every gradient are unchanged, and the gradient w.r.t. each
sequence log-prob is exactly ``-A_i / N`` with the advantage

    A_i = (r_i - r_bar(x)) - beta (KL_i - KL_bar(x)),      KL_i = log pi(y_i|x) - log pi_ref(y_i|x)

(bars: group means), i.e. REINFORCE with a mean baseline on the KL-shaped reward, the same scale
as the baselines' gradients (RLOO's times (K-1)/K).

Trust region (:func:`tb_trust_region_loss`, TBA' in the authors' follow-up). Off-policy, the plain
TB gradient keeps pushing a stale sample the policy already moved, at full size; with a trust
region a sample (or token) whose importance ratio to its behaviour policy left [1 - eps, 1 + eps]
in the direction of its advantage stops being pushed. On-policy (ratio 1) both losses give the
same gradient.

Its own settings are the section `train.tb` (:class:`TBSettings`): the trust region's level, and
whether log Z is VarGrad's estimate or learned with the policy (the trainer then provides it,
`tba.needs.LearnedLogZ`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from torch import Tensor

from tba.objectives.common import (
    CLIP_EPS,
    TokenBatch,
    check_group_ids,
    check_positive,
    clipped_objective,
    group_mean,
    masked,
    validate_grouped,
)
from tba.section import Section

TrustRegion = Literal["sequence", "token"]
TRUST_REGIONS = ("sequence", "token", "none")  # train.tb.trust_region; `none`: the paper's TB


class TBSettings(Section):
    """Trajectory balance's own settings (`train.loss=tb`)."""

    trust_region: Literal[TRUST_REGIONS] = Field(  # type: ignore[valid-type]
        "sequence", description="tb: clip the importance ratio to the behaviour policy per "
        "`sequence` or per `token` (TBA'), or `none` (the paper's plain TB)",
    )
    log_z: Literal["vargrad", "learned"] = Field(
        "vargrad", description="tb: log Z(x) estimated per group (VarGrad, needs K >= 2) or "
        "learned with the policy (a linear head on the prompt's mean input embedding)",
    )
    log_z_lr: float = Field(1e-2, gt=0, description="Adam learning rate of a learned log Z")


def _validate(
    logp: Tensor,
    ref_logp: Tensor,
    rewards: Tensor,
    group_ids: Tensor,
    beta: float,
    learned: bool = False,
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
    check_group_ids(group_ids, learned, "to estimate log Z")
    check_positive("beta", beta)


def tb_residuals(
    logp: Tensor,
    ref_logp: Tensor,
    rewards: Tensor,
    group_ids: Tensor,
    beta: float,
    log_z: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """``(residual, log_z)``: the TB residual in reward units, and the log Z it used.

        delta_i      = logp_i - ref_logp_i - r_i / beta
        log Z(x)     = stopgrad( -mean_{i in x} delta_i )       (VarGrad, when `log_z` is None)
                     = the given `log_z` (a learned estimate, differentiable)
        residual_i   = beta (log Z(x_i) + delta_i) = -A_i

    float32; differentiable in ``logp`` (and in a given ``log_z``).
    """
    logp = logp.float()
    delta = logp - ref_logp.detach().float() - rewards.detach().float() / beta
    if log_z is None:
        log_z = -group_mean(delta.detach(), group_ids)
    return beta * (log_z.float() + delta), log_z


def tb_loss(
    logp: Tensor,
    ref_logp: Tensor,
    rewards: Tensor,
    group_ids: Tensor,
    beta: float,
    log_z: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """VarGrad Trajectory Balance loss in reward units.

    All inputs are 1-D of length N (one entry per sequence): ``logp`` is the summed log-prob of
    each response under the policy, ``ref_logp`` the same under the frozen reference, ``rewards``
    the scalar rewards and ``group_ids`` the integer prompt id x of each sequence. With the
    residual of :func:`tb_residuals`,

        loss = (1 / (2 beta N)) sum_i residual_i^2
             = (beta / 2) * (1/N) sum_i (log Z_hat(x_i) + delta_i)^2       (the paper's loss)

    and ``d loss / d logp_i = residual_i / N = -A_i / N`` with
    ``A_i = (r_i - r_bar) - beta (KL_i - KL_bar)``. The loss is zero iff ``delta`` is constant
    within every group. Computed in float32 whatever the input dtype. Every group needs >= 2
    members, unless ``log_z`` is given: a learned log Z(x_i) per sequence (the same loss then
    trains it too, towards the mean of ``-delta``; groups of one are fine).

    Returns:
        ``(loss, log_z)``: the scalar float32 loss and the detached per-sequence log Z(x_i) of
        shape (N,).
    """
    _validate(logp, ref_logp, rewards, group_ids, beta, learned=log_z is not None)
    residual, log_z = tb_residuals(logp, ref_logp, rewards, group_ids, beta, log_z)
    loss = residual.pow(2).mean() / (2.0 * beta)
    return loss, log_z.detach()


def tb_trust_region_loss(
    batch: TokenBatch,
    *,
    beta: float,
    clip_eps: float = CLIP_EPS,
    level: TrustRegion = "sequence",
    log_z: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """TB whose residuals stop pushing samples the policy has already moved (TBA').

    Reads the batch's ``token_logp``, ``behaviour_token_logp`` (the log-probs under the policy
    that generated each sample, stored with it), ``mask``, ``rewards``, ``ref_logp`` and
    ``group_ids``. ``A_i = -residual_i`` is TB's advantage (:func:`tb_residuals`, detached, with
    the current policy's log-probs in its KL term):

        sequence:  rho_i  = exp(sum_t mask_it (token_logp_it - behaviour_token_logp_it))
                   loss   = -(1/N) sum_i min(rho_i A_i, clip(rho_i, 1 - eps, 1 + eps) A_i)
        token:     rho_it = exp(token_logp_it - behaviour_token_logp_it)
                   loss   = -(1/N) sum_{i,t} mask_it min(rho_it A_i, clip(rho_it, 1-eps, 1+eps) A_i)

    A sample (token) whose ratio left the band in the direction of its advantage gets no gradient
    (the clipped branch is constant); one that moved the other way keeps its full gradient,
    weighted by its ratio. The sequence ratio is the importance weight of the whole response,
    which is what TB's sequence-level residual is about; a token ratio rarely leaves the band
    (3.8% of tokens 12 steps stale on the embedded task, against 76% of sequences). Log-ratios
    are clamped to [-20, 20] before ``exp``.

    On-policy (rho = 1) the gradient w.r.t. each real token log-prob is ``-A_i / N``: exactly that
    of :func:`tb_loss`. With a learned ``log_z`` (per sequence), A uses it and the loss adds
    ``(1 / (2 beta N)) sum_i (beta (log_z_i + stopgrad(delta_i)))^2``, which trains it.

    Stats: ``clip_frac`` (share of sequences, or of real tokens, whose gradient the trust region
    zeroed), ``log_z`` and ``kl`` (means over the batch).
    """
    token_logp, behaviour_token_logp, mask = batch.token_logp, batch.behaviour(), batch.mask
    rewards, (ref_logp, group_ids) = batch.rewards, batch.grouped()
    validate_grouped(
        mask,
        group_ids,
        {"token_logp": token_logp, "behaviour_token_logp": behaviour_token_logp},
        {"rewards": rewards, "ref_logp": ref_logp},
        singletons=log_z is not None,
    )
    check_positive("beta", beta)
    check_positive("clip_eps", clip_eps)
    if level not in ("sequence", "token"):
        raise ValueError(f"level must be 'sequence' or 'token', got {level!r}")
    mask = mask.bool()
    token_logp = masked(token_logp, mask)
    log_ratio = token_logp - masked(behaviour_token_logp.detach(), mask)
    logp = token_logp.sum(dim=1)
    residual, log_z = tb_residuals(logp, ref_logp, rewards, group_ids, beta, log_z)
    advantage = -residual.detach()
    if level == "sequence":
        objective, clipped = clipped_objective(log_ratio.sum(dim=1), advantage, clip_eps)
        clip_frac = clipped.float().mean()
    else:
        objective, clipped = clipped_objective(log_ratio, advantage[:, None], clip_eps)
        objective = objective.masked_fill(~mask, 0.0).sum(dim=1)
        clip_frac = (clipped & mask).sum().float() / mask.sum()
    loss = -objective.mean()
    if log_z.requires_grad:  # a learned log Z: fit it to the residuals with logp held fixed
        fixed, _ = tb_residuals(logp.detach(), ref_logp, rewards, group_ids, beta, log_z)
        loss = loss + fixed.pow(2).mean() / (2.0 * beta)
    stats = {
        "clip_frac": clip_frac,
        "log_z": log_z.detach().mean(),
        "kl": (logp.detach() - ref_logp.detach().float()).mean(),
    }
    return loss, stats
