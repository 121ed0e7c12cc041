# One of a pair: grpo_quickstart_trl.py is TRL's GRPO quickstart as TRL's documentation gives it,
# with the model and the dataset read from local files (the tests run offline) and a step limit;
# grpo_quickstart_tba.py is the same script ported to tba, changing three lines: the import, the
# trainer class and the config class.
import os

from datasets import load_dataset
from trl import GRPOConfig, GRPOTrainer

dataset = load_dataset("json", data_files=os.environ["PORT_DATASET"], split="train")


# Define the reward function, which rewards completions that are close to 20 characters
def reward_len(completions, **kwargs):
    return [-abs(20 - len(completion)) for completion in completions]


training_args = GRPOConfig(output_dir=os.environ["PORT_OUTPUT_DIR"], max_steps=2)
trainer = GRPOTrainer(
    model=os.environ["PORT_MODEL"],
    reward_funcs=reward_len,
    args=training_args,
    train_dataset=dataset,
)
trainer.train()
