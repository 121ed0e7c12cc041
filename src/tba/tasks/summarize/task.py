"""Preference tuning on the embedded summarisation world (`task.name=summarize`), the analogue
of TL;DR summarisation with a proxy reward model and a gold judge (`tba.tasks.summarize.world`).

The policy, an SFT summariser (`builtin:summarize`), writes a summary y of a post x; the reward
is the proxy reward model's score of x + y + EOS (a Hugging Face sequence-classification model,
scored by the same `tba.rewards.models.RewardModel` as the real task's). A summary cut off at
`policy.max_new_tokens` without EOS gets `train.truncation_penalty` (-1) instead of a score: the
paper's non-EOS penalty, through `train.truncated=penalize`, which replaces the reward.

Held-out metrics (`tba.tasks.preference`) on the test posts: win rate of the greedy summary
against the reference summary under the world's gold judge, the judge's mean score, the proxy's
mean score, and KL(pi || pi_ref) and the reference perplexity of sampled summaries, pi_ref
being the policy the run started from.

The world (SFT policy, proxy) is built once into the cache directory (`tba.tasks.summarize.build`);
the judge is a function of the text, so nothing but the proxy loads in the searchers.
"""

from __future__ import annotations

from pathlib import Path

from tba.config import TaskConfig
from tba.core import Task
from tba.rewards.models import RewardModel
from tba.tasks.preference import PreferenceEvaluator
from tba.tasks.summarize import world


def summarize_task(config: TaskConfig, world_dir: Path, policy_model: str | None) -> Task:
    """The summarisation task of `config` on the world in `world_dir`; `policy_model` (the run's
    starting policy, default the world's SFT policy) is the reference of the KL metrics."""
    proxy = RewardModel(str(world_dir / "proxy"), device=config.reward_device,
                        batch_size=config.reward_batch_size, name="proxy")  # fmt: skip
    starting_policy = policy_model not in (None, "builtin:summarize")
    reference = policy_model if starting_policy else str(world_dir / "policy")
    eval_rows = rows("test", config.num_eval)
    evaluator = PreferenceEvaluator(eval_rows, world.gold_scores, proxy.score_pairs, reference)
    return Task(
        name="summarize", train_rows=rows("train", config.num_train), eval_rows=eval_rows,
        reward_fns=[proxy], evaluate=evaluator, metrics=("eval_win_rate", "eval_kl"),
    )  # fmt: skip


def rows(split: str, count: int) -> list[dict]:
    return [{"prompt": p.prompt, "reference": p.reference} for p in world.posts(split, count)]
