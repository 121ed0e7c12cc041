"""The Python API, shaped like TRL's `GRPOTrainer`: a TRL GRPO script becomes a tba script by
changing the import, the trainer class and the config class.

    from tba import TBAConfig, TBATrainer

    def reward_len(completions, **kwargs):
        return [-abs(20 - len(c)) for c in completions]

    trainer = TBATrainer(model="Qwen/Qwen2.5-0.5B-Instruct", reward_funcs=reward_len,
                         args=TBAConfig(output_dir="out", max_steps=200), train_dataset=dataset)
    trainer.train()

`TBAConfig` is the typed config tree of the YAML files and `tba train` overrides (`tba config
--reference` lists every field), and also reads TRL's `GRPOConfig` arguments (`tba.trl_args`);
`TBAConfig.from_overrides(["train.beta=0.1"])` builds one from `key=value` strings. The trainer
runs the task as `task.name=custom` (`tba.tasks.custom`): reward functions are called with TRL's
keywords (`tba.rewards.scorer`), datasets follow TRL's conventions, and reward functions defined
in your own script reach the searcher processes (Ray pickles them by value).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, PrivateAttr, ValidationError
from transformers import AutoTokenizer, PreTrainedModel

from tba.config import RunConfig, apply_overrides, first_error_line, load_config
from tba.core import RewardFn
from tba.errors import ConfigError
from tba.loop import train
from tba.offline_eval import score_final
from tba.policy.model import is_lora
from tba.quiet import quiet_libraries
from tba.run_dir import RunExistsError
from tba.tasks.custom import custom_task, prepare_rows, reward_functions
from tba.trl_args import from_trl

OVERRIDES_VARIABLE = "TBA_OVERRIDES"


class TBAConfig(RunConfig):
    """Every setting of a run (`tba config --reference`), as in the YAML files, by section
    (`TBAConfig(train={"learning_rate": 1e-5})`), and TRL's `GRPOConfig` arguments
    (`TBAConfig(learning_rate=1e-5, num_generations=4)`, docs/trl.md). A bad value is one line
    (`ConfigError`) naming the setting. The environment variable `TBA_OVERRIDES` (`key=value`
    settings separated by spaces, as `tba train` takes them) applies on top: an unchanged script
    runs with other settings, e.g. `TBA_OVERRIDES="train.mode=sync searchers.count=0"`."""

    _trl_notes: list[str] = PrivateAttr(default_factory=list)

    def __init__(self, **settings: Any) -> None:
        data, notes = _from_arguments(settings)
        try:
            super().__init__(**data)
        except ValidationError as error:
            raise ConfigError(first_error_line(error)) from None
        self._trl_notes = notes

    @classmethod
    def from_overrides(cls, overrides: Sequence[str] = (), path: str | None = None) -> TBAConfig:
        """Defaults, then the YAML file `path` (if any), then `a.b=value` strings (for the custom
        task, which is what the trainer runs)."""
        config = load_config(path, ["task.name=custom", *overrides])
        return cls.model_validate(config.model_dump())


def _from_arguments(settings: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """tba sections as they are, TRL's arguments through `from_trl`: the data to validate, and
    the notes to give when the run starts."""
    native = {name: value for name, value in settings.items()
              if name in RunConfig.model_fields and name != "report_to"}  # fmt: skip
    mapped, notes = from_trl({k: v for k, v in settings.items() if k not in native})
    overrides = shlex.split(os.environ.get(OVERRIDES_VARIABLE, ""))
    if overrides:
        notes.append(f"{OVERRIDES_VARIABLE} sets {', '.join(overrides)}")
    data = {name: value.model_dump() if isinstance(value, BaseModel) else value
            for name, value in native.items()}  # fmt: skip
    for dotted, value in mapped.items():
        *sections, leaf = dotted.split(".")
        node = data
        for section in sections:
            node = node.setdefault(section, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{section} must be a mapping of settings")
        if leaf in node and dotted.split(".")[0] in native:
            raise ConfigError(f"{dotted} is set twice: by a TRL argument and in {sections[0]}")
        node[leaf] = value
    return apply_overrides(data, overrides), notes


API_ADVICE = ("continue it with trainer.train(resume_from_checkpoint=True), replace it with "
              "trainer.train(overwrite=True), or choose another output_dir")


class TBATrainer:
    """Post-train `model` with asynchronous Trajectory Balance on your prompts and rewards. The
    arguments are TRL `GRPOTrainer`'s, in its order:

    - `model`: a Hub id, a directory saved with `save_pretrained`, or a loaded `PreTrainedModel`
      (saved into the run directory, `base_model/`, with `processing_class` as its tokenizer, or
      the tokenizer of `model.name_or_path`); a model wrapped by `peft.get_peft_model` trains its
      adapters (its base weights are the reference policy).
    - `reward_funcs`: one or a list of reward functions (plain or `async def`), called with TRL's
      keywords (`prompts`, `completions`, `completion_ids`, `trainer_state`, the dataset's other
      columns; see `tba.rewards.scorer`), or reward models by Hub id or directory.
    - `args`: a `TBAConfig` (tba's settings or TRL's `GRPOConfig` arguments).
    - `train_dataset` / `eval_dataset`: a `datasets.Dataset`, a pandas DataFrame or a list of
      rows with a `prompt` column, text or a conversation (`[{"role": "system" | "user" |
      "assistant", "content": ...}]`, rendered by the tokenizer's chat template; reward functions
      then get completions as `[{"role": "assistant", "content": ...}]`, as in TRL). Without
      `eval_dataset`, the first `task.num_eval` training prompts are evaluated.
    - `peft_config`: a `peft.LoraConfig` (rank, alpha, dropout, target modules), or None.
    - `eval_func` (tba's own): 1 for a correct completion, 0 otherwise: held-out pass@1
      (default: the mean reward of greedy completions, `eval_reward`).

    TRL's `reward_processing_classes`, `callbacks` and `optimizers` have no equivalent here: tba
    tokenizes reward models with their own tokenizers, has no callbacks, and builds its own
    optimizer.
    """

    def __init__(
        self,
        model: str | Path | PreTrainedModel,
        reward_funcs: RewardFn | str | Sequence[RewardFn | str],
        args: RunConfig | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        reward_processing_classes: Any = None,
        callbacks: Any = None,
        optimizers: tuple = (None, None),
        peft_config: Any = None,
        *,
        eval_func: RewardFn | None = None,
    ) -> None:
        _refuse_unsupported(reward_processing_classes, callbacks, optimizers)
        config = (args if args is not None else TBAConfig()).model_copy(deep=True)
        self.notes = list(getattr(args, "_trl_notes", []))
        config.output_dir = config.output_dir or str(Path("runs") / time.strftime("%Y%m%d-%H%M%S"))
        reward_funcs = _reward_list(reward_funcs)
        if train_dataset is None:
            raise ConfigError("TBATrainer needs a train_dataset: rows with a `prompt` column")
        train_rows, chat = prepare_rows(_rows(train_dataset, "train_dataset"), None,
                                        "train_dataset")  # fmt: skip
        eval_rows = None
        if eval_dataset is not None:
            eval_rows, _ = prepare_rows(_rows(eval_dataset, "eval_dataset"), None, "eval_dataset")
        functions = reward_functions(reward_funcs, device=config.task.reward_device,
                                     batch_size=config.task.reward_batch_size)  # fmt: skip
        weights = config.task.reward_weights
        if weights is not None and len(weights) != len(functions):
            raise ConfigError(f"reward_weights has {len(weights)} weights for {len(functions)} "
                              "reward functions")  # fmt: skip
        self.task = custom_task(train_rows, eval_rows, functions, eval_func=eval_func,
                                num_eval=config.task.num_eval, conversational=chat)  # fmt: skip
        self._save_policy: Callable[[Path], None] | None = None
        if isinstance(model, str | Path):
            policy = str(model)
        else:
            peft_config = peft_config or _adapters_of(model)
            tokenizer = processing_class or AutoTokenizer.from_pretrained(model.name_or_path)
            self._save_policy = partial(_save_base_model, model, tokenizer)
            policy = str(Path(config.output_dir) / "base_model")
        updates = {
            "task": {"name": "custom", "reward_funcs": [_describe(f) for f in reward_funcs],
                     "eval_func": _describe(eval_func) if eval_func else None},
            "policy": {"model": policy, "chat_template": config.policy.chat_template or chat},
        }  # fmt: skip
        if peft_config is not None:
            updates["lora"] = _lora_settings(peft_config)
        data = config.model_dump()
        for section, values in updates.items():
            data[section] |= values
        self.args = RunConfig.model_validate(data)
        self.run_dir: Path | None = None

    def train(self, resume_from_checkpoint: bool = False, overwrite: bool = False) -> dict:
        """Run to the end of `args.train` (steps, epochs or minutes). Returns `eval.json`
        (metrics at the start and the end, throughput, staleness) with `run_dir` added.
        `resume_from_checkpoint`: continue the run in `output_dir` from its newest checkpoint;
        `overwrite`: replace a run that is there."""
        quiet_libraries()
        for note in self.notes:
            print(f"tba: {note}")
        try:
            self.run_dir = train(self.args, resume=resume_from_checkpoint, overwrite=overwrite,
                                 task=self.task, save_policy=self._save_policy)  # fmt: skip
        except RunExistsError as error:
            raise RunExistsError(error.path, API_ADVICE) from None
        return {"run_dir": str(self.run_dir),
                **json.loads((self.run_dir / "eval.json").read_text())}  # fmt: skip

    def evaluate(self) -> dict[str, float]:
        """The held-out metrics of the trained policy (RUN_DIR/final), scored as `tba eval`
        does; `tba.offline_eval.score_snapshots(run_dir, task=trainer.task)` scores the
        snapshots."""
        return score_final(Path(self.args.output_dir), task=self.task)["metrics"]

    def save_model(self, output_dir: str | Path | None = None) -> Path:
        """The trained policy and its tokenizer into `output_dir` (default: the run directory),
        loadable with `from_pretrained` (with LoRA: the adapters merged in, and alone in
        `adapter/`), as TRL's `trainer.save_model` saves them."""
        final = Path(self.args.output_dir) / "final"
        if not (final / "config.json").is_file():
            raise FileNotFoundError(f"no trained policy in {final}: call trainer.train() first")
        target = Path(output_dir) if output_dir is not None else Path(self.args.output_dir)
        shutil.copytree(final, target, dirs_exist_ok=True)
        return target


def _refuse_unsupported(reward_processing_classes: Any, callbacks: Any, optimizers: tuple) -> None:
    """TRL's arguments that have no equivalent: one line each, rather than ignored."""
    if reward_processing_classes is not None:
        raise ConfigError("reward_processing_classes has no tba equivalent: a reward model given "
                          "by id or directory is read with its own tokenizer")  # fmt: skip
    if callbacks:
        raise ConfigError("callbacks have no tba equivalent: tba reports every step to "
                          "metrics.jsonl, TensorBoard or W&B (report_to)")  # fmt: skip
    if tuple(optimizers) != (None, None):
        raise ConfigError("optimizers has no tba equivalent: tba builds its own Adam "
                          "(train.learning_rate, train.warmup_steps)")  # fmt: skip


def _reward_list(reward_funcs: Any) -> list:
    """One reward function (or model id) or a list of them, checked."""
    functions = list(reward_funcs) if isinstance(reward_funcs, list | tuple) else [reward_funcs]
    for function in functions:
        if not (callable(function) or isinstance(function, str | Path)):
            raise ConfigError(
                f"reward_funcs: a function, a reward model's Hub id or directory, or a list of "
                f"them; got {type(function).__name__} {function!r:.40}"
            )
    return [str(f) if isinstance(f, Path) else f for f in functions]


def _rows(dataset: Any, where: str) -> list[dict]:
    """A dataset's rows as dicts: a `datasets.Dataset`, a pandas DataFrame or rows (dicts)."""
    if isinstance(dataset, str | Path):
        raise ConfigError(f"{where}: a path ({dataset}); load it first, e.g. "
                          "datasets.load_dataset('json', data_files=PATH, split='train'), or "
                          "give it to `tba train` as task.train_path")  # fmt: skip
    if isinstance(dataset, Mapping):  # a DatasetDict, or a dict of columns
        raise ConfigError(f"{where}: a mapping ({', '.join(map(str, dataset))}); pass one split, "
                          "e.g. dataset['train'], or a list of rows")  # fmt: skip
    if hasattr(dataset, "to_dict") and hasattr(dataset, "columns"):  # a pandas DataFrame
        return dataset.to_dict("records")
    to_list = getattr(dataset, "to_list", None)  # a datasets.Dataset
    if callable(to_list):
        return to_list()
    rows = list(dataset)
    wrong = next((row for row in rows if not isinstance(row, dict)), None)
    if wrong is not None:
        raise ConfigError(f"{where}: rows must be dicts with a `prompt` column, got a "
                          f"{type(wrong).__name__} ({wrong!r:.40}); for a list of prompts use "
                          "[{'prompt': p} for p in prompts]")  # fmt: skip
    return [dict(row) for row in rows]


def _describe(function: Callable | str) -> str:
    """What the saved config records of a reward function: `module:name`, or the model id."""
    if isinstance(function, str):
        return function
    name = getattr(function, "__qualname__", None) or type(function).__qualname__
    return f"{getattr(function, '__module__', None) or type(function).__module__}:{name}"


def _adapters_of(model: Any) -> Any:
    """The LoRA settings of a model wrapped by `peft.get_peft_model` (None for a plain model).
    Only fresh adapters are taken: trained ones would have to be merged, or kept as the start."""
    if not is_lora(model):
        return None
    config = model.peft_config[model.active_adapter]
    trained = any(torch.count_nonzero(p) for name, p in model.named_parameters()
                  if "lora_B" in name)  # fmt: skip
    if trained:
        raise ConfigError("the model's LoRA adapters are already trained: merge them into the "
                          "base model first (model.merge_and_unload()) and pass peft_config, or "
                          "pass the merged model")  # fmt: skip
    return config


def _save_base_model(model: PreTrainedModel, tokenizer: Any, path: Path) -> None:
    """A loaded model (without its adapters, when wrapped by peft) and its tokenizer, as a
    directory `from_pretrained` reads."""
    if is_lora(model):
        base = model.get_base_model()
        state = {name.replace(".base_layer.", "."): tensor
                 for name, tensor in base.state_dict().items() if ".lora_" not in name}  # fmt: skip
        base.save_pretrained(path, state_dict=state)
    else:
        model.save_pretrained(path)
    tokenizer.save_pretrained(path)


def _lora_settings(peft_config: Any) -> dict:
    targets = peft_config.target_modules
    if isinstance(targets, set | frozenset | tuple):
        targets = sorted(targets)
    return {"r": peft_config.r, "alpha": float(peft_config.lora_alpha),
            "dropout": float(peft_config.lora_dropout),
            "target_modules": targets if targets is not None else "all-linear"}  # fmt: skip
