"""The task: its prompts, rewards and held-out data (`task`), and red-teaming's victim and
classifier (`task.redteam`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from tba.config.base import Section
from tba.config.devices import Device
from tba.templates import template_fields

DATASET_TASKS = ("gsm8k", "competition_math", "tldr")
EMBEDDED_TASKS = ("math", "redteam", "summarize")


class RedteamConfig(Section):
    """Red-teaming (`task.name=redteam`): the policy writes attacks on a frozen victim LM; a
    classifier scores the victim's answers. `builtin` models are the embedded world's."""

    victim_model: str = Field(
        "builtin", description="the victim: a causal LM, directory or Hub id (`builtin`: the "
        "embedded world's)",
    )
    victim_template: str = Field(
        "{attack} =>", description="the victim's prompt, `{attack}` replaced by the attack"
    )
    victim_samples: int = Field(5, ge=1, description="victim answers per attack")
    victim_max_new_tokens: int = Field(12, ge=1, description="length limit of an answer")
    victim_temperature: float = Field(1.0, gt=0, description="sampling temperature of the victim")
    classifier_model: str = Field(
        "builtin", description="P(harmful) of an answer: a sequence-classification model, "
        "directory or Hub id (`builtin`: the embedded world's)",
    )
    harmful_label: int = Field(1, ge=0, description="the classifier's label index of harmful")
    embedding_model: str | None = Field(
        None, description="diversity: mean-pooled hidden states of this model (directory or Hub "
        "id); default TF-IDF of word unigrams and bigrams",
    )
    min_attack_words: int = Field(
        3, ge=0, description="shorter attacks get the lowest reward, log 1e-4"
    )
    prompt: str | None = Field(
        None, description="the fixed prompt that asks the policy for an attack (default: the "
        "embedded world's few-shot prompt)",
    )


class TaskConfig(Section):
    name: Literal[
        "math", "redteam", "summarize", "gsm8k", "competition_math", "tldr", "custom"
    ] = Field(
        "math", description="`math`, `redteam` and `summarize`: embedded synthetic tasks "
        "(red-teaming a frozen victim; preference tuning of summaries); `gsm8k`, "
        "`competition_math` (MATH, `\\boxed{}` answers) and `tldr` "
        "(reward-model summaries) read real data; `custom`: your data and task.reward_funcs",
    )
    num_train: int | None = Field(
        5000, ge=1, description="training prompts (a dataset's first N rows; null: all)"
    )
    num_eval: int | None = Field(
        256, ge=1, description="held-out problems for greedy pass@1 (first N rows; null: all)"
    )
    num_eval_pass_k: int = Field(128, ge=1, description="held-out problems for pass@k")
    train_path: str | None = Field(
        None, description="training rows: a local .jsonl, .json, .parquet or .csv file "
        "(default: task.dataset's train_split)",
    )
    eval_path: str | None = Field(
        None, description="held-out rows, as train_path (default: eval_split of eval_dataset, "
        "else of dataset)",
    )
    dataset: str | None = Field(
        None, description="a dataset for `datasets.load_dataset` by name (a Hub id, or a local "
        "folder of split files), read where no path is given",
    )
    dataset_config: str | None = Field(
        None, description="its configuration, e.g. `main` for `openai/gsm8k`"
    )
    train_split: str = Field("train", description="split of task.dataset to train on")
    eval_dataset: str | None = Field(
        None, description="held-out rows from another dataset by name (default: task.dataset)"
    )
    eval_dataset_config: str | None = Field(
        None, description="configuration of eval_dataset (default: task.dataset_config)"
    )
    eval_split: str = Field("test", description="split of the held-out dataset to evaluate on")
    prompt_template: str | None = Field(
        None, description="prompt made from a row, `{column}` fields, `{{`/`}}` for braces "
        "(default per task; gsm8k: `[MATH_TASK] Problem:\\n{question}\\n\\nSolution:`)",
    )
    answer_field: str | None = Field(
        None, description="the row's gold column (default: gsm8k `answer`, text after "
        "`####`; competition_math `solution`, last `\\boxed{}`; tldr `reference_response`)",
    )
    reward_model: str | None = Field(
        None, description="tldr: sequence-classification reward model, Hub id or directory"
    )
    eval_reward_model: str | None = Field(
        None, description="tldr: the judge of the held-out win rate against the reference "
        "summaries (default: reward_model)",
    )
    reward_device: Device = Field(
        "auto", description="device of the reward models in each process, as policy.device"
    )
    reward_batch_size: int = Field(32, ge=1, description="texts per reward-model forward pass")
    reward_weights: list[float] | None = Field(
        None, description="one weight per reward function: a completion's reward is the "
        "weighted sum of the functions' values (default: all 1)",
    )
    reward_funcs: list[str] = Field(
        [], description="custom: reward functions `module:function` (a module on the Python "
        "path or a `.py` file), or sequence-classification reward models (Hub id or directory); "
        "their rewards are summed",
    )
    eval_func: str | None = Field(
        None, description="custom: `module:function` scoring a completion 1 (correct) or 0, "
        "for held-out pass@1 (default: the mean summed reward of greedy completions)",
    )
    redteam: RedteamConfig = RedteamConfig()

    @field_validator("eval_func", "reward_funcs", mode="before")
    @classmethod
    def _names_not_functions(cls, value: object, info: ValidationInfo) -> object:
        """A config names functions as `module:function`; a function itself is TBATrainer's
        argument (a config is saved as text, and read again by `tba eval` and `--resume`)."""
        given = value if isinstance(value, list | tuple) else [value]
        if any(callable(item) for item in given):
            raise ValueError(f"a Python function goes to TBATrainer({info.field_name}=...); "
                             f"task.{info.field_name} names one as `module:function` (a module "
                             "or a .py file)")  # fmt: skip
        return value

    @model_validator(mode="after")
    def _check(self) -> TaskConfig:
        for rule in TASK_RULES:
            rule(self)
        return self


# The data keys of the dataset tasks: an embedded task takes none of them.
DATA_KEYS = ("train_path", "eval_path", "dataset", "dataset_config", "eval_dataset",
             "eval_dataset_config", "prompt_template", "answer_field", "reward_model",
             "eval_reward_model")  # fmt: skip


def _reward_functions_only_for_custom(task: TaskConfig) -> None:
    """task.reward_funcs and task.eval_func are the custom task's."""
    if task.name != "custom" and (task.reward_funcs or task.eval_func):
        key = "reward_funcs" if task.reward_funcs else "eval_func"
        raise ValueError(f"task.{key} applies to the custom task, not to {task.name}")


