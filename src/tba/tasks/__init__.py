"""Tasks: a dataset of prompts (rows with a `prompt` column and any others), reward functions
`fn(prompts, completions, **columns) -> list[float]`, and a correctness check for evaluation.

`math` (`tba.tasks.math`), `redteam` (`tba.tasks.redteam`, its world in
`tba.tasks.redteam_world`) and `summarize` (`tba.tasks.summarize`, its world in
`tba.tasks.summarize_world`) are embedded synthetic tasks; `gsm8k`, `competition_math` and `tldr`
read real data (`tba.tasks.build`); `custom` (`tba.tasks.custom`) is your data and reward
functions."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tba.config import TaskConfig

RewardFn = Callable[..., list[float]]
# A prompt is a text or a conversation: `{"role": "system" | "user" | "assistant", "content"}`
# messages, rendered by the policy's chat template.
Prompt = str | list[dict[str, str]]
# evaluate(model, tokenizer, settings: tba.evaluation.EvalSettings) -> {metric: value}
Evaluator = Callable[..., dict[str, float]]


@dataclass
class Task:
    name: str
    train_rows: list[dict]  # each row: {"prompt": Prompt, **columns}
    eval_rows: list[dict]
    reward_fns: list[RewardFn]
    correct_fn: RewardFn | None = None  # 1.0 / 0.0 per completion: what pass@k counts
    evaluate: Evaluator | None = None  # the task's own held-out metrics instead of pass@k
    metrics: tuple[str, ...] = ("eval_pass@1",)  # headline metrics: progress bar and plots
    # A file in the run directory where every distinct completion the searchers made is written
    # once, with its reward, reward parts and extras, and `annotate(completion)`'s fields.
    export_samples: str | None = None
    annotate: Callable[[str], dict] | None = None
    conversational: bool = False  # some prompts are conversations: needs a chat template


def load_task(
    config: TaskConfig,
    *,
    seed: int,
    policy_model: str | None = None,
    cache_dir: str = "~/.cache/tba",
    log=print,
) -> Task:
    """The task `config.name`: an embedded task (math; redteam and summarize, whose worlds are
    built once into `cache_dir`), or a dataset task on its configured data (`tba.tasks.build`).
    `policy_model` lends its tokenizer to a reward model saved without one, and is the reference
    policy of the preference tasks' KL metrics."""
    if config.name == "math":
        return build_task(
            "math", num_train=config.num_train, num_eval=config.num_eval, seed=seed
        )
    if config.name == "redteam":
        from tba.tasks import redteam

        return redteam.build_task(config, cache_dir, seed, log)
    if config.name == "summarize":
        from tba.tasks import summarize

        return summarize.build_task(config, policy_model, cache_dir, log)
    if config.name == "custom":
        from tba.tasks import custom

        return custom.build_task(config)
    from tba.tasks.build import dataset_task

    task = dataset_task(config, policy_model=policy_model)
    if config.name == "tldr":
        from tba.tasks.tldr import with_preference_metrics

        builtin = policy_model is None or policy_model.startswith("builtin:")
        return with_preference_metrics(task, None if builtin else policy_model)
    return task


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
