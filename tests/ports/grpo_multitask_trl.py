# The multi-task example of TRL's GRPO documentation ("Example 4: Multi-task reward functions"):
# one dataset of math and coding prompts, one reward function per task, each returning None for
# the rows it does not score, and TRL's defaults (no GRPOConfig). As TRL gives it, the coding
# function looks for the task "coding" where the rows say "code": no function scores those rows,
# which TRL warns about. `check_math_solution` and `test_code_solution`, left to the reader there,
# are small stand-ins here, and the model is read from the environment (the tests run offline,
# on a tiny local model). One of a pair: grpo_multitask_trl.py for TRL, grpo_multitask_tba.py the
# same script ported to tba by changing its import and its trainer class (it has no config).
import os

from datasets import Dataset
from trl import GRPOTrainer

ANSWERS = {"What is 2+2?": "4", "What is 3*4?": "12"}


def check_math_solution(prompt, completion):
    return ANSWERS[prompt] in completion


def test_code_solution(prompt, completion):
    return "def " in completion and "return" in completion


# Define a dataset that contains both math and coding problems
dataset = Dataset.from_list(
    [
        {"prompt": "What is 2+2?", "task": "math"},
        {"prompt": "Write a function that returns the sum of two numbers.", "task": "code"},
        {"prompt": "What is 3*4?", "task": "math"},
        {"prompt": "Write a function that returns the product of two numbers.", "task": "code"},
    ]
)


# Math-specific reward function
def math_reward_func(prompts, completions, task, **kwargs):
    rewards = []
    for prompt, completion, t in zip(prompts, completions, task):
        if t == "math":
            # Calculate math-specific reward
            correct = check_math_solution(prompt, completion)
            reward = 1.0 if correct else -1.0
            rewards.append(reward)
        else:
            # Return None for non-math tasks
            rewards.append(None)
    return rewards


# Coding-specific reward function
def coding_reward_func(prompts, completions, task, **kwargs):
    rewards = []
    for prompt, completion, t in zip(prompts, completions, task):
        if t == "coding":
            # Calculate coding-specific reward
            works = test_code_solution(prompt, completion)
            reward = 1.0 if works else -1.0
            rewards.append(reward)
        else:
            # Return None for non-coding tasks
            rewards.append(None)
    return rewards


# Use both task-specific reward functions
trainer = GRPOTrainer(
    model=os.environ["PORT_MODEL"],
    reward_funcs=[math_reward_func, coding_reward_func],
    train_dataset=dataset,
)

trainer.train()