def _embedded_tasks_read_no_dataset(task: TaskConfig) -> None:
    """An embedded task (math, redteam, summarize) makes its own data: no data keys."""
    if task.name in EMBEDDED_TASKS:
        given = [key for key in DATA_KEYS if getattr(task, key) is not None]
        if given:
            raise ValueError(
                f"task.{given[0]} applies to the dataset tasks ({', '.join(DATASET_TASKS)}), "
                f"not to the embedded {task.name} task"
            )


def _embedded_tasks_need_their_sizes(task: TaskConfig) -> None:
    """An embedded task makes as many prompts as task.num_train and task.num_eval say."""
    if task.name in EMBEDDED_TASKS and (task.num_train is None or task.num_eval is None):
        raise ValueError(f"the {task.name} task needs task.num_train and task.num_eval")


def _custom_task_takes_no_dataset_rewards(task: TaskConfig) -> None:
    """The custom task's rewards come from task.reward_funcs, not a gold column or a reward
    model of the dataset tasks (its data and rewards are checked where they are loaded)."""
    if task.name == "custom":
        wrong = [k for k in ("answer_field", "reward_model", "eval_reward_model")
                 if getattr(task, k) is not None]  # fmt: skip
        if wrong:
            raise ValueError(f"task.{wrong[0]} does not apply to the custom task (its "
                             "rewards come from task.reward_funcs)")  # fmt: skip


def _one_reward_weight_per_function(task: TaskConfig) -> None:
    """The custom task's task.reward_weights, where given with its functions: one each."""
    weights, functions = task.reward_weights, task.reward_funcs
    if task.name != "custom" or weights is None or not functions:
        return
    if len(weights) != len(functions):
        raise ValueError(f"task.reward_weights has {len(weights)} weights for "
                         f"{len(functions)} reward functions (task.reward_funcs): give "
                         "one weight per function")  # fmt: skip


def _dataset_tasks_need_training_rows(task: TaskConfig) -> None:
    """A dataset task reads its training rows from task.train_path or task.dataset."""
    if task.name in DATASET_TASKS and task.train_path is None and task.dataset is None:
        raise ValueError(f"task.name={task.name} needs task.train_path or task.dataset")


def _dataset_tasks_need_held_out_rows(task: TaskConfig) -> None:
    """A dataset task reads its held-out rows from task.eval_path, task.eval_dataset or
    task.dataset."""
    if (task.name in DATASET_TASKS and task.eval_path is None and task.eval_dataset is None
            and task.dataset is None):  # fmt: skip
        raise ValueError(
            f"task.name={task.name} needs task.eval_path, task.eval_dataset or task.dataset"
        )


def _tldr_needs_a_reward_model(task: TaskConfig) -> None:
    """tldr's rewards come from task.reward_model."""
    if task.name == "tldr" and task.reward_model is None:
        raise ValueError("task.name=tldr needs task.reward_model")


def _reward_model_only_for_tldr(task: TaskConfig) -> None:
    """The other dataset tasks check answers: no reward model."""
    if task.name in DATASET_TASKS and task.name != "tldr" and (
        task.reward_model or task.eval_reward_model
    ):
        raise ValueError(f"task.reward_model applies to tldr, not to {task.name}")


def _prompt_template_is_valid(task: TaskConfig) -> None:
    """task.prompt_template's `{column}` fields parse (ValueError naming the fault)."""
    if task.name not in EMBEDDED_TASKS and task.prompt_template is not None:
        template_fields(task.prompt_template)


# TaskConfig's cross-setting rules, checked in this order.
TASK_RULES = (
    _reward_functions_only_for_custom,
    _embedded_tasks_read_no_dataset,
    _embedded_tasks_need_their_sizes,
    _custom_task_takes_no_dataset_rewards,
    _one_reward_weight_per_function,
    _dataset_tasks_need_training_rows,
    _dataset_tasks_need_held_out_rows,
    _tldr_needs_a_reward_model,
    _reward_model_only_for_tldr,
    _prompt_template_is_valid,
)
