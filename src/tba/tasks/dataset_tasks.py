"""Tasks on real datasets (`task.name` gsm8k, competition_math, tldr), built from `TaskConfig`.

Each split comes from a local file (`task.train_path` / `task.eval_path`) or, without one, by
name and split from `task.dataset` (held-out rows: `task.eval_dataset` when given). Every row
becomes `{"prompt": task.prompt_template rendered on the row, <gold column>: ...}`: `answer`
(the final answer) for the math tasks, `reference` (the reference summary) for tldr. Only the
first `task.num_train` / `task.num_eval` rows are read.
"""

from __future__ import annotations

from functools import partial

from tba.config import TaskConfig
from tba.core import Task
from tba.rewards.models import RewardModel
from tba.tasks.datasets import sources, task_rows
from tba.tasks.preference import PreferenceEvaluator
from tba.tasks.verifiers import boxed, gsm8k

DEFAULT_TEMPLATES = {
    "gsm8k": "[MATH_TASK] Problem:\n{question}\n\nSolution:",
    "competition_math": boxed.PROMPT_TEMPLATE,
    "tldr": "{query}",
}
DEFAULT_ANSWER_FIELDS = {
    "gsm8k": "answer",
    "competition_math": "solution",
    "tldr": "reference_response",
}


def _gsm8k_gold(answer: object) -> str:
    gold = gsm8k.gold_answer(str(answer))
    if gsm8k.parse_number(gold) is None:
        raise ValueError(f"the final answer {gold!r} is not a number (expected '... #### 42')")
    return gold


def _math_gold(solution: object) -> str:
    gold = boxed.gold_answer(str(solution))
    if not gold:
        raise ValueError("empty answer")
    return gold


def _reference(summary: object) -> str:
    return str(summary)


def dataset_task(
    config: TaskConfig, *, policy_model: str | None = None, cache_dir: str | None = None
) -> Task:
    """The task `config.name` on its configured data. `policy_model` lends its tokenizer to a
    reward model saved without one, and is the reference policy of tldr's KL metrics (unless it
    is a built-in one)."""
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
        reward_fns, correct_fn = [boxed.boxed_reward], boxed.boxed_reward
    else:
        return _tldr_task(config, train_rows, eval_rows, policy_model)
    return Task(
        name=name,
        train_rows=train_rows,
        eval_rows=eval_rows,
        reward_fns=reward_fns,
        correct_fn=correct_fn,
    )


def _tldr_task(
    config: TaskConfig, train_rows: list[dict], eval_rows: list[dict], policy_model: str | None
) -> Task:
    """Preference tuning on TL;DR summaries: the reward is a reward model's score of prompt +
    summary (a summary cut off without EOS gets `train.truncation_penalty` instead, through the
    searcher's `train.truncated` rule). Held-out metrics (`tba.tasks.preference`): the win rate of
    the greedy summary against the row's reference summary under the evaluation reward model (the
    "gold" one, `task.eval_reward_model`, else the training one), both models' mean scores, and
    the KL to the reference policy (the run's starting `policy.model`, unless built-in) and its
    perplexity on the policy's sampled summaries."""
    given = policy_model is not None and not policy_model.startswith("builtin:")
    fallback = policy_model if given else None
    options = {
        "device": config.reward_device,
        "batch_size": config.reward_batch_size,
        "tokenizer_fallback": fallback,
    }
    assert config.reward_model is not None  # TaskConfig requires it for tldr
    reward = RewardModel(config.reward_model, key="task.reward_model", **options)
    judge = (
        RewardModel(config.eval_reward_model, name="eval_reward_model",
                    key="task.eval_reward_model", **options)
        if config.eval_reward_model
        else reward
    )
    evaluator = PreferenceEvaluator(eval_rows, judge.score_pairs, reward.score_pairs, fallback)
    return Task(
        name="tldr", train_rows=train_rows, eval_rows=eval_rows, reward_fns=[reward],
        evaluate=evaluator,
        metrics=("eval_win_rate", "eval_kl") if given else ("eval_win_rate",),
    )  # fmt: skip
