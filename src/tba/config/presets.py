"""Defaults that differ per task (`TASK_PRESETS`), applied where the file and the overrides leave
a key unset. A preset's setting of an objective's section (`train.tb.log_z`) applies only where
`train.loss` is that objective (`loading.load_config`)."""

from __future__ import annotations

from typing import Any

# Defaults that differ per task, applied where the file and the overrides leave a key unset.
TASK_PRESETS: dict[str, dict[str, Any]] = {
    # The embedded math task and the paper's: a response cut off at the length limit has no
    # answer line, and gets the truncation penalty rather than the verifier's guess.
    "math": {
        "train.truncated": "penalize",
        # PPO's critic: a head on the built-in policy's last hidden state explains ~0.02 of the
        # return's variance (a least-squares head 0.05); a separate critic LM at 3e-4 explained
        # 0.1-0.25 on held-out prompts after 110-150 steps (docs/objective.md).
        "train.ppo.value_model": "critic",
        "train.ppo.critic_lr": 3e-4,
    },
    "gsm8k": {"train.truncated": "penalize"},
    "competition_math": {"train.truncated": "penalize"},
    # The paper's non-EOS penalty for summaries.
    "tldr": {"train.truncated": "penalize"},
    "redteam": {
        "train.truncated": "penalize",
        "policy.model": "builtin:redteam",
        "policy.max_new_tokens": 12,
        "train.num_prompts": 4,
        "train.group_size": 32,
        # The attacker is far from its target after 1,000 steps at lr 1e-4 (KL 3-6 nats); at 1e-3
        # it gets within 0.3. Beta 0.3: the target's ASR is 93.5% over ~7.7 modes (0.1: 98.6%, 7.3).
        "train.learning_rate": 1e-3,
        "train.beta": 0.3,
        "train.max_steps": 2500,  # ~5 minutes on 2 CPU cores
        "eval.every": 25,  # a run of a fixed number of steps: evaluations counted in steps
        # A learned log Z kept more modes and diversity than VarGrad at the same ASR (3 seeds).
        "train.tb.log_z": "learned",
        # Most groups are reward-prioritised replays thousands of steps old: TB learns from them
        # off-policy, a trust region against their behaviour policy clips them.
        "train.tb.trust_region": "none",
        "buffer.recent_prob": 0.5,
        "buffer.reward_weight": 1.0,
        "buffer.dedup": "near",
        "task.num_eval": 512,
    },
    "summarize": {
        "train.truncated": "penalize",  # the paper's non-EOS penalty
        "policy.model": "builtin:summarize",
        "policy.max_new_tokens": 24,  # the world's longest reference is 20 words
        "train.learning_rate": 1e-4,
        # Lower betas over-optimise the proxy within minutes: win rate peaks, then falls.
        "train.beta": 0.5,
        # The paper's TL;DR settings: k = 10 steps between syncs, half the groups fresh, the
        # other half replayed by reward.
        "train.sync_every": 10,
        "buffer.recent_prob": 0.5,
        "buffer.reward_weight": 1.0,
        "task.num_eval": 512,
        "train.max_steps": 1000,  # 2.5 to 2.75 minutes on 2 CPU cores
        "eval.every": 100,  # each evaluation writes 1,024 summaries (greedy and sampled)
    },
}
