# TRL's notebook grpo_rnj_1_instruct.ipynb (GRPO of EssentialAI/rnj-1-instruct with LoRA on
# NuminaMath-TIR, a format reward, reported to Trackio, pushed to the Hub) as one script, its
# cells in order. The model, the dataset and the output directory are read from the environment
# (the tests run offline, on a tiny local model), the model is loaded without the notebook's
# 4-bit quantization (bitsandbytes needs a GPU), and the cells that read GPU memory or load the
# pushed model back from the Hub are left out. One of a pair: grpo_rnj_1_instruct_trl.py for
# TRL, grpo_rnj_1_instruct_tba.py the same script ported to tba by changing three lines: the
# import, the trainer class and the config class.
import os
import re

from datasets import load_dataset
from peft import LoraConfig
from transformers import AutoModelForCausalLM
from tba import TBAConfig, TBATrainer

dataset_id = "AI-MO/NuminaMath-TIR"
train_dataset = load_dataset("json", data_files=os.environ["PORT_DATASET"], split="train[:50%]")

SYSTEM_PROMPT = (
    "A conversation between User and Assistant. The user asks a question, and the Assistant "
    "solves it.\nThe assistant first thinks about the reasoning process in the mind and then "
    "provides the user with the answer.\nThe reasoning process and answer are enclosed within "
    "<think> </think> and <answer> </answer> tags.\nUse exactly one <think>...</think> block "
    "followed by exactly one <answer>...</answer> block.\n"
)


def make_conversation(example):
    return {
        "prompt": [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": example["problem"]},
        ],
    }


train_dataset = train_dataset.map(make_conversation)
print(train_dataset[0])
train_dataset = train_dataset.remove_columns(["messages", "problem"])
print(train_dataset)

model_name = os.environ["PORT_MODEL"]

model = AutoModelForCausalLM.from_pretrained(
    model_name,
    dtype="float32",
    device_map="auto",
)

# You may need to update `target_modules` depending on the architecture of your chosen model.
# For example, different LLMs might have different attention/projection layer names.
peft_config = LoraConfig(
    r=32,
    lora_alpha=32,
    target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
)


def format_reward(completions, **kwargs):
    """Reward function that checks if the reasoning process is enclosed within <think> and
    </think> tags, while the final answer is enclosed within <answer> and </answer> tags."""
    pattern = r"<think>.*?</think>.*?<answer>.*?</answer>"

    matches = []
    for item in completions:
        text = item[0]["content"] if isinstance(item, list) else item
        match = re.match(pattern, text, re.DOTALL | re.MULTILINE)
        matches.append(match)

    return [1.0 if match else 0.0 for match in matches]


output_dir = os.environ["PORT_OUTPUT_DIR"]

# Configure training arguments using GRPOConfig
training_args = TBAConfig(
    learning_rate=2e-5,  # Learning rate used during training
    num_train_epochs=1,  # Number of full dataset passes. For testing, use `max_steps` instead
    # max_steps=100,
    # Parameters that control the data preprocessing
    per_device_train_batch_size=8,
    max_completion_length=256,  # Max completion length produced during training
    num_generations=8,  # Number of generations produced during training for comparison
    # Parameters related to reporting and saving
    output_dir=output_dir,  # Where to save model checkpoints and logs
    logging_steps=10,  # Log training metrics every N steps
    report_to="trackio",  # Experiment tracking tool
    trackio_space_id=output_dir,  # HF Space where you trackio will be
    # Hub integration
    push_to_hub=True,  # Push the resulted model to the Hub
    log_completions=True,  # Log completions during training
)

trainer = TBATrainer(
    model=model,
    reward_funcs=[format_reward],
    args=training_args,
    train_dataset=train_dataset,
    peft_config=peft_config,
)

trainer_stats = trainer.train()

print(f"{trainer_stats.metrics['train_runtime']} seconds used for training.")
print(f"{round(trainer_stats.metrics['train_runtime']/60, 2)} minutes used for training.")

trainer.save_model(output_dir)
trainer.push_to_hub(dataset_name=dataset_id)
