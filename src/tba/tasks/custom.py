"""Your own task: prompts from any dataset, rewards from your functions or reward models.

Rows are dicts with a `prompt` column (or fields a `task.prompt_template` renders into one);
every other column reaches the reward functions as a keyword argument, as in TRL:
`fn(prompts=..., completions=..., completion_ids=..., **columns) -> list[float | None]`
(`tba.rewards.scorer`). A prompt may also be a conversation, as
in TRL: a list of `{"role", "content"}` messages (system, user and assistant turns) that the
policy's chat template renders, ending with the user's turn, or with the assistant's, which the
completion then continues. Reward functions get conversations as TRL gives them: the prompt's
messages, and each completion as `[{"role": "assistant", "content": ...}]`, a prefill moved from
the prompt to the front of the completion (`tba.rewards.scorer.as_reward_inputs`).

The rewards of all functions are summed (weighted by `task.reward_weights`). Held-out evaluation
is greedy pass@1 of `eval_func` when one is given (1 = correct), else `eval_reward`: the mean
reward of greedy completions. Without held-out rows, the first `task.num_eval` training prompts
are evaluated (a learning curve on seen prompts, not a held-out score).
"""

from __future__ import annotations

import importlib
import importlib.util
import math
from collections.abc import Callable, Iterable
from pathlib import Path

from tba.config import TaskConfig
from tba.core import RewardFn, Task
from tba.errors import ConfigError, DatasetError
from tba.evaluation import EvalSettings, score_completions
from tba.rewards.models import RewardModel
from tba.tasks.datasets import read_rows, sources
from tba.templates import render, template_fields
from tba.trust import untrusted


def import_function(spec: str, key: str = "task.reward_funcs") -> Callable:
    """The function named by `module:function`: a module importable in every process (on a
    cluster, on every node), or a `.py` file, read here and sent to the searchers by value."""
    module_name, _, attribute = spec.rpartition(":")
    if not module_name or not attribute:
        raise ConfigError(f"{key}: {spec!r} is not `module:function`")
    try:
        if module_name.endswith(".py"):
            path = Path(module_name).expanduser()
            loader = importlib.util.spec_from_file_location(path.stem, path)
            if loader is None or not path.exists():
                raise ImportError(f"no file {path}")
            module = importlib.util.module_from_spec(loader)
            # Left out of sys.modules on purpose: its functions are then pickled by value and
            # reach searcher processes that cannot import the file.
            loader.loader.exec_module(module)  # type: ignore[union-attr]
        else:
            module = importlib.import_module(module_name)
    except ImportError as error:
        raise ConfigError(f"{key}: cannot import {module_name!r}: {error}") from None
    function = getattr(module, attribute, None)
    if not callable(function):
        raise ConfigError(f"{key}: {module_name!r} has no function {attribute!r}")
    return function


def code_target(spec: str) -> str | None:
    """What importing `module:function` runs: a `.py` file, as an absolute path, or the module's
    name (None for a spec that is not `module:function`, which `import_function` refuses)."""
    module_name, _, attribute = spec.rpartition(":")
    if not module_name or not attribute:
        return None
    if module_name.endswith(".py"):
        return str(Path(module_name).expanduser().resolve())
    return module_name


def is_code(spec: str) -> bool:
    """Whether a reward spec names a function (`module:function`), not a reward model."""
    return ":" in spec and not Path(spec).exists()


def named_code(config: TaskConfig) -> dict[str, list[str]]:
    """The code that building the task of `config` imports, and so runs (`code_target`), with
    the keys that name it: the custom task's task.reward_funcs and task.eval_func, when its rows
    come from the config (a task given in Python is not built from it)."""
    if config.name != "custom" or (config.train_path is None and config.dataset is None):
        return {}
    specs = [("task.reward_funcs", spec) for spec in config.reward_funcs if is_code(spec)]
    specs += [("task.eval_func", config.eval_func)] if config.eval_func else []
    named: dict[str, list[str]] = {}
    for key, spec in specs:
        target = code_target(spec)
        if target is not None and key not in named.setdefault(target, []):
            named[target].append(key)
    return named


