"""Every objective by the name `train.loss` gives it: its loss behind one signature, what it
needs, and its own settings.

    objective = OBJECTIVES[name]
    loss, stats = objective(inputs)          inputs: `LossInputs`, one micro-batch
    objective.needs.critic, ...              what the trainer and the searchers provide for it
    objective.settings                       its own section of `train` (`train.<name>`), or None

The losses themselves (`tba.objectives.tb`, `.baselines`, `.ppo`, `.vineppo`) take a
`TokenBatch` and the arguments their formulas need. `LossInputs` is a `TokenBatch` with the rest
of a micro-batch (beta, the settings, the samples, what the needs asked for); the entries here
pass it on, with their settings picked out of the one settings object it carries
(`LossInputs.settings`, the config's `train` section: the shared `clip_eps`, an objective's own
section such as `train.ppo`).

Adding an objective is one module and one entry: a module in `tba/objectives/` with its loss, a
pure function (its formula and paper in the docstring, a float64 reference test), and the class
of its own settings if it has some (a `tba.section.Section`); here an
`Objective(loss, Needs(...), settings)` under its name in `OBJECTIVES`. The config takes its
section `train.<name>` from the entry (`objective_settings`). `needs` asks for anything beyond
the tokens every objective gets (a critic's values, per-token reference log-probs, Monte Carlo
step values, ...), which the trainer's providers (`tba.needs`) and the searchers provide. The
trainer, the searchers, the config and the trainer's checkpoints read this table and never an
objective's name, so nothing else changes (`lint-imports` checks the new module once its name
joins the middle layer of the `tba.objectives` contract in `pyproject.toml`). A new kind of need
is a field of `Needs`, the `LossInputs` field it fills, and its provider in `tba.needs` (or in
the searchers, for what comes with each sample).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from tba.core import Sample
from tba.objectives.baselines import (
    dr_grpo_loss,
    grpo_loss,
    online_dpo_loss,
    proximal_rloo_loss,
    rloo_loss,
)
from tba.objectives.common import TokenBatch
from tba.objectives.ppo import PPOSettings, ppo_loss
from tba.objectives.tb import TBSettings, tb_loss, tb_trust_region_loss
from tba.objectives.vineppo import VinePPOSettings, token_step_advantages, vineppo_loss
from tba.section import Section

DEFAULT_OBJECTIVE = "tb"  # `train.loss` unless told otherwise
# The baselines' KL term: the current policy's log-probs, or the behaviour policy's (fixed when the
# sample was drawn, as TRL's RLOO does).
BASELINE_KLS = ("current", "behaviour")


@dataclass(frozen=True)
class Needs:
    """What an objective needs beyond what every one gets (`LossInputs`' per-token log-probs and
    mask, per-token behaviour log-probs, rewards, summed reference log-probs, group ids, beta,
    settings and the samples). The trainer (`tba.needs`: a provider per need it serves) and the
    searchers provide these by reading them, never the name."""

    # A learned value V(s_t) per token (`LossInputs.values`, differentiable): the trainer trains
    # a critic with the policy (`tba.needs.CriticValues` over `tba.policy.values.Critic`, set by
    # `train.ppo`) and checkpoints it, and stores each sample's values at its first use
    # (`Sample.old_values`, V_old), which every later use of the sample gets as
    # `LossInputs.old_values`.
    critic: bool = False
    # Per-token reference log-probs (`LossInputs.ref_token_logp`), for a per-token KL penalty:
    # the searchers store them with each sample (`Sample.ref_token_logps`), the trainer pads
    # them (`tba.needs.TokenReferenceLogps`).
    token_ref_logp: bool = False
    # Monte Carlo values of each response's step prefixes (`Sample.step_ends`,
    # `Sample.step_values`): the searchers estimate them from extra rollouts
    # (`tba.vine_values`, set by `train.vineppo`); the loss reads them from `LossInputs.samples`.
    step_values: bool = False
    # Takes a learned log Z(x) per sequence (`LossInputs.log_z`) when `train.tb.log_z=learned`:
    # the trainer then learns the head with the policy and checkpoints it
    # (`tba.needs.LearnedLogZ`).
    learned_log_z: bool = False
    # A mean over the batch's sequences of a term computed from its group's statistics (log Z, a
    # mean or leave-one-out baseline): samples that only enter those statistics
    # (`train.group_baseline=generation`, `Batch.context`) can join their group with detached
    # log-probs (the trainer's `_loss` lets them in).
    group_statistics: bool = False


@dataclass(kw_only=True)
class LossInputs(TokenBatch):
    """One micro-batch as every objective sees it: its tensors (a `TokenBatch`: every field set,
    `ref_token_logp` where the needs ask for it), the samples they come from, the settings, and
    what else the objective's needs asked for."""

    beta: float
    # The config's `train` section (`tba.config.TrainConfig`, a layer above: read, not
    # imported): the shared `clip_eps`, and each objective's own section (`tb`, `ppo`, ...).
    settings: Any
    samples: list[Sample] = field(default_factory=list)  # the rows, in order
    kl_logp: Tensor | None = None  # baselines: summed log-probs of the KL term (None: current)
    log_z: Tensor | None = None  # needs.learned_log_z: log Z(x) per sequence (None: VarGrad's)
    values: Tensor | None = None  # needs.critic: V(s_t) (N, T), differentiable
    # needs.critic: V_old, the critic's values stored with each sample at its first use in
    # training (`Sample.old_values`), (N, T); None: `values` detached (every row's first use).
    old_values: Tensor | None = None

    def kl_tokens(self) -> Tensor | None:
        """Per-token log-probs of the KL term: the behaviour policy's when the baselines' KL is
        fixed at sampling (`kl_logp` given), else None (the current policy's)."""
        return None if self.kl_logp is None else self.behaviour()


