# A GRPO script in the shape of Hugging Face's popular cookbook "Post-training an LLM for
# reasoning with GRPO in TRL": conversational prompts with a system prompt, a model wrapped with
# LoRA by `get_peft_model`, two reward functions of TRL's `(completions, **kwargs)` shape, and a
# GRPOConfig with the usual arguments. The model and the dataset are read from local files and the
# accuracy check is a plain comparison instead of math_verify (the tests run offline);
# push_to_hub is off for the same reason. One of a pair: grpo_cookbook_trl.py for TRL,
# grpo_cookbook_tba.py the same script ported to tba, changing three lines: the import, the
# trainer class and the config class.
import os
import re

from datasets import load_dataset
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM
from tba import TBAConfig, TBATrainer

SYSTEM_PROMPT = (
    "A conversation between User and Assistant. The user asks a question, and the Assistant "
    "solves it. The assistant first thinks about the reasoning process in the mind and then "
    "provides the user with the answer. The reasoning process and answer are enclosed within "
    "<think> </think> and <answer> </answer> tags, respectively."
)


def make_conversation(example):
    return {
        "prompt": [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": example["problem"]},
        ],
    }


train_dataset = load_dataset("json", data_files=os.environ["PORT_DATASET"], split="train")
train_dataset = train_dataset.map(make_conversation)
train_dataset = train_dataset.remove_columns(["problem"])

model = AutoModelForCausalLM.from_pretrained(os.environ["PORT_MODEL"], dtype="auto")
lora_config = LoraConfig(
    task_type="CAUSAL_LM",
    r=8,
    lora_alpha=32,
    lora_dropout=0.1,
    target_modules=["q_proj", "v_proj"],
)
model = get_peft_model(model, lora_config)


def format_reward(completions, **kwargs):
    """Reward function that checks if the completion has a specific format."""
    pattern = r"^<think>.*?</think>\s*<answer>.*?</answer>$"
    completion_contents = [completion[0]["content"] for completion in completions]
    matches = [re.match(pattern, content) for content in completion_contents]
    return [1.0 if match else 0.0 for match in matches]


def accuracy_reward(completions, **kwargs):
    """Reward function that checks if the completion states the solution."""
    solutions = kwargs["solution"]
    completion_contents = [completion[0]["content"] for completion in completions]
    return [
        1.0 if solution in content else 0.0
        for content, solution in zip(completion_contents, solutions)
    ]


training_args = TBAConfig(
    output_dir=os.environ["PORT_OUTPUT_DIR"],
    learning_rate=1e-5,
    remove_unused_columns=False,  # to access the solution column in accuracy_reward
    gradient_accumulation_steps=16,
    num_train_epochs=1,
    bf16=True,
    # Parameters that control the data preprocessing
    max_completion_length=64,  # default: 256
    num_generations=4,  # default: 8
    max_prompt_length=128,  # default: 512
    # Parameters related to reporting and saving
    report_to=["tensorboard"],
    logging_steps=10,
    push_to_hub=False,
    save_strategy="steps",
    save_steps=10,
)
trainer = TBATrainer(
    model=model,
    reward_funcs=[format_reward, accuracy_reward],
    args=training_args,
    train_dataset=train_dataset,
)
trainer.train()
trainer.save_model(training_args.output_dir)
