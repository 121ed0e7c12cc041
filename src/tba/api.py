"""The Python API, shaped like TRL's `GRPOTrainer`:

    from tba import TBAConfig, TBATrainer

    def reward_len(completions, **kwargs):
        return [-abs(20 - len(c)) for c in completions]

    trainer = TBATrainer(model="Qwen/Qwen2.5-0.5B-Instruct", reward_funcs=reward_len,
                         train_dataset=dataset, args=TBAConfig(train={"max_steps": 200}))
    results = trainer.train()

`TBAConfig` is the same typed config tree as the YAML files and `tba train` overrides (`tba
config --reference` lists every field); `TBAConfig.from_overrides(["train.beta=0.1"])` builds one
from `key=value` strings. The trainer runs the task as `task.name=custom` (`tba.tasks.custom`):
reward functions and datasets follow TRL's conventions, and reward functions defined in your
own script reach the searcher processes (Ray pickles them by value).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from tba.config import RunConfig, load_config
from tba.core import RewardFn
from tba.loop import train
from tba.offline_eval import score_final
from tba.quiet import quiet_libraries
from tba.tasks.custom import custom_task, prepare_rows, reward_functions


class TBAConfig(RunConfig):
    """Every setting of a run (`tba config --reference`), as in the YAML files."""

    @classmethod
    def from_overrides(cls, overrides: Sequence[str] = (), path: str | None = None) -> TBAConfig:
        """Defaults, then the YAML file `path` (if any), then `a.b=value` strings."""
        return cls.model_validate(load_config(path, list(overrides)).model_dump())


class TBATrainer:
    """Post-train `model` with asynchronous Trajectory Balance on your prompts and rewards.

    - `model`: a Hub id, a directory saved with `save_pretrained`, or a loaded
      `PreTrainedModel` (saved beside the run directory, with `processing_class` as its
      tokenizer, or the tokenizer of `model.name_or_path`).
    - `reward_funcs`: one or a list of `fn(prompts, completions, **columns) -> list[float]`
      (plain or `async def`), or reward models by Hub id or directory; rewards are summed.
    - `train_dataset` / `eval_dataset`: a `datasets.Dataset` or a list of rows with a `prompt`
      column, text or a conversation (`[{"role": "system" | "user" | "assistant", "content":
      ...}]`, rendered by the tokenizer's chat template; reward functions then get completions
      as `[{"role": "assistant", "content": ...}]`, as in TRL); the other columns reach the
      reward functions. Without `eval_dataset`, the first `task.num_eval` training prompts are
      evaluated.
    - `eval_func`: 1 for a correct completion, 0 otherwise: held-out pass@1 (default: the mean
      reward of greedy completions, `eval_reward`).
    - `peft_config`: a `peft.LoraConfig` (rank, alpha, dropout, target modules), or None.
    """

    def __init__(
        self,
        model: Any,
        reward_funcs: RewardFn | str | Sequence[RewardFn | str],
        train_dataset: Iterable[dict],
        eval_dataset: Iterable[dict] | None = None,
        args: RunConfig | None = None,
        *,
        eval_func: RewardFn | None = None,
        processing_class: Any = None,
        peft_config: Any = None,
    ) -> None:
        config = (args or TBAConfig()).model_copy(deep=True)
        config.output_dir = config.output_dir or str(Path("runs") / time.strftime("%Y%m%d-%H%M%S"))
        if not isinstance(reward_funcs, list | tuple):
            reward_funcs = [reward_funcs]
        train_rows, chat = prepare_rows(_rows(train_dataset), None, "train_dataset")
        eval_rows = None
        if eval_dataset is not None:
            eval_rows, _ = prepare_rows(_rows(eval_dataset), None, "eval_dataset")
        functions = reward_functions(reward_funcs, device=config.task.reward_device,
                                     batch_size=config.task.reward_batch_size)  # fmt: skip
        self.task = custom_task(train_rows, eval_rows, functions, eval_func=eval_func,
                                num_eval=config.task.num_eval, conversational=chat)  # fmt: skip
        updates = {
            "task": {"name": "custom", "reward_funcs": [_describe(f) for f in reward_funcs],
                     "eval_func": _describe(eval_func) if eval_func else None},
            "policy": {"model": _model_path(model, processing_class, config.output_dir),
                       "chat_template": config.policy.chat_template or chat},
        }  # fmt: skip
        if peft_config is not None:
            updates["lora"] = _lora_settings(peft_config)
        data = config.model_dump()
        for section, values in updates.items():
            data[section] |= values
        self.args = RunConfig.model_validate(data)

    def train(self, resume_from_checkpoint: bool = False, overwrite: bool = False) -> dict:
        """Run to the end of `args.train` (steps or minutes). Returns `eval.json` (metrics at
        the start and the end, throughput, staleness) with `run_dir` added."""
        quiet_libraries()
        run_dir = train(self.args, resume=resume_from_checkpoint, overwrite=overwrite,
                        task=self.task)  # fmt: skip
        return {"run_dir": str(run_dir), **json.loads((run_dir / "eval.json").read_text())}

    def evaluate(self) -> dict[str, float]:
        """The held-out metrics of the trained policy (RUN_DIR/final), scored as `tba eval`
        does; `tba.offline_eval.score_snapshots(run_dir, task=trainer.task)` scores the
        snapshots."""
        return score_final(Path(self.args.output_dir), task=self.task)["metrics"]


def _rows(dataset: Iterable[dict]) -> list[dict]:
    to_list = getattr(dataset, "to_list", None)  # a datasets.Dataset
    return to_list() if callable(to_list) else [dict(row) for row in dataset]


def _describe(function: Callable | str) -> str:
    """What the saved config records of a reward function: `module:name`, or the model id."""
    if isinstance(function, str):
        return function
    name = getattr(function, "__qualname__", None) or type(function).__qualname__
    return f"{getattr(function, '__module__', None) or type(function).__module__}:{name}"


def _model_path(model: Any, processing_class: Any, output_dir: str) -> str:
    if isinstance(model, str | Path):
        return str(model)
    tokenizer = processing_class or AutoTokenizer.from_pretrained(model.name_or_path)
    path = Path(f"{output_dir}-base-model")  # beside the run: --overwrite does not delete it
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def _lora_settings(peft_config: Any) -> dict:
    targets = peft_config.target_modules
    if isinstance(targets, set | frozenset | tuple):
        targets = sorted(targets)
    return {"r": peft_config.r, "alpha": float(peft_config.lora_alpha),
            "dropout": float(peft_config.lora_dropout),
            "target_modules": targets if targets is not None else "all-linear"}  # fmt: skip
