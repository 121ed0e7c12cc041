"""Tasks: a dataset of prompts (rows with a `prompt` column and any others), reward functions
`fn(prompts, completions, **columns) -> list[float]`, and a correctness check for evaluation.

`math` is the embedded synthetic task (`tba.tasks.math`); `gsm8k`, `competition_math` and `tldr`
read real data (`tba.tasks.build`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tba.config import TaskConfig

RewardFn = Callable[..., list[float]]


@dataclass
class Task:
    name: str
    train_rows: list[dict]  # each row: {"prompt": str, **columns}
    eval_rows: list[dict]
    reward_fns: list[RewardFn]
    correct_fn: RewardFn  # 1.0 / 0.0 per completion: what pass@k counts


def load_task(config: TaskConfig, *, seed: int, policy_model: str | None = None) -> Task:
    """The task `config.name`: the embedded math task, or a dataset task on its configured data
    (`tba.tasks.build`). `policy_model` lends its tokenizer to a reward model saved without one."""
    if config.name == "math":
        return build_task(
            "math", num_train=config.num_train, num_eval=config.num_eval, seed=seed
        )
    from tba.tasks.build import dataset_task

    return dataset_task(config, policy_model=policy_model)


def build_task(name: str, *, num_train: int, num_eval: int, seed: int) -> Task:
    """The embedded task `name` (`math`), generated from `seed`."""
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
