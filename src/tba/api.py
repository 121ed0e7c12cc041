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
from huggingface_hub import HfApi
from pydantic import PrivateAttr, ValidationError
from transformers import AutoTokenizer, PreTrainedModel
from transformers.trainer_utils import TrainOutput

from tba.config import RunConfig, apply_overrides, first_error_line, load_config
from tba.core import RewardFn
from tba.errors import ConfigError, RunError, first_line
from tba.interrupts import Advice
from tba.keys import get_key
from tba.offline_eval import score_final
from tba.policy.model import is_lora
from tba.quiet import quiet_libraries
from tba.rewards.scorer import check_reward_weights
from tba.run import train
from tba.run_dir import RunExistsError, read_metrics
from tba.tasks.custom import custom_task, prepare_rows, reward_functions
from tba.trl_args import TrlSettings, merge_arguments, quantization_settings

OVERRIDES_VARIABLE = "TBA_OVERRIDES"


class TBAConfig(RunConfig):
    """Every setting of a run (`tba config --reference`), as in the YAML files, by section
    (`TBAConfig(train={"learning_rate": 1e-5})`), and TRL's `GRPOConfig` arguments
    (`TBAConfig(learning_rate=1e-5, num_generations=4)`, docs/trl.md). Like a `GRPOConfig`, it
    starts from TRL's defaults (`tba.trl_args.TRL_DEFAULTS`) for what the script sets neither by
    TRL's name nor in tba's sections. A bad value is one line (`ConfigError`) naming the setting
    as the script wrote it. The environment variable `TBA_OVERRIDES` (`key=value` settings
    separated by spaces, as `tba train` takes them) applies on top of everything: an unchanged
    script runs with other settings, e.g. `TBA_OVERRIDES="train.mode=sync searchers.count=0"`."""

    _trl: TrlSettings = PrivateAttr(default_factory=TrlSettings)
    _hub: dict[str, Any] = PrivateAttr(default_factory=dict)

    def __init__(self, **settings: Any) -> None:
        data, trl, hub = _from_arguments(settings)
        try:
            super().__init__(**data)
        except ValidationError as error:
            raise ConfigError(_error_line(error, trl)) from None
        self._trl, self._hub = trl, hub

    @classmethod
    def from_overrides(cls, overrides: Sequence[str] = (), path: str | None = None) -> TBAConfig:
        """Defaults (tba's), then the YAML file `path` (if any), then `a.b=value` strings (for the
        custom task, which is what the trainer runs)."""
        config = load_config(path, ["task.name=custom", *overrides])
        return cls.model_validate(config.model_dump())


def _from_arguments(settings: dict[str, Any]) -> tuple[dict[str, Any], TrlSettings, dict]:
    """tba sections as they are and TRL's arguments (on TRL's defaults) merged
    (`tba.trl_args.merge_arguments`), then `TBA_OVERRIDES`: the data to validate, what TRL's
    names set, and the Hub upload's settings."""
    data, trl, hub = merge_arguments(settings, RunConfig.model_fields)
    data, overridden = with_env_overrides(data)
    trl.sources = {key: source for key, source in trl.sources.items()
                   if key not in overridden}  # fmt: skip
    return data, trl, hub


def env_overrides() -> list[str]:
    """The `key=value` settings of `TBA_OVERRIDES`."""
    return shlex.split(os.environ.get(OVERRIDES_VARIABLE, ""))


def with_env_overrides(data: dict[str, Any]) -> tuple[dict[str, Any], set[str]]:
    """`data` (nested settings) with `TBA_OVERRIDES` applied, and the keys it set: it wins over
    the script (a step limit there wins over the script's epochs: `tba.limits.step_limit`)."""
    overrides = env_overrides()
    data = apply_overrides(data, overrides)
    return data, {override.partition("=")[0].strip() for override in overrides}


def _error_line(error: ValidationError, trl: TrlSettings) -> str:
    """One line: the setting as the script wrote it (a TRL argument, when one set it), and what
    is wrong."""
    first = error.errors()[0]
    source = trl.sources.get(".".join(str(part) for part in first["loc"]))
    if source is None:
        return first_error_line(error)
    return f"{source}: {first['msg'].removeprefix('Value error, ')}"


