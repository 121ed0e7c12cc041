"""TRL's `GRPOConfig` arguments, read as tba settings: a TRL GRPO script becomes a tba script by
changing the import, the trainer class and the config class.

`TBAConfig(learning_rate=1e-5, num_generations=4, ...)` takes TRL's names beside tba's own
sections. Each TRL argument is one of:

- **mapped**: it sets the tba key that means the same (`learning_rate` -> `train.learning_rate`);
- **ignored**: accepted, and said once when the run starts, because it has no effect here: it
  shapes TRL's logging or hub uploads, or GRPO's own loss, which tba replaces by TB;
- **refused**: one line saying why: tba cannot do what it asks (`fp16`, nucleus sampling, an
  upload to the Hub), and quietly running something else would be worse.

docs/trl.md is this table (`tba config --trl > docs/trl.md`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tba.errors import ConfigError


@dataclass(frozen=True)
class Mapped:
    """A TRL argument with a tba equivalent: `convert(value)` gives the tba settings."""

    keys: str  # the tba keys it sets, for the docs
    convert: Callable[[Any], dict[str, Any]]


@dataclass(frozen=True)
class Ignored:
    """Accepted, without effect; `reason` says why."""

    reason: str


@dataclass(frozen=True)
class Refused:
    """No equivalent; `reason` says why. `unless(value)`: values that are accepted (defaults)."""

    reason: str
    unless: Callable[[Any], bool] = lambda value: False


def _to(key: str, check: Callable[[Any], bool] | None = None, what: str = "") -> Mapped:
    """The value as it is, for `key` (`check`: what it must satisfy, `what` says it)."""

    def convert(value: Any) -> dict[str, Any]:
        if check is not None and not check(value):
            raise ValueError(f"tba's {key} {what}")
        return {key: value}

    return Mapped(key, convert)


def _report_to(value: Any) -> dict[str, Any]:
    names = [value] if isinstance(value, str) else list(value or [])
    names = [name for name in names if name != "none"]
    if "all" in names:
        names = ["tensorboard", "wandb"]
    unknown = [name for name in names if name not in ("tensorboard", "wandb")]
    if unknown:
        raise ValueError(f"tba reports to tensorboard and wandb (report_to), not "
                         f"{', '.join(unknown)}")
    return {"report_to": names}


def _bf16(value: Any) -> dict[str, Any]:
    return {"policy.dtype": "bfloat16"} if value else {}


def _cpu(value: Any) -> dict[str, Any]:
    if not value:
        return {}
    return {"policy.device": "cpu", "searchers.device": "cpu", "task.reward_device": "cpu"}


def _max_steps(value: Any) -> dict[str, Any]:
    """TRL's -1 means: no step limit (epochs decide)."""
    if value is None or value < 0:
        return {}
    return {"train.max_steps": value, "train.max_minutes": None}


def _epochs(value: Any) -> dict[str, Any]:
    return {"train.num_epochs": float(value), "train.max_minutes": None}


def _schedule(value: Any) -> dict[str, Any]:
    name = str(getattr(value, "value", value))  # TRL passes a string or an enum
    schedules = {"constant": "constant", "constant_with_warmup": "constant", "linear": "linear",
                 "cosine": "cosine"}  # fmt: skip
    if name not in schedules:
        raise ValueError("tba's train.lr_schedule is constant, linear or cosine (after "
                         "train.warmup_steps)")
    return {"train.lr_schedule": schedules[name]}


def _truncated(value: Any) -> dict[str, Any]:
    return {"train.truncated": "drop" if value else "score"}


def _dtype(value: Any) -> dict[str, Any]:
    """model_init_kwargs: only the dtype has a tba equivalent."""
    value = dict(value or {})
    dtype = value.pop("dtype", value.pop("torch_dtype", None))
    if value:
        raise ValueError(f"tba loads models itself and takes no {', '.join(value)} (only a "
                         "dtype: policy.dtype)")
    if dtype is None or str(dtype) in ("auto", "torch.float32", "float32"):
        return {}
    if str(dtype) in ("bfloat16", "torch.bfloat16"):
        return {"policy.dtype": "bfloat16"}
    raise ValueError(f"the dtype {dtype!r}: policy.dtype is float32 or bfloat16")


