"""Every objective behind one signature, by the name `train.loss` gives it.

    loss, stats = OBJECTIVES[name](inputs)          inputs: `LossInputs`, one micro-batch

The losses themselves (`tba.objectives.tb`, `tba.objectives.baselines`, `tba.objectives.ppo`)
keep the arguments their formulas need; the entries here only pick those out of `LossInputs`.
Adding an objective is one function and one entry: the trainer and the config's allowed names
read this table.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor

from tba.objectives.baselines import (
    dr_grpo_loss,
    grpo_loss,
    online_dpo_loss,
    proximal_rloo_loss,
    rloo_loss,
)
from tba.objectives.ppo import ppo_loss, vineppo_loss
from tba.objectives.tb import tb_loss, tb_trust_region_loss

TRUST_REGIONS = ("sequence", "token", "none")  # tb's; `none` is the paper's plain TB
# The baselines' KL term: the current policy's log-probs, or the behaviour policy's (fixed when the
# sample was drawn, as TRL's RLOO does).
BASELINE_KLS = ("current", "behaviour")


@dataclass
class LossInputs:
    """One micro-batch as every objective sees it: per-token tensors (N, T), right-padded, per
    sequence (N,), and the objective's settings."""

    token_logp: Tensor  # the current policy's, masked to 0 on padding; differentiable
    mask: Tensor  # 1 on real response tokens (EOS included)
    behaviour_token_logp: Tensor | None  # the sampler's (None when samples lack them)
    rewards: Tensor
    ref_logp: Tensor  # summed over the response
    group_ids: Tensor  # the prompt of each sequence
    beta: float
    clip_eps: float = 0.2
    trust_region: str = "sequence"  # tb: one of TRUST_REGIONS
    log_z: Tensor | None = None  # tb: a learned log Z(x) per sequence (None: VarGrad's estimate)
    kl_logp: Tensor | None = None  # baselines: summed log-probs of the KL term (None: current)
    # ppo and vineppo: per-token reference log-probs (N, T), for the per-token KL penalty
    ref_token_logp: Tensor | None = None
    values: Tensor | None = None  # ppo: the critic's V(s_t) (N, T), differentiable
    gae_lambda: float = 0.95  # ppo
    value_clip: float = 0.2  # ppo
    value_coef: float = 0.1  # ppo
    step_advantages: Tensor | None = None  # vineppo: each token's step advantage (N, T)

    def behaviour(self) -> Tensor:
        if self.behaviour_token_logp is None:
            raise ValueError("this loss needs per-token behaviour log-probs in every sample")
        return self.behaviour_token_logp

    def ref_tokens(self) -> Tensor:
        if self.ref_token_logp is None:
            raise ValueError("this loss needs per-token reference log-probs in every sample")
        return self.ref_token_logp

    def kl_tokens(self) -> Tensor | None:
        """Per-token log-probs of the KL term: the behaviour policy's when the baselines' KL is
        fixed at sampling (`kl_logp` given), else None (the current policy's)."""
        return None if self.kl_logp is None else self.behaviour()


Objective = Callable[[LossInputs], tuple[Tensor, dict[str, Tensor]]]


def _tb(x: LossInputs) -> tuple[Tensor, dict[str, Tensor]]:
    if x.trust_region == "none":
        logp = x.token_logp.sum(dim=1)
        loss, log_z = tb_loss(logp, x.ref_logp, x.rewards, x.group_ids, x.beta, x.log_z)
        return loss, {"log_z": log_z.mean(), "kl": (logp.detach() - x.ref_logp).mean()}
    return tb_trust_region_loss(
        x.token_logp, x.behaviour(), x.mask, x.rewards, x.ref_logp, x.group_ids,
        beta=x.beta, clip_eps=x.clip_eps, level=x.trust_region, log_z=x.log_z,
    )  # fmt: skip


def _clipped(loss: Callable[..., tuple[Tensor, dict[str, Tensor]]]) -> Objective:
    """(Dr.) GRPO and Proximal RLOO: a clipped ratio to the behaviour policy."""

    def objective(x: LossInputs) -> tuple[Tensor, dict[str, Tensor]]:
        return loss(
            x.token_logp, x.behaviour(), x.mask, x.rewards, x.ref_logp, x.group_ids,
            beta=x.beta, clip_eps=x.clip_eps, kl_logp=x.kl_logp,
        )  # fmt: skip

    return objective


def _rloo(x: LossInputs) -> tuple[Tensor, dict[str, Tensor]]:
    return rloo_loss(
        x.token_logp, x.mask, x.rewards, x.ref_logp, x.group_ids, beta=x.beta, kl_logp=x.kl_logp
    )


def _online_dpo(x: LossInputs) -> tuple[Tensor, dict[str, Tensor]]:
    return online_dpo_loss(x.token_logp, x.mask, x.rewards, x.ref_logp, x.group_ids, beta=x.beta)


def _ppo(x: LossInputs) -> tuple[Tensor, dict[str, Tensor]]:
    if x.values is None:
        raise ValueError("ppo needs the critic's values")
    return ppo_loss(
        x.token_logp, x.behaviour(), x.mask, x.rewards, x.ref_tokens(), x.values, beta=x.beta,
        clip_eps=x.clip_eps, gae_lambda=x.gae_lambda, value_clip=x.value_clip,
        value_coef=x.value_coef, kl_token_logp=x.kl_tokens(),
    )  # fmt: skip


def _vineppo(x: LossInputs) -> tuple[Tensor, dict[str, Tensor]]:
    if x.step_advantages is None:
        raise ValueError("vineppo needs every sample's Monte Carlo step values")
    return vineppo_loss(
        x.token_logp, x.behaviour(), x.mask, x.step_advantages, x.ref_tokens(), beta=x.beta,
        clip_eps=x.clip_eps, kl_token_logp=x.kl_tokens(),
    )  # fmt: skip


OBJECTIVES: dict[str, Objective] = {
    "tb": _tb,
    "dr_grpo": _clipped(dr_grpo_loss),
    "grpo": _clipped(grpo_loss),
    "rloo": _rloo,
    "proximal_rloo": _clipped(proximal_rloo_loss),
    "online_dpo": _online_dpo,
    "ppo": _ppo,
    "vineppo": _vineppo,
}
# The objectives whose loss is a mean over the batch's sequences of a term computed from its
# group's statistics (log Z, a mean or leave-one-out baseline): samples that only enter those
# statistics (`train.group_baseline=generation`) can join their group with detached log-probs.
ROW_MEAN_GROUP_OBJECTIVES = ("tb", "dr_grpo", "grpo", "rloo", "proximal_rloo")
# The objectives that learn from per-token reference log-probs (the searchers then store them),
# and the one that needs Monte Carlo values of each response's step prefixes.
TOKEN_KL_OBJECTIVES = ("ppo", "vineppo")