def check_run_code(
    config: TaskConfig, recorded: TaskConfig, run_dir: Path, *, trusted: bool,
    log: Callable[[str], None],
) -> None:  # fmt: skip
    """Before building the task of `config` (a run's config, with overrides) for a run directory
    read again (`tba eval`, `tba train --resume`): the code that its own config.yaml
    (`recorded`) names runs only as this user's `tba train` recorded it there, or with
    `trusted` (--trust-code; `tba.trust`). Code only the overrides name is the user's own. Each
    file or module is said in one line before it is imported; refused, it is one line naming
    them all (`ConfigError`)."""
    own = named_code(recorded)
    named = {target: keys for target, keys in named_code(config).items() if target in own}
    doubtful = untrusted(run_dir, list(named))
    if doubtful and not trusted:
        listed = "; ".join(f"{_described(target)} ({', '.join(named[target])})"
                           for target in doubtful)  # fmt: skip
        raise ConfigError(f"{run_dir / 'config.yaml'} names code that your own `tba train` did "
                          f"not record in this run directory, and that would run now: {listed}; "
                          "if you trust it, add --trust-code (in Python: trust_code=True)")
    for target, keys in named.items():
        how = "trusted with --trust-code" if target in doubtful else "as this run recorded it"
        log(f"importing {_described(target)} ({', '.join(keys)}), {how}")


def _described(target: str) -> str:
    return target if target.endswith(".py") else f"the module {target}"


def reward_functions(
    specs: Iterable[str | RewardFn], *, device: str = "auto", batch_size: int = 32
) -> list[RewardFn]:
    """Callables as they are; a string is `module:function` when it has a colon, else a
    sequence-classification reward model (Hub id or directory) scoring prompt + completion."""
    functions: list[RewardFn] = []
    for number, spec in enumerate(specs):
        if callable(spec):
            functions.append(spec)
        elif is_code(spec):
            functions.append(import_function(spec))
        else:
            name = f"reward_model_{number}" if number else "reward_model"
            functions.append(RewardModel(spec, device=device, batch_size=batch_size, name=name))
    if not functions:
        raise ConfigError("the custom task needs at least one reward function (task.reward_funcs)")
    return functions


def prepare_rows(rows: Iterable[dict], template: str | None, where: str) -> tuple[list[dict], bool]:
    """(rows with a `prompt`, text or conversation, whether some prompt is a conversation)."""
    prepared: list[dict] = []
    conversational = False
    for number, row in enumerate(rows, start=1):
        row = dict(row)
        if template is not None:
            missing = [f for f in template_fields(template) if row.get(f) is None]
            if missing:
                raise DatasetError(f"{where}: row {number} has no {missing[0]!r} field")
            row["prompt"] = render(template, row)
        prompt = row.get("prompt")
        if isinstance(prompt, list):
            _check_conversation(prompt, f"{where}: row {number}")
            conversational = True
        elif prompt is None and "prompt" in row:  # an empty cell of a CSV file, a JSON null
            raise DatasetError(f"{where}: row {number}'s `prompt` is empty: every row needs a "
                               "prompt (text or a conversation)")  # fmt: skip
        elif prompt is None:
            raise DatasetError(f"{where}: row {number} has no text `prompt` column "
                               f"(it has: {', '.join(row) or 'none'})")  # fmt: skip
        elif not isinstance(prompt, str):
            raise DatasetError(f"{where}: row {number}'s `prompt` is a {type(prompt).__name__} "
                               f"({prompt!r:.40}), not text or a conversation (a list of "
                               "messages)")  # fmt: skip
        elif not prompt.strip():  # "" in JSON or a Python list of rows: as an empty CSV cell
            raise DatasetError(f"{where}: row {number}'s `prompt` is empty: every row needs a "
                               "prompt (text or a conversation)")  # fmt: skip
        prepared.append(row)
    if not prepared:
        raise DatasetError(f"{where} has no rows")
    return prepared, conversational


