"""Tasks on real datasets (`task.name` gsm8k, competition_math, tldr), built from `TaskConfig`.

Each split comes from a local file (`task.train_path` / `task.eval_path`) or, without one, by
name and split from `task.dataset` (held-out rows: `task.eval_dataset` when given). Every row
becomes `{"prompt": task.prompt_template rendered on the row, <gold column>: ...}`: `answer`
(the final answer) for the math tasks, `reference` (the reference summary) for tldr. Only the
first `task.num_train` / `task.num_eval` rows are read.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

from tba.tasks import Task, competition_math, gsm8k, tldr
from tba.tasks.data import Source, task_rows

if TYPE_CHECKING:
    from tba.config import TaskConfig

DEFAULT_TEMPLATES = {
    "gsm8k": "[MATH_TASK] Problem:\n{question}\n\nSolution:",
    "competition_math": competition_math.PROMPT_TEMPLATE,
    "tldr": tldr.PROMPT_TEMPLATE,
}
DEFAULT_ANSWER_FIELDS = {
    "gsm8k": "answer",
    "competition_math": "solution",
    "tldr": tldr.ANSWER_FIELD,
}


def sources(config: TaskConfig) -> tuple[Source, Source]:
    """Where the train and the held-out rows come from."""
    train = Source(
        config.train_path,
        dataset=config.dataset,
        dataset_config=config.dataset_config,
        split=config.train_split,
        key="task.train_path",
    )
    if config.eval_dataset is not None:
        eval_dataset, eval_config = config.eval_dataset, config.eval_dataset_config
    else:
        eval_dataset = config.dataset
        eval_config = config.eval_dataset_config or config.dataset_config
    held_out = Source(
        config.eval_path,
        dataset=eval_dataset,
        dataset_config=eval_config,
        split=config.eval_split,
        key="task.eval_path",
    )
    return train, held_out


def _gsm8k_gold(answer: object) -> str:
    gold = gsm8k.gold_answer(str(answer))
    if gsm8k.parse_number(gold) is None:
        raise ValueError(f"the final answer {gold!r} is not a number (expected '... #### 42')")
    return gold


def _math_gold(solution: object) -> str:
    gold = competition_math.gold_answer(str(solution))
    if not gold:
        raise ValueError("empty answer")
    return gold


def _reference(summary: object) -> str:
    return str(summary)


def dataset_task(
    config: TaskConfig, *, policy_model: str | None = None, cache_dir: str | None = None
) -> Task:
    """The task `config.name` on its configured data. `policy_model` lends its tokenizer to a
    reward model saved without one."""
    name = config.name
    template = config.prompt_template or DEFAULT_TEMPLATES[name]
    answer_field = config.answer_field or DEFAULT_ANSWER_FIELDS[name]
    column, convert = {
        "gsm8k": ("answer", _gsm8k_gold),
        "competition_math": ("answer", _math_gold),
        "tldr": ("reference", _reference),
    }[name]
    train_source, eval_source = sources(config)
    read = partial(
        task_rows,
        template=template,
        answer_field=answer_field,
        column=column,
        convert=convert,
        cache_dir=cache_dir,
    )
    train_rows = read(train_source, limit=config.num_train)
    eval_rows = read(eval_source, limit=config.num_eval)
    if name == "gsm8k":
        reward_fns, correct_fn = [gsm8k.gsm8k_reward], gsm8k.gsm8k_reward
    elif name == "competition_math":
        reward_fns, correct_fn = [competition_math.boxed_reward], competition_math.boxed_reward
    else:
        reward_fns, correct_fn = _tldr_rewards(config, policy_model)
    return Task(
        name=name,
        train_rows=train_rows,
        eval_rows=eval_rows,
        reward_fns=reward_fns,
        correct_fn=correct_fn,
    )


def _tldr_rewards(config: TaskConfig, policy_model: str | None) -> tuple[list, tldr.WinRate]:
    fallback = policy_model if policy_model and not policy_model.startswith("builtin:") else None
    options = {
        "device": config.reward_device,
        "batch_size": config.reward_batch_size,
        "tokenizer_fallback": fallback,
    }
    assert config.reward_model is not None  # TaskConfig requires it for tldr
    reward = tldr.RewardModel(config.reward_model, **options)
    judge = (
        tldr.RewardModel(config.eval_reward_model, name="eval_reward_model", **options)
        if config.eval_reward_model
        else reward
    )
    return [reward], tldr.WinRate(judge)
