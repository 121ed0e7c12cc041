# TRL's GRPO quickstart as a user ran it on SmolLM2-135M-Instruct on a CPU: conversational prompts
# (trl-lib/tldr's posts, one user turn each; offline, the tests and benchmarks.compare give the
# embedded summarisation world's posts), the quickstart's length reward written for
# conversations, 2 prompts x 8 completions a step, 32 new tokens, learning rate 2e-5, and what
# TRL needs on a CPU. The model, the dataset, the output directory and a step limit are read from
# the environment. One of a pair: grpo_quickstart_smollm2_trl.py for TRL,
# grpo_quickstart_smollm2_tba.py the same script ported to tba by changing three lines: the
# import, the trainer class and the config class.
import os

from datasets import load_dataset
from transformers import AutoTokenizer
from tba import TBAConfig, TBATrainer

dataset = load_dataset("json", data_files=os.environ["PORT_DATASET"], split="train")


# Rewards completions close to 20 characters (a completion is one assistant message)
def reward_len(completions, **kwargs):
    return [-abs(20 - len(completion[0]["content"])) for completion in completions]


training_args = TBAConfig(
    output_dir=os.environ["PORT_OUTPUT_DIR"],
    learning_rate=2e-5,
    per_device_train_batch_size=16,
    num_generations=8,
    max_completion_length=32,
    max_steps=int(os.environ.get("PORT_MAX_STEPS", "-1")),
    use_cpu=True,
    bf16=False,
    gradient_checkpointing=False,
    report_to="none",
)
trainer = TBATrainer(
    model=os.environ["PORT_MODEL"],
    reward_funcs=reward_len,
    args=training_args,
    train_dataset=dataset,
    processing_class=AutoTokenizer.from_pretrained(os.environ["PORT_MODEL"]),
)
trainer.train()
