# TRL's classic GRPO quickstart (Qwen2-0.5B-Instruct on trl-lib/tldr, a length reward), as TRL's
# documentation gives it, with the model, the dataset and the output directory read from the
# environment (the tests run offline, on a tiny local model). One of a pair: grpo_quickstart_trl.py
# for TRL, grpo_quickstart_tba.py the same script ported to tba by changing three lines: the
# import, the trainer class and the config class.
import os

from datasets import load_dataset
from trl import GRPOConfig, GRPOTrainer

dataset = load_dataset("json", data_files=os.environ["PORT_DATASET"], split="train")


# Define the reward function, which rewards completions that are close to 20 characters
def reward_len(completions, **kwargs):
    return [-abs(20 - len(completion)) for completion in completions]


training_args = GRPOConfig(output_dir=os.environ["PORT_OUTPUT_DIR"], logging_steps=10)
trainer = GRPOTrainer(
    model=os.environ["PORT_MODEL"],
    reward_funcs=reward_len,
    args=training_args,
    train_dataset=dataset,
)
trainer.train()
