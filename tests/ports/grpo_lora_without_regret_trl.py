# The GRPO script of TRL's "LoRA Without Regret" guide (rank-1 LoRA on every linear layer, one
# completion a pass, 4 passes a step, generations of one prompt's 8 completions, reported to
# Trackio), with the model and the dataset read from the environment and
# `reasoning_accuracy_reward` from an offline stand-in of `trl.rewards` (trl_rewards.py). It sets
# no output_dir: the run goes where the framework's default puts it. One of a pair:
# grpo_lora_without_regret_trl.py for TRL, grpo_lora_without_regret_tba.py the same script
# ported to tba by changing three lines: the import, the trainer class and the config class.
import os

from datasets import load_dataset
from peft import LoraConfig
from trl import GRPOConfig, GRPOTrainer
from trl_rewards import reasoning_accuracy_reward

dataset = load_dataset("json", data_files=os.environ["PORT_DATASET"], split="train")

peft_config = LoraConfig(
    r=1,
    lora_alpha=32,
    target_modules="all-linear"
)

training_args = GRPOConfig(
    learning_rate=5e-5,
    per_device_train_batch_size=1,
    gradient_accumulation_steps=4,
    num_train_epochs=1,
    num_generations=8,
    generation_batch_size=8,
    report_to=["trackio"],
)

trainer = GRPOTrainer(
    model=os.environ["PORT_MODEL"],
    reward_funcs=reasoning_accuracy_reward,
    args=training_args,
    train_dataset=dataset,
    peft_config=peft_config,
)

trainer.train()