API_ADVICE = ("continue it with trainer.train(resume_from_checkpoint=True), replace it with "
              "trainer.train(overwrite=True), or choose another output_dir")
API_WORDS = Advice(resume="trainer.train(resume_from_checkpoint=True)",
                   keep="train(overwrite=False) keeps it")  # fmt: skip


class TrainResult(TrainOutput):
    """What `TBATrainer.train()` returns: TRL's `TrainOutput` (`global_step`, `training_loss`,
    `metrics` with `train_runtime`, `train_samples_per_second`, `train_steps_per_second`,
    `train_loss` and `epoch`), whose `metrics` also hold tba's figures: eval.json's (`base` and
    `final` held-out metrics, throughput, staleness, ...) and `run_dir`; `result["final"]` reads
    them too."""

    __slots__ = ()

    def __getitem__(self, key: Any) -> Any:
        return self.metrics[key] if isinstance(key, str) else super().__getitem__(key)


class TBATrainer:
    """Post-train `model` with asynchronous Trajectory Balance on your prompts and rewards. The
    arguments are TRL `GRPOTrainer`'s, in its order:

    - `model`: a Hub id, a directory saved with `save_pretrained`, or a loaded `PreTrainedModel`
      (saved into the run directory, `base_model/`, with `processing_class` as its tokenizer, or
      the tokenizer of `model.name_or_path`); a model wrapped by `peft.get_peft_model` trains its
      adapters (its base weights are the reference policy).
    - `reward_funcs`: one or a list of reward functions (plain or `async def`), called with TRL's
      keywords (`prompts`, `completions`, `completion_ids`, `trainer_state`, the dataset's other
      columns; see `tba.rewards.scorer`), or reward models by Hub id or directory (found when
      the trainer is made: a name that is neither is a `ConfigError` at once, naming it).
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
    optimizer. `TBA_OVERRIDES` applies to `args` whichever way they were made.
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
        args = args if args is not None else TBAConfig()
        self.trl: TrlSettings = getattr(args, "_trl", TrlSettings())
        self.hub: dict[str, Any] = dict(getattr(args, "_hub", {}))
        try:
            config = RunConfig.model_validate(with_env_overrides(args.model_dump())[0])
        except ValidationError as error:
            raise ConfigError(f"{OVERRIDES_VARIABLE}: {first_error_line(error)}") from None
        # Absolute: searcher processes of a Ray instance started elsewhere run in its directory.
        output_dir = config.output_dir or Path("runs") / time.strftime("%Y%m%d-%H%M%S")
        config.output_dir = str(Path(output_dir).absolute())
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
        check_reward_weights(config.task.reward_weights, len(functions))
        self.task = custom_task(train_rows, eval_rows, functions, eval_func=eval_func,
                                num_eval=config.task.num_eval, conversational=chat)  # fmt: skip
        self._save_policy: Callable[[Path], None] | None = None
        quantization = None
        if isinstance(model, str | Path):
            policy = str(model)
        elif (quantization := _quantization_of(model)) is not None:
            # Its weights are quantized from where it was loaded, by every process alike.
            peft_config = peft_config or _adapters_of(model)
            policy = model.name_or_path
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
        if quantization is not None:
            updates["policy"]["dtype"] = quantization.pop("policy.dtype", config.policy.dtype)
            updates["quantization"] = {k.removeprefix("quantization."): v
                                       for k, v in quantization.items()}  # fmt: skip
        if peft_config is not None:
            updates["lora"] = _lora_settings(peft_config)
        data = config.model_dump()
        for section, values in updates.items():
            data[section] |= values
        self.args = RunConfig.model_validate(data)
        self.run_dir: Path | None = None

    def train(self, resume_from_checkpoint: bool | str = False,
              overwrite: bool = True) -> TrainResult:  # fmt: skip
        """Run to the end of `args.train` (steps, epochs or minutes); with `push_to_hub=True`,
        upload the trained policy then. Returns TRL's `TrainOutput` with tba's figures
        (`TrainResult`). As in TRL, a run already in `output_dir` is replaced, unless
        `resume_from_checkpoint` (True, or a checkpoint of `output_dir`) continues it from its
        newest checkpoint (or evaluates and saves it, when its training was complete but its end
        was cut short); `overwrite=False` refuses to replace it instead. A run replaced is said
        in one line and kept aside until this one has its first checkpoint: a run that fails
        before (a broken reward, Ctrl-C) leaves it as it was. Ctrl-C or SIGTERM during training
        stops after the step and saves; elsewhere (the evaluations, the saves) it raises
        `tba.errors.Interrupted`, a `KeyboardInterrupt` saying what is kept and how to go on."""
        quiet_libraries()
        for line in self.settings_lines():
            print(f"tba: {line}")
        resume = bool(resume_from_checkpoint)
        if isinstance(resume_from_checkpoint, str | Path):
            _check_checkpoint_path(Path(resume_from_checkpoint), Path(self.args.output_dir))
        try:
            self.run_dir = train(self.args, resume=resume, overwrite=overwrite and not resume,
                                 task=self.task, save_policy=self._save_policy,
                                 advice=API_WORDS)  # fmt: skip
        except RunExistsError as error:
            raise RunExistsError(error.path, API_ADVICE) from None
        result = train_result(self.run_dir, self.args, len(self.task.train_rows))
        if self.hub.get("push"):
            self.push_to_hub()
        return result

    def settings_lines(self) -> list[str]:
        """What the run starts with, said once: the settings TRL's arguments and defaults set
        (`*`: TRL's default), the arguments accepted without effect, and `TBA_OVERRIDES`."""
        lines = []
        if self.trl.sources:
            values = self.args.model_dump()
            shown = [f"{key}={get_key(values, key)!r}{'*' if key in self.trl.defaulted else ''}"
                     for key in sorted(self.trl.sources)]  # fmt: skip
            lines.append("from TRL's arguments (* TRL's default): " + ", ".join(shown))
        if self.trl.ignored:
            lines.append("without effect here (docs/trl.md says why): "
                         + ", ".join(self.trl.ignored))  # fmt: skip
        if overrides := env_overrides():
            lines.append(f"{OVERRIDES_VARIABLE} sets {', '.join(overrides)}")
        return lines

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

    def push_to_hub(self, commit_message: str | None = None, blocking: bool = True,
                    token: str | None = None, revision: str | None = None,
                    **model_card: Any) -> str | None:  # fmt: skip
        """Upload the trained policy (RUN_DIR/final, with a model card) to the Hub repository
        `hub_model_id` (default: `output_dir`'s name, in your namespace), created if needed, as
        TRL's `trainer.push_to_hub` does; `model_card` keywords (`dataset_name`, `tags`, ...)
        go into its card. Returns the commit's URL; the upload always blocks (`blocking` is
        TRL's keyword). When the upload fails (offline, no token, no network), `PushToHubError`
        says why and where the trained policy is kept, as TRL raises its error: a script whose
        upload failed does not end as if it had succeeded."""
        final = Path(self.args.output_dir) / "final"
        if not (final / "config.json").is_file():
            raise FileNotFoundError(f"no trained policy in {final}: call trainer.train() first")
        repo = self.hub.get("model_id") or Path(self.args.output_dir).resolve().name
        try:
            hub = HfApi(token=token or self.hub.get("token"))
            repo_id = hub.create_repo(repo, private=self.hub.get("private"), exist_ok=True).repo_id
            _write_model_card(final, repo_id, self.args, model_card)
            commit = hub.upload_folder(
                repo_id=repo_id, folder_path=final,
                commit_message=commit_message or "tba: the trained policy",
                revision=revision or self.hub.get("revision"),
            )  # fmt: skip
        except Exception as error:  # noqa: BLE001 - offline, no token, no network, a refused repo
            raise PushToHubError(
                f"push_to_hub: {repo} was not uploaded ({first_line(error)}); the trained policy "
                f"is kept in {final}: push it with trainer.push_to_hub() once the Hub can be "
                "reached"
            ) from error
        return str(getattr(commit, "commit_url", commit))


class PushToHubError(RunError):
    """`TBATrainer.push_to_hub` could not upload the trained policy; the message says why and
    where the policy is kept (the Hub's own error is its `__cause__`)."""


def train_result(run_dir: Path, config: RunConfig, num_rows: int) -> TrainResult:
    """TRL's figures of the run in `run_dir` (from its eval.json and metrics.jsonl), with tba's."""
    summary = json.loads((run_dir / "eval.json").read_text())
    losses = [r["loss"] for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]
    steps, seconds = summary["steps"], max(summary["train_minutes"] * 60, 1e-9)
    tc = config.train
    completions = steps * tc.num_prompts * tc.group_size
    # A step trains on group_size of the samples_per_prompt completions of each of its prompts.
    prompts = completions / (tc.samples_per_prompt or tc.group_size)
    training_loss = sum(losses) / len(losses) if losses else float("nan")
    metrics = {
        "train_runtime": seconds, "train_samples_per_second": completions / seconds,
        "train_steps_per_second": steps / seconds, "train_loss": training_loss,
        "epoch": prompts / num_rows, **summary, "run_dir": str(run_dir),
    }  # fmt: skip
    return TrainResult(steps, training_loss, metrics)


def _check_checkpoint_path(path: Path, output_dir: Path) -> None:
    """TRL's `resume_from_checkpoint=PATH`: tba resumes the run in `output_dir` from its newest
    checkpoint, so PATH must be that run or one of its checkpoints."""
    run = output_dir.resolve()
    if path.resolve() != run and run not in path.resolve().parents:
        raise ConfigError(f"resume_from_checkpoint={str(path)!r}: tba resumes the run in "
                          f"output_dir ({output_dir}) from its newest checkpoint; pass True, or "
                          "set output_dir to the run to resume")  # fmt: skip


def _quantization_of(model: Any) -> dict[str, Any] | None:
    """The tba settings of a model loaded with a quantization_config (None: full weights). The
    run loads it again, quantized alike, from where it came (`name_or_path`)."""
    quantization = getattr(getattr(model, "config", None), "quantization_config", None)
    if quantization is None:
        return None
    try:
        settings = quantization_settings(quantization)
    except ValueError as error:
        raise ConfigError(f"the model is quantized: {error}") from None
    if not model.name_or_path:
        raise ConfigError("the model is quantized and was not loaded from a directory or the "
                          "Hub: pass its name, with model_init_kwargs={'quantization_config': "
                          "...}, so that every process loads it alike")  # fmt: skip
    return settings


def _write_model_card(final: Path, repo_id: str, config: RunConfig, card: dict[str, Any]) -> None:
    """README.md of the uploaded policy: where it comes from, and the card's keywords."""
    tags = ["tba", "trajectory-balance", *(card.pop("tags", None) or [])]
    dataset = card.pop("dataset_name", None)
    metadata = {"tags": tags, "datasets": [dataset] if dataset else None, **card}
    lines = [f"{key}: {json.dumps(value)}" for key, value in metadata.items() if value is not None]
    # The mode the run trained in, which eval.json says (`train.mode=auto` is decided by the run).
    summary = final.parent / "eval.json"
    mode = json.loads(summary.read_text())["mode"] if summary.is_file() else config.train.mode
    (final / "README.md").write_text("\n".join([
        "---", *lines, "---", "", f"# {repo_id}", "",
        f"Post-trained with tba ({config.train.loss} objective, {mode} mode) from "
        f"`{config.policy.model}`.", "",
    ]))


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
    try:
        rows = list(dataset)
    except TypeError:  # not iterable: 42, a model, a function
        raise ConfigError(f"{where}: a datasets.Dataset, a pandas DataFrame or a list of rows "
                          f"with a `prompt` column, got a {type(dataset).__name__} "
                          f"({dataset!r:.40})") from None  # fmt: skip
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
