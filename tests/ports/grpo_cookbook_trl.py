# Hugging Face's cookbook "Post training an LLM for reasoning with GRPO in TRL" as one script:
# conversational prompts with a system prompt, a model wrapped with LoRA by `get_peft_model`, two
# reward functions of TRL's `(completions, **kwargs)` shape, its GRPOConfig, then
# `trainer.save_model` and `trainer.push_to_hub`. The model, the dataset and the output directory
# are read from the environment, and the accuracy check is a plain comparison instead of
# math_verify (the tests run offline: the upload then fails, in one line). One of a pair:
# grpo_cookbook_trl.py for TRL, grpo_cookbook_tba.py the same script ported to tba by changing
# three lines: the import, the trainer class and the config class.
import os
import re

from datasets import load_dataset
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM
from trl import GRPOConfig, GRPOTrainer

dataset_id = "AI-MO/NuminaMath-TIR"
train_dataset = load_dataset("json", data_files=os.environ["PORT_DATASET"], split="train")

SYSTEM_PROMPT = (
    "A conversation between User and Assistant. The user asks a question, and the Assistant "
    "solves it. The assistant first thinks about the reasoning process in the mind and then "
    "provides the user with the answer. The reasoning process and answer are enclosed within "
    "<think> </think> and <answer> </answer> tags, respectively, i.e., "
    "<think> reasoning process here </think><answer> answer here </answer>"
)


def make_conversation(example):
    return {
        "prompt": [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": example["problem"]},
        ],
    }


train_dataset = train_dataset.map(make_conversation)
train_dataset = train_dataset.remove_columns(["messages", "problem"])

model_id = os.environ["PORT_MODEL"]
model = AutoModelForCausalLM.from_pretrained(
    model_id,
    torch_dtype="auto",
    device_map="auto",
)

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
    """Reward function that checks if the completion is the same as the ground truth."""
    solutions = kwargs["solution"]
    completion_contents = [completion[0]["content"] for completion in completions]
    rewards = []
    for content, solution in zip(completion_contents, solutions):
        rewards.append(1.0 if solution.strip() in content else 0.0)
    return rewards


# Configure training arguments using GRPOConfig
training_args = GRPOConfig(
    output_dir=os.environ["PORT_OUTPUT_DIR"],
    learning_rate=1e-5,
    remove_unused_columns=False,  # to access the solution column in accuracy_reward
    gradient_accumulation_steps=16,
    num_train_epochs=1,
    bf16=True,
    # Parameters that control de data preprocessing
    max_completion_length=64,  # default: 256
    num_generations=4,  # default: 8
    max_prompt_length=128,  # default: 512
    # Parameters related to reporting and saving
    report_to=["tensorboard"],
    logging_steps=10,
    push_to_hub=True,
    save_strategy="steps",
    save_steps=10,
)

trainer = GRPOTrainer(
    model=model,
    reward_funcs=[format_reward, accuracy_reward],
    args=training_args,
    train_dataset=train_dataset,
)

trainer.train()

trainer.save_model(training_args.output_dir)
trainer.push_to_hub(dataset_name=dataset_id)