ROLES = ("system", "user", "assistant")


def _check_conversation(messages: list, where: str) -> None:
    """A conversation is `{"role": one of ROLES, "content": text}` messages; the last one is
    the user's (the completion answers it) or the assistant's (the completion continues it)."""
    for message in messages:
        if not (isinstance(message, dict) and message.get("role") in ROLES
                and isinstance(message.get("content"), str)):  # fmt: skip
            raise DatasetError(f"{where}: a conversational prompt is a list of messages "
                               f"{{'role': {' | '.join(ROLES)}, 'content': text}}, "
                               f"not {message!r:.80}")  # fmt: skip
    if not messages or messages[-1]["role"] == "system":
        raise DatasetError(f"{where}: a conversational prompt ends with a user or an "
                           "assistant message")  # fmt: skip


class MeanReward:
    """Held-out `eval_reward`: the mean reward of greedy completions (their weighted sum over the
    reward functions, as in training), over the completions that got one."""

    def __init__(self, functions: list[RewardFn], rows: list[dict]) -> None:
        self.functions, self.rows = functions, rows

    def __call__(self, model, tokenizer, settings: EvalSettings) -> dict[str, float]:
        scores = score_completions(model, tokenizer, self.rows, self.functions, settings,
                                   greedy=True, weights=settings.reward_weights)  # fmt: skip
        rewards = [total for total in scores.totals if math.isfinite(total)]
        mean = sum(rewards) / len(rewards) if rewards else math.nan
        unscored = len(scores.totals) - len(rewards)
        return {"eval_reward": mean} | ({"eval_unscored": float(unscored)} if unscored else {})


def custom_task(
    train_rows: list[dict],
    eval_rows: list[dict] | None,
    reward_fns: list[RewardFn],
    *,
    eval_func: RewardFn | None = None,
    num_eval: int | None = None,
    conversational: bool = False,
) -> Task:
    """A task from prepared rows (see `prepare_rows`); no held-out rows: the first `num_eval`
    training prompts are evaluated."""
    held_out = eval_rows if eval_rows else train_rows
    held_out = held_out[:num_eval] if num_eval is not None else held_out
    if eval_func is not None:
        return Task("custom", train_rows, held_out, reward_fns, correct_fn=eval_func,
                    conversational=conversational)  # fmt: skip
    return Task("custom", train_rows, held_out, reward_fns,
                evaluate=MeanReward(reward_fns, held_out), metrics=("eval_reward",),
                conversational=conversational)  # fmt: skip


def custom_task_from_config(config: TaskConfig) -> Task:
    """The CLI's custom task: rows from task.train_path / task.dataset, held-out rows from
    task.eval_path / task.eval_dataset when given, rewards from task.reward_funcs."""
    train_source, eval_source = sources(config)
    if train_source.path is None and train_source.dataset is None:
        raise ConfigError("task.name=custom needs task.train_path or task.dataset")
    template = config.prompt_template
    train_rows, chat = prepare_rows(read_rows(train_source, config.num_train), template,
                                    train_source.describe())  # fmt: skip
    eval_rows = None
    if eval_source.path is not None or config.eval_dataset is not None:
        eval_rows, _ = prepare_rows(read_rows(eval_source, config.num_eval), template,
                                    eval_source.describe())  # fmt: skip
    reward_fns = reward_functions(config.reward_funcs, device=config.reward_device,
                                  batch_size=config.reward_batch_size)  # fmt: skip
    eval_func = import_function(config.eval_func, "task.eval_func") if config.eval_func else None
    return custom_task(train_rows, eval_rows, reward_fns, eval_func=eval_func,
                       num_eval=config.num_eval, conversational=chat)  # fmt: skip
