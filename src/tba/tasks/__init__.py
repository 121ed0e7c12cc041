"""Tasks: a dataset of prompts (rows with a `prompt` column and any others), reward functions
`fn(prompts, completions, **columns) -> list[float]`, and a correctness check for evaluation."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

RewardFn = Callable[..., list[float]]


@dataclass
class Task:
    name: str
    train_rows: list[dict]  # each row: {"prompt": str, **columns}
    eval_rows: list[dict]
    reward_fns: list[RewardFn]
    correct_fn: RewardFn  # 1.0 / 0.0 per completion: what pass@k counts


def build_task(name: str, *, num_train: int, num_eval: int, seed: int) -> Task:
    if name != "math":
        raise ValueError(f"unknown task {name!r}; available: math")
    from tba.tasks import math as math_task

    def rows(split: str, count: int) -> list[dict]:
        return [
            {"prompt": math_task.format_prompt(p.question), "answer": p.answer}
            for p in math_task.problems(split, count, seed)
        ]

    return Task(
        name="math",
        train_rows=rows("train", num_train),
        eval_rows=rows("test", num_eval),
        reward_fns=[math_task.correctness_reward],
        correct_fn=math_task.correctness_reward,
    )