def _same(expected: Any) -> Callable[[Any], bool]:
    return lambda value: value == expected


def _none_or_empty(value: Any) -> bool:
    return not value


_LOGGING = "TRL's logging: tba logs every step to metrics.jsonl (and report_to)"
_HUB = "tba does not upload; push RUN_DIR/final with huggingface_hub after the run"
_GRPO = "a setting of GRPO's loss: tba trains with train.loss (default TB)"
_DATA = "TRL's data loading: tba's searchers read the rows themselves"
_SAVE = "TRL's saving: tba checkpoints every checkpoint.every steps or checkpoint.every_minutes"
_EVAL = "TRL's evaluation loop: tba evaluates every eval.every steps"

TRL_ARGUMENTS: dict[str, Mapped | Ignored | Refused] = {
    # What is trained, and how long.
    "output_dir": _to("output_dir"),
    "seed": _to("seed"),
    "learning_rate": _to("train.learning_rate"),
    "max_steps": Mapped("train.max_steps, train.max_minutes=null (overrides num_train_epochs)",
                        _max_steps),
    "num_train_epochs": Mapped("train.num_epochs, train.max_minutes=null", _epochs),
    "warmup_steps": _to("train.warmup_steps"),
    "warmup_ratio": _to("train.warmup_ratio"),
    "lr_scheduler_type": Mapped("train.lr_schedule", _schedule),
    "weight_decay": _to("train.weight_decay"),
    "max_grad_norm": _to("train.max_grad_norm"),
    "gradient_checkpointing": _to("train.gradient_checkpointing"),
    "beta": _to("train.beta", lambda v: v > 0,
                "must be > 0: it is the temperature of TB's target pi_ref exp(r / beta); a small "
                "one (e.g. 0.01) is the nearest to TRL's beta=0"),
    "epsilon": _to("train.clip_eps"),
    # Batches: see `_batch_settings`.
    "num_generations": Mapped("train.group_size", lambda value: {}),
    "per_device_train_batch_size": Mapped("train.num_prompts, train.micro_batch_groups",
                                          lambda value: {}),
    "gradient_accumulation_steps": Mapped("train.num_prompts, train.micro_batch_groups",
                                          lambda value: {}),
    "generation_batch_size": Mapped("searchers.prompts_per_batch", lambda value: {}),
    # Generation.
    "max_completion_length": _to("policy.max_new_tokens"),
    "max_prompt_length": _to("policy.max_prompt_length"),
    "temperature": _to("policy.temperature"),
    "top_p": Refused("nucleus sampling: TB's behaviour log-probs are those of plain sampling at "
                     "policy.temperature", _same(1.0)),
    "top_k": Refused("top-k sampling: TB's behaviour log-probs are those of plain sampling at "
                     "policy.temperature", lambda v: v in (None, 0)),
    "min_p": Refused("min-p sampling: TB's behaviour log-probs are those of plain sampling at "
                     "policy.temperature", lambda v: v is None),
    "repetition_penalty": Refused("a repetition penalty changes the sampling distribution that "
                                  "TB's log-probs describe", _same(1.0)),
    "generation_kwargs": Refused("tba samples with its own settings (policy.temperature, "
                                 "policy.max_new_tokens)", _none_or_empty),
    "chat_template_kwargs": Refused("tba renders chats with the tokenizer's template as it is",
                                    _none_or_empty),
    "use_vllm": Mapped("searchers.engine=vllm (vLLM inside each searcher process)",
                       lambda value: {"searchers.engine": "vllm" if value else "builtin"}),
    "vllm_mode": Ignored("tba's vLLM engines run inside its searcher processes, neither as a "
                         "server nor beside the trainer (docs/engines.md)"),
    "vllm_gpu_memory_utilization": _to("searchers.vllm.gpu_memory_utilization"),
    "vllm_tensor_parallel_size": _to("searchers.vllm.tensor_parallel_size"),
    "vllm_max_model_length": _to("searchers.vllm.max_model_len"),
    # Precision and devices.
    "bf16": Mapped("policy.dtype=bfloat16", _bf16),
    "fp16": Refused("use bf16=True (policy.dtype=bfloat16)",
                    _same(False)),
    "use_cpu": Mapped("policy.device, searchers.device, task.reward_device = cpu", _cpu),
    "no_cuda": Mapped("policy.device, searchers.device, task.reward_device = cpu", _cpu),
    "model_init_kwargs": Mapped("policy.dtype", _dtype),
    "disable_dropout": Refused("tba always disables dropout: the trainer's log-probs must be the "
                               "searchers'", _same(True)),
    "trust_remote_code": Refused("tba loads models without remote code", _same(False)),
    # Rewards.
    "reward_weights": _to("task.reward_weights"),
    "mask_truncated_completions": Mapped("train.truncated", _truncated),
    # Records.
    "report_to": Mapped("report_to", _report_to),
    "log_completions": _to("log_completions"),
    "save_steps": _to("checkpoint.every", lambda v: isinstance(v, int) and v >= 1,
                      "counts steps (an int >= 1), not a fraction of the run"),
    "save_total_limit": _to("checkpoint.keep"),
    "eval_steps": _to("eval.every", lambda v: isinstance(v, int) and v >= 1,
                      "counts steps (an int >= 1), not a fraction of the run"),
    "shuffle_dataset": Refused("each searcher always shuffles its own prompt stream", _same(True)),
    "push_to_hub": Refused(_HUB, _same(False)),
    # Accepted without effect.
    **dict.fromkeys(["logging_steps", "logging_strategy", "logging_first_step", "logging_dir",
                     "run_name", "disable_tqdm", "num_completions_to_print", "log_unique_prompts",
                     "log_multimodal", "log_level"], Ignored(_LOGGING)),  # fmt: skip
    **dict.fromkeys(["hub_model_id", "hub_strategy", "hub_token", "hub_private_repo",
                     "log_completions_hub_repo"], Ignored(_HUB)),  # fmt: skip
    **dict.fromkeys(["scale_rewards", "loss_type", "num_iterations", "epsilon_high", "delta",
                     "importance_sampling_level", "multi_objective_aggregation",
                     "top_entropy_quantile", "steps_per_generation"], Ignored(_GRPO)),  # fmt: skip
    **dict.fromkeys(["remove_unused_columns", "dataloader_num_workers", "dataloader_pin_memory",
                     "dataloader_drop_last", "pad_to_multiple_of", "num_generations_eval",
                     "cache_implementation"], Ignored(_DATA)),  # fmt: skip
    **dict.fromkeys(["save_strategy", "save_safetensors", "save_only_model",
                     "overwrite_output_dir"], Ignored(_SAVE)),  # fmt: skip
    **dict.fromkeys(["eval_strategy", "evaluation_strategy", "per_device_eval_batch_size",
                     "do_train", "do_eval"], Ignored(_EVAL)),  # fmt: skip
    "optim": Refused("tba's optimizer is Adam (AdamW with train.weight_decay)",
                     lambda v: str(getattr(v, "value", v)).startswith("adamw")),
    "adam_beta1": Refused("tba's Adam keeps beta1 = 0.9", _same(0.9)),
    "adam_beta2": Refused("tba's Adam keeps beta2 = 0.999", _same(0.999)),
    "adam_epsilon": Refused("tba's Adam keeps epsilon = 1e-8", _same(1e-8)),
    "sync_ref_model": Refused("TB's reference policy is the starting policy, fixed", _same(False)),
    "deepspeed": Refused("tba's trainer does not run under DeepSpeed", lambda v: v is None),
    "fsdp": Refused("tba's trainer is not sharded yet", _none_or_empty),
}


