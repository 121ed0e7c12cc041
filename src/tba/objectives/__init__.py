"""Training objectives for RL post-training of language models.

The central objective is the VarGrad Trajectory Balance loss (:func:`tb_loss`), which fits the
policy to the KL-regularised target ``pi_ref(y|x) exp(r(x, y) / beta)`` by driving the per-group
variance of ``log pi - log pi_ref - r / beta`` to zero; :func:`group_mean` provides the
vectorised per-prompt averaging shared by group-based losses, and :class:`BetaSchedule` gives
the (possibly annealed) beta as a function of training progress.
"""

from tba.objectives.schedules import BetaSchedule
from tba.objectives.tb import group_mean, tb_loss

__all__ = ["BetaSchedule", "group_mean", "tb_loss"]
