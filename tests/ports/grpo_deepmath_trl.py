# TRL's current GRPO quickstart (Qwen2-0.5B-Instruct on trl-lib/DeepMath-103K, TRL's
# `accuracy_reward`, every setting TRL's default), with the model and the dataset read from the
# environment and `accuracy_reward` from an offline stand-in of `trl.rewards` (trl_rewards.py:
# the same signature and contract, without math_verify). One of a pair: grpo_deepmath_trl.py for
# TRL, grpo_deepmath_tba.py the same script ported to tba by changing its import and its trainer
# class (it has no config).
import os

from datasets import load_dataset
from trl import GRPOTrainer
from trl_rewards import accuracy_reward

dataset = load_dataset("json", data_files=os.environ["PORT_DATASET"], split="train")

trainer = GRPOTrainer(
    model=os.environ["PORT_MODEL"],
    reward_funcs=accuracy_reward,
    train_dataset=dataset,
)
trainer.train()