def from_trl(arguments: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """TRL-named `arguments` as tba settings (dotted keys), and the notes to say when the run
    starts (what was ignored). ConfigError, one line, for an unknown name or a refused value."""
    settings: dict[str, Any] = {}
    notes: list[str] = []
    for name, value in arguments.items():
        entry = TRL_ARGUMENTS.get(name)
        if entry is None:
            raise ConfigError(f"unknown setting {name!r}: not a tba section nor a TRL GRPOConfig "
                              "argument tba reads (docs/trl.md lists them)")  # fmt: skip
        if isinstance(entry, Refused):
            if not entry.unless(value):
                raise ConfigError(f"TRL argument {name}={value!r} has no tba equivalent: "
                                  f"{entry.reason}")  # fmt: skip
        elif isinstance(entry, Ignored):
            notes.append(f"{name}={value!r} has no effect in tba: {entry.reason}")
        else:
            try:
                settings |= entry.convert(value)
            except ValueError as error:
                raise ConfigError(f"TRL argument {name}={value!r}: {error}") from None
    settings |= _batch_settings(arguments)
    if "train.max_steps" in settings:  # as in TRL: a step limit overrides the epochs
        settings.pop("train.num_epochs", None)
    return settings, notes


def _batch_settings(arguments: dict[str, Any]) -> dict[str, Any]:
    """TRL's batch: per_device_train_batch_size completions per forward-backward pass,
    gradient_accumulation_steps passes per optimizer step, num_generations completions per
    prompt. tba's: train.num_prompts prompts (groups) of train.group_size completions per step,
    train.micro_batch_groups groups per pass. TRL's defaults (8, 1, 8) fill in what is not given,
    as they would in TRL."""
    names = ("per_device_train_batch_size", "gradient_accumulation_steps", "num_generations",
             "generation_batch_size")  # fmt: skip
    if not any(name in arguments for name in names):
        return {}
    per_pass = arguments.get("per_device_train_batch_size", 8)
    passes = arguments.get("gradient_accumulation_steps", 1)
    group = arguments.get("num_generations", 8)
    if group < 2:
        raise ConfigError(f"TRL argument num_generations={group}: train.group_size needs >= 2 "
                          "completions per prompt")  # fmt: skip
    if per_pass % group:
        raise ConfigError(f"TRL arguments per_device_train_batch_size={per_pass} and "
                          f"num_generations={group}: whole groups per pass need the first to be "
                          "a multiple of the second")  # fmt: skip
    settings: dict[str, Any] = {
        "train.group_size": group,
        "train.num_prompts": per_pass * passes // group,
        "train.micro_batch_groups": per_pass // group if passes > 1 else None,
    }
    generation = arguments.get("generation_batch_size")
    if generation is not None:
        settings["searchers.prompts_per_batch"] = max(1, math.ceil(generation / group))
    return settings


def reference_page() -> str:
    """docs/trl.md: every TRL argument tba reads, and what it becomes."""
    rows = []
    for name, entry in sorted(TRL_ARGUMENTS.items()):
        if isinstance(entry, Mapped):
            rows.append(f"| `{name}` | `{entry.keys}` |")
        elif isinstance(entry, Ignored):
            rows.append(f"| `{name}` | no effect: {entry.reason} |")
        else:
            rows.append(f"| `{name}` | refused unless left at its default: {entry.reason} |")
    return "\n".join([
        "# Porting a TRL GRPO script",
        "",
        "A script written for TRL's `GRPOTrainer` runs on tba with three changes: the import, "
        "the trainer class and the config class (`GRPOConfig` -> `TBAConfig`, `GRPOTrainer` -> "
        "`TBATrainer`). Reward functions keep TRL's contract (keyword arguments `prompts`, "
        "`completions`, `completion_ids`, `trainer_state`, the dataset's columns; `None` for a "
        "completion a function does not score). `TBAConfig` reads the TRL arguments below; the "
        "ones without effect are listed when the run starts, and a refused one stops it with "
        "one line saying why. Generated by `tba config --trl > docs/trl.md`.",
        "",
        "Batch sizes: TRL's `per_device_train_batch_size` completions per pass, "
        "`gradient_accumulation_steps` passes per step and `num_generations` completions per "
        "prompt become `train.num_prompts = per_device_train_batch_size * "
        "gradient_accumulation_steps / num_generations` prompts of `train.group_size = "
        "num_generations` completions per optimizer step, `train.micro_batch_groups = "
        "per_device_train_batch_size / num_generations` prompts per pass; TRL's defaults (8, 1, "
        "8) fill in the ones not given.",
        "",
        "| TRL argument | tba |",
        "|---|---|",
        *rows,
    ]) + "\n"
