"""The embedded math task (`task.name=math`): the world's word problems as prompts, reward 1 when
the completion's last number is the answer (`tba.tasks.verifiers.last_number`), held-out greedy
pass@1 on problems no training prompt holds."""

from __future__ import annotations

from tba.core import Task
from tba.tasks.math import world
from tba.tasks.verifiers.last_number import last_number_reward


def math_task(*, num_train: int, num_eval: int, seed: int) -> Task:
    """The embedded math task, its problems generated from `seed`."""

    def rows(split: str, count: int) -> list[dict]:
        return [
            {"prompt": world.format_prompt(p.question), "answer": p.answer}
            for p in world.problems(split, count, seed)
        ]

    return Task(
        name="math",
        train_rows=rows("train", num_train),
        eval_rows=rows("test", num_eval),
        reward_fns=[last_number_reward],
        correct_fn=last_number_reward,
    )