Loss = Callable[[LossInputs], tuple[Tensor, dict[str, Tensor]]]


@dataclass(frozen=True)
class Objective:
    """An entry of `OBJECTIVES`: the loss on a micro-batch, what it needs, and the class of its
    own settings (None: it has none), which the config holds in the section `train.<name>` of
    the objective's name and the loss reads as `LossInputs.settings.<name>`."""

    loss: Loss
    needs: Needs = Needs()
    settings: type[Section] | None = None

    def __call__(self, inputs: LossInputs) -> tuple[Tensor, dict[str, Tensor]]:
        return self.loss(inputs)


def _tb(x: LossInputs) -> tuple[Tensor, dict[str, Tensor]]:
    level = x.settings.tb.trust_region
    if level == "none":
        logp = x.token_logp.sum(dim=1)
        loss, log_z = tb_loss(logp, x.ref_logp, x.rewards, x.group_ids, x.beta, x.log_z)
        return loss, {"log_z": log_z.mean(), "kl": (logp.detach() - x.ref_logp).mean()}
    return tb_trust_region_loss(x, beta=x.beta, clip_eps=x.settings.clip_eps, level=level,
                                log_z=x.log_z)  # fmt: skip


def _clipped(loss: Callable[..., tuple[Tensor, dict[str, Tensor]]]) -> Loss:
    """(Dr.) GRPO and Proximal RLOO: a clipped ratio to the behaviour policy."""

    def objective(x: LossInputs) -> tuple[Tensor, dict[str, Tensor]]:
        return loss(x, beta=x.beta, clip_eps=x.settings.clip_eps, kl_logp=x.kl_logp)

    return objective


def _rloo(x: LossInputs) -> tuple[Tensor, dict[str, Tensor]]:
    return rloo_loss(x, beta=x.beta, kl_logp=x.kl_logp)


def _online_dpo(x: LossInputs) -> tuple[Tensor, dict[str, Tensor]]:
    return online_dpo_loss(x, beta=x.beta)


def _ppo(x: LossInputs) -> tuple[Tensor, dict[str, Tensor]]:
    if x.values is None:
        raise ValueError("ppo needs the critic's values")
    ppo = x.settings.ppo
    return ppo_loss(
        x, x.values, beta=x.beta, clip_eps=x.settings.clip_eps, gae_lambda=ppo.gae_lambda,
        value_clip=ppo.value_clip, value_coef=ppo.value_coef, old_values=x.old_values,
        kl_token_logp=x.kl_tokens(),
    )  # fmt: skip


def _vineppo(x: LossInputs) -> tuple[Tensor, dict[str, Tensor]]:
    return vineppo_loss(x, token_step_advantages(x.samples, x.mask, x.rewards), beta=x.beta,
                        clip_eps=x.settings.clip_eps, kl_token_logp=x.kl_tokens())  # fmt: skip


_GROUP = Needs(group_statistics=True)
OBJECTIVES: dict[str, Objective] = {
    "tb": Objective(_tb, Needs(learned_log_z=True, group_statistics=True), TBSettings),
    "dr_grpo": Objective(_clipped(dr_grpo_loss), _GROUP),
    "grpo": Objective(_clipped(grpo_loss), _GROUP),
    "rloo": Objective(_rloo, _GROUP),
    "proximal_rloo": Objective(_clipped(proximal_rloo_loss), _GROUP),
    "online_dpo": Objective(_online_dpo),
    "ppo": Objective(_ppo, Needs(critic=True, token_ref_logp=True), PPOSettings),
    "vineppo": Objective(_vineppo, Needs(token_ref_logp=True, step_values=True), VinePPOSettings),
}
# Derived from the entries, for the config's messages: the objectives that context samples can
# join (`Needs.group_statistics`).
ROW_MEAN_GROUP_OBJECTIVES = tuple(name for name, o in OBJECTIVES.items()
                                  if o.needs.group_statistics)  # fmt: skip


def objective_settings() -> dict[str, type[Section]]:
    """The class of each objective's own settings, by the objective's name, which names its
    section (`train.<name>`); read from `OBJECTIVES` when called, so that an objective entered
    since this module was imported has its section too."""
    return {name: o.settings for name, o in OBJECTIVES.items() if o.settings is not None}
