"""Training objectives for RL post-training of language models.

The central objective is the VarGrad Trajectory Balance loss (:func:`tb_loss`), which fits the
policy to the KL-regularised target ``pi_ref(y|x) exp(r(x, y) / beta)`` by driving the per-group
variance of ``log pi - log pi_ref - r / beta`` to zero, computed in reward units so that its
gradient has the scale of the baselines'; :func:`tb_trust_region_loss` is the same objective with
a clipped importance ratio to the behaviour policy, for stale samples. :func:`group_mean` provides
the vectorised per-prompt averaging shared by group-based losses, and :class:`BetaSchedule` gives
the (possibly annealed) beta as a function of training progress.

Baselines for comparison (:mod:`tba.objectives.baselines`), all on the same grouped batches and,
except DPO, on the same KL-shaped reward ``r - beta * stopgrad(log pi - log pi_ref)``:
:func:`dr_grpo_loss` and :func:`grpo_loss` (token-level PPO-clip with a group-mean or
group-standardised advantage), :func:`rloo_loss` (REINFORCE with a leave-one-out baseline),
:func:`proximal_rloo_loss` (RLOO with a clipped sequence-level importance ratio, for off-policy
data) and :func:`online_dpo_loss` (DPO on the best-vs-worst response of each group).

Value-based baselines, with a per-token KL penalty in the same units: :func:`ppo_loss`
(:mod:`tba.objectives.ppo`: GAE on a learned critic's values, :class:`ValueHead`, whitened
advantages, clipped ratio and clipped value loss) and :func:`vineppo_loss`
(:mod:`tba.objectives.vineppo`: the clipped ratio on step advantages from Monte Carlo values of
step prefixes, :func:`vine_advantages`).

Every loss takes its micro-batch as one :class:`TokenBatch` (per-token and per-sequence
tensors) and its settings as arguments.

``OBJECTIVES`` (:mod:`tba.objectives.registry`) names every one of them: an :class:`Objective`,
its loss behind one signature, ``OBJECTIVES[name](LossInputs(...)) -> (loss, stats)``, its
:class:`Needs` (a critic, per-token reference log-probs, Monte Carlo step values, ...), which the
trainer and the searchers read instead of the name, and the class of its own settings
(:class:`TBSettings`, :class:`PPOSettings`, :class:`VinePPOSettings`), which the config holds as
the section ``train.<name>``. It is what ``train.loss`` chooses from.

Adding an objective is one module and one entry: a module here with its loss (a pure function,
its formula and paper in the docstring, a float64 reference test) and its settings class, if it
has settings of its own, and an ``Objective(loss, Needs(...), settings)`` under its name in
``OBJECTIVES`` (the registry's docstring says how the loss reads its inputs and settings).
Nothing else changes: ``lint-imports`` checks the new module's imports once its name joins the
middle layer of the ``tba.objectives`` contract in ``pyproject.toml``.
"""

from tba.objectives.baselines import (
    dr_grpo_loss,
    grpo_loss,
    online_dpo_loss,
    proximal_rloo_loss,
    rloo_loss,
)
from tba.objectives.beta import BetaSchedule
from tba.objectives.common import CLIP_EPS, TokenBatch, group_mean
from tba.objectives.ppo import PPOSettings, ValueHead, gae, ppo_loss
from tba.objectives.registry import (
    BASELINE_KLS,
    DEFAULT_OBJECTIVE,
    OBJECTIVES,
    ROW_MEAN_GROUP_OBJECTIVES,
    LossInputs,
    Needs,
    Objective,
    objective_settings,
)
from tba.objectives.tb import TRUST_REGIONS, TBSettings, tb_loss, tb_residuals, tb_trust_region_loss
from tba.objectives.vineppo import VinePPOSettings, vine_advantages, vineppo_loss

__all__ = [
    "BASELINE_KLS",
    "CLIP_EPS",
    "DEFAULT_OBJECTIVE",
    "OBJECTIVES",
    "ROW_MEAN_GROUP_OBJECTIVES",
    "TRUST_REGIONS",
    "BetaSchedule",
    "LossInputs",
    "Needs",
    "Objective",
    "PPOSettings",
    "TBSettings",
    "TokenBatch",
    "ValueHead",
    "VinePPOSettings",
    "dr_grpo_loss",
    "gae",
    "group_mean",
    "grpo_loss",
    "objective_settings",
    "online_dpo_loss",
    "ppo_loss",
    "proximal_rloo_loss",
    "rloo_loss",
    "tb_loss",
    "tb_residuals",
    "tb_trust_region_loss",
    "vine_advantages",
    "vineppo_loss",
]
