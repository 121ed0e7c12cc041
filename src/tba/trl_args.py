"""TRL's `GRPOConfig` arguments, read as tba settings: a TRL GRPO script becomes a tba script by
changing the import, the trainer class and the config class.

`TBAConfig(learning_rate=1e-5, num_generations=4, ...)` takes TRL's names beside tba's own
sections. Each of GRPOConfig's arguments (TRL 1.x, and the older names scripts still use) is one
of:

- **mapped**: it sets the tba settings that mean the same (`learning_rate` ->
  `train.learning_rate`; the batch arguments together, `batch_settings`);
- **without effect**: accepted, and listed once when the run starts, because it only tunes the
  Hugging Face Trainer's plumbing (data loaders, logging, devices, kernels) or GRPO's own loss,
  which tba replaces by TB;
- **refused** unless left at its default: one line saying why, because it would change what is
  trained and tba cannot do it; quietly training something else would be worse.

`TRL_DEFAULTS` are GRPOConfig's own defaults of the mapped arguments: a `TBAConfig` starts from
them, as a `GRPOConfig` does. docs/trl.md is this table (`tba config --trl > docs/trl.md`).
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tba.errors import ConfigError


@dataclass(frozen=True)
class Mapped:
    """A TRL argument with a tba equivalent: `convert(value)` gives the tba settings."""

    keys: str  # the tba settings it sets, for the docs
    convert: Callable[[Any], dict[str, Any]]
    why: str = ""  # what the docs add: where the meaning is not one setting's


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
    """The value as it is, for `key` (`check`: what it must satisfy, `what` says it); None
    (TRL's "not set") sets nothing."""

    def convert(value: Any) -> dict[str, Any]:
        if value is None:
            return {}
        if check is not None and not check(value):
            raise ValueError(what)
        return {key: value}

    return Mapped(key, convert)


def _installed(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


TRACKERS = ("tensorboard", "wandb", "trackio")


def _report_to(value: Any) -> dict[str, Any]:
    names = [value] if isinstance(value, str) else list(value or [])
    names = [name for name in names if name != "none"]
    if "all" in names:  # transformers: every integration that is installed
        names = [name for name in TRACKERS if _installed(name)]
    unknown = [name for name in names if name not in TRACKERS]
    if unknown:
        raise ValueError(f"tba reports to {', '.join(TRACKERS)} and none, not "
                         f"{', '.join(unknown)}")  # fmt: skip
    missing = [name for name in names if not _installed(name)]
    if missing:
        raise ValueError(f"needs `pip install {' '.join(missing)}`")
    return {"report_to": names}


def _bf16(value: Any) -> dict[str, Any]:
    return {"policy.dtype": "bfloat16"} if value else {}


def _cpu(value: Any) -> dict[str, Any]:
    if not value:
        return {}
    return {"policy.device": "cpu", "searchers.device": "cpu", "task.reward_device": "cpu"}


def _max_steps(value: Any) -> dict[str, Any]:
    """TRL's -1 means: no step limit (the epochs decide)."""
    if value is None or value < 0:
        return {}
    return {"train.max_steps": value, "train.max_minutes": None}


def _epochs(value: Any) -> dict[str, Any]:
    if not value > 0:
        raise ValueError("must be > 0")
    return {"train.num_epochs": float(value), "train.max_minutes": None}


def _warmup_steps(value: Any) -> dict[str, Any]:
    """Transformers 5 reads a warmup_steps below 1 as a share of the run's steps."""
    if not value >= 0:
        raise ValueError("must be >= 0")
    if value < 1:
        return {"train.warmup_ratio": float(value)} if value > 0 else {"train.warmup_steps": 0}
    return {"train.warmup_steps": int(value)}


SCHEDULES = {"constant": "constant", "constant_with_warmup": "constant", "linear": "linear",
             "cosine": "cosine"}  # fmt: skip


def _schedule(value: Any) -> dict[str, Any]:
    name = str(getattr(value, "value", value))  # TRL passes a string or an enum
    if name not in SCHEDULES:
        raise ValueError(f"tba's learning-rate schedules are {', '.join(SCHEDULES)}")
    return {"train.lr_schedule": SCHEDULES[name]}


def _truncated(value: Any) -> dict[str, Any]:
    return {"train.truncated": "drop" if value else "score"}


MODEL_PLUMBING = ("attn_implementation", "device_map", "low_cpu_mem_usage", "use_cache",
                  "use_kernels")  # fmt: skip


def _model_init(value: Any) -> dict[str, Any]:
    """model_init_kwargs: the dtype and a bitsandbytes quantization_config have tba
    equivalents, the loader's plumbing no effect."""
    value = dict(value or {})
    dtype = value.pop("dtype", value.pop("torch_dtype", None))
    quantization = value.pop("quantization_config", None)
    other = [key for key in value if key not in MODEL_PLUMBING]
    if other:
        raise ValueError(f"tba loads models itself and takes no {', '.join(other)} (only a "
                         "dtype, a quantization_config, and the loader's plumbing: "
                         + ", ".join(MODEL_PLUMBING) + ")")  # fmt: skip
    settings = quantization_settings(quantization) if quantization is not None else {}
    if dtype is not None:  # the model's dtype, over the quantization's compute dtype
        settings.pop("policy.dtype", None)
        settings |= _policy_dtype(dtype, f"the dtype {dtype!r}")
    return settings


def _policy_dtype(dtype: Any, what: str) -> dict[str, Any]:
    """A torch dtype (or its name) as policy.dtype: float32 (tba's default) or bfloat16."""
    name = str(dtype).removeprefix("torch.")
    if name in ("auto", "float32"):
        return {}
    if name == "bfloat16":
        return {"policy.dtype": "bfloat16"}
    raise ValueError(f"{what}: tba computes in float32 or bfloat16")


# BitsAndBytesConfig's settings that tba's quantization section does not offer, at their defaults.
BNB_FIXED = {"llm_int8_threshold": 6.0, "llm_int8_skip_modules": None,
             "llm_int8_enable_fp32_cpu_offload": False, "llm_int8_has_fp16_weight": False,
             "bnb_4bit_quant_storage": "uint8"}  # fmt: skip


def quantization_settings(quantization: Any) -> dict[str, Any]:
    """A transformers quantization config (object or dict) as tba's `quantization` section:
    bitsandbytes' 4 or 8 bits; its 4-bit compute dtype as policy.dtype."""
    if hasattr(quantization, "to_dict"):
        values = quantization.to_dict()
    elif isinstance(quantization, dict):
        values = dict(quantization)
    else:
        raise ValueError("quantization_config: a BitsAndBytesConfig (or its dict) is what tba "
                         "takes")  # fmt: skip
    method = str(getattr(values.get("quant_method"), "value", values.get("quant_method")))
    if method not in ("None", "bitsandbytes"):
        raise ValueError(f"quantization_config with quant_method={method}: tba quantizes with "
                         "bitsandbytes (BitsAndBytesConfig) only")  # fmt: skip
    changed = [f"{key}={values[key]!r}" for key, default in BNB_FIXED.items()
               if key in values and values[key] != default]  # fmt: skip
    if changed:
        raise ValueError(f"quantization_config with {', '.join(changed)}: tba takes 4 or 8 bits, "
                         "the 4-bit type and double quantization, and the compute dtype")
    if values.get("load_in_8bit"):
        return {"quantization.bits": 8}
    if not values.get("load_in_4bit"):
        raise ValueError("quantization_config loads neither in 4 nor in 8 bits")
    settings: dict[str, Any] = {
        "quantization.bits": 4,
        "quantization.quant_type": values.get("bnb_4bit_quant_type", "fp4"),
        "quantization.double_quant": bool(values.get("bnb_4bit_use_double_quant", False)),
    }
    compute = values.get("bnb_4bit_compute_dtype") or "float32"
    return settings | _policy_dtype(compute, f"quantization_config with "
                                    f"bnb_4bit_compute_dtype={compute}")  # fmt: skip


def _hub(what: str, key: str) -> Mapped:
    """The Hub upload's settings: kept with the config for `TBATrainer.push_to_hub`."""
    return Mapped("", lambda value: {f"hub.{key}": value},
                  f"{what} of the upload with `huggingface_hub` (`trainer.push_to_hub()`)")


def _same(expected: Any) -> Callable[[Any], bool]:
    return lambda value: value == expected


def _none_or_empty(value: Any) -> bool:
    return not value


# Batches: read together by `batch_settings`.
BATCH_ARGUMENTS = ("per_device_train_batch_size", "gradient_accumulation_steps",
                   "num_generations", "generation_batch_size", "steps_per_generation",
                   "num_iterations")  # fmt: skip
_BATCH = Mapped("train.group_size, train.samples_per_prompt, train.num_prompts, "
                "train.micro_batch_groups, train.group_baseline, searchers.prompts_per_batch, "
                "train.sync_generate=when_needed, buffer.fresh_uses", lambda value: {},
                "the batch arguments together (Batches, above)")  # fmt: skip

_LOGGING = "TRL's logging: tba logs every step to metrics.jsonl (and report_to)"
_HUB = "tba uploads once, when `trainer.push_to_hub()` or `push_to_hub=True` asks"
_GRPO = "a setting of GRPO's loss: tba trains with train.loss (default TB)"
_DATA = "TRL's data loading: tba's searchers read the rows themselves"
_SAVE = "TRL's saving: tba checkpoints every checkpoint.every steps or checkpoint.every_minutes"
_EVAL = "TRL's evaluation loop: tba evaluates every eval.every steps"
_DEVICES = "how the Hugging Face Trainer spreads work over devices: tba places its own processes"
_SPEED = "speed or memory of the Hugging Face Trainer's own passes, not what is trained"
_VLLM = ("tba's vLLM engines run inside its searcher processes, neither as a server nor beside "
         "the trainer (docs/engines.md)")
_SAMPLING = "TB's behaviour log-probs are those of plain sampling at policy.temperature"
_ADAM = "tba's optimizer is AdamW with its own betas and epsilon"

TRL_ARGUMENTS: dict[str, Mapped | Ignored | Refused] = {
    # What is trained, and how long.
    "output_dir": _to("output_dir"),
    "seed": _to("seed"),
    "learning_rate": _to("train.learning_rate"),
    "max_steps": Mapped("train.max_steps, train.max_minutes=null", _max_steps,
                        "-1: the epochs decide; otherwise it overrides num_train_epochs"),
    "num_train_epochs": Mapped("train.num_epochs, train.max_minutes=null", _epochs),
    "warmup_steps": Mapped("train.warmup_steps", _warmup_steps,
                           "below 1, train.warmup_ratio, as transformers 5 reads it"),
    "warmup_ratio": _to("train.warmup_ratio"),
    "lr_scheduler_type": Mapped("train.lr_schedule", _schedule,
                                "constant (constant_with_warmup too), linear or cosine"),
    "lr_scheduler_kwargs": Refused("tba's schedules take no arguments (train.lr_schedule, "
                                   "train.warmup_steps)", _none_or_empty),
    "weight_decay": _to("train.weight_decay"),
    "max_grad_norm": _to("train.max_grad_norm"),
    "gradient_checkpointing": _to("train.gradient_checkpointing"),
    "activation_checkpointing": _to("train.gradient_checkpointing"),
    "beta": _to("train.beta", lambda v: v > 0,
                "TB needs beta > 0: it is the temperature of TB's target pi_ref exp(r / beta); a "
                "small one (e.g. 0.01) is the nearest to TRL's beta=0"),
    "epsilon": _to("train.clip_eps"),
    **dict.fromkeys(BATCH_ARGUMENTS, _BATCH),
    # Generation.
    "max_completion_length": _to("policy.max_new_tokens"),
    "max_prompt_length": _to("policy.max_prompt_length"),
    "temperature": _to("policy.temperature"),
    "top_p": Refused(f"nucleus sampling: {_SAMPLING}", _same(1.0)),
    "top_k": Refused(f"top-k sampling: {_SAMPLING}", lambda v: v in (None, 0)),
    "min_p": Refused(f"min-p sampling: {_SAMPLING}", lambda v: v is None),
    "repetition_penalty": Refused("a repetition penalty changes the sampling distribution that "
                                  "TB's log-probs describe", _same(1.0)),
    "generation_kwargs": Refused("tba samples with its own settings (policy.temperature, "
                                 "policy.max_new_tokens)", _none_or_empty),
    "chat_template_kwargs": Refused("tba renders chats with the tokenizer's template as it is",
                                    _none_or_empty),
    "vllm_structured_outputs_regex": Refused(f"constrained decoding: {_SAMPLING}",
                                             lambda v: v is None),
    "use_vllm": Mapped("searchers.engine=vllm",
                       lambda value: {"searchers.engine": "vllm" if value else "builtin"},
                       "vLLM inside each searcher process"),
    "vllm_gpu_memory_utilization": _to("searchers.vllm.gpu_memory_utilization"),
    "vllm_tensor_parallel_size": _to("searchers.vllm.tensor_parallel_size"),
    "vllm_max_model_length": _to("searchers.vllm.max_model_len"),
    **dict.fromkeys(["vllm_mode", "vllm_model_impl", "vllm_enable_sleep_mode",
                     "vllm_server_base_url", "vllm_server_host", "vllm_server_port",
                     "vllm_server_timeout", "vllm_group_port", "ds3_gather_for_generation",
                     "use_transformers_continuous_batching",
                     "transformers_continuous_batching_config", "use_transformers_paged",
                     "cache_implementation"], Ignored(_VLLM)),  # fmt: skip
    # Precision and devices.
    "bf16": Mapped("policy.dtype=bfloat16", _bf16),
    "fp16": Refused("use bf16=True (policy.dtype=bfloat16)", _same(False)),
    "use_cpu": Mapped("policy.device, searchers.device, task.reward_device = cpu", _cpu),
    "no_cuda": Mapped("policy.device, searchers.device, task.reward_device = cpu", _cpu),
    "model_init_kwargs": Mapped("policy.dtype, quantization", _model_init,
                                "its dtype; a bitsandbytes quantization_config (QLoRA, with "
                                "peft_config) as the quantization section; the loader's "
                                "plumbing (" + ", ".join(MODEL_PLUMBING) + ") has no effect"),
    "disable_dropout": Refused("tba always disables dropout: the trainer's log-probs must be the "
                               "searchers'", _same(True)),
    "trust_remote_code": Refused("tba loads models without remote code", _same(False)),
    "deepspeed": Refused("tba's trainer does not run under DeepSpeed; it shards itself "
                         "(trainer.world_size, docs/sharding.md)", lambda v: v is None),
    "fsdp": Refused("tba shards its trainer itself (trainer.world_size, docs/sharding.md)",
                    _none_or_empty),
    "parallelism_config": Refused("tba shards its trainer itself (trainer.world_size, "
                                  "docs/sharding.md)", lambda v: v is None),
    **dict.fromkeys(["fsdp_config", "accelerator_config", "ddp_find_unused_parameters",
                     "ddp_bucket_cap_mb", "ddp_broadcast_buffers", "ddp_static_graph",
                     "ddp_backend", "ddp_timeout", "local_rank", "average_tokens_across_devices",
                     "tf32", "bf16_full_eval", "fp16_full_eval", "cast_lm_head_to_fp32",
                     "full_determinism"], Ignored(_DEVICES)),  # fmt: skip
    **dict.fromkeys(["torch_compile", "torch_compile_backend", "torch_compile_mode",
                     "use_liger_kernel", "liger_kernel_config", "use_cache",
                     "torch_empty_cache_steps", "gradient_checkpointing_kwargs",
                     "activation_checkpointing_kwargs"], Ignored(_SPEED)),  # fmt: skip
    # Rewards.
    "reward_weights": _to("task.reward_weights"),
    "mask_truncated_completions": Mapped("train.truncated", _truncated,
                                         "True: drop, False: score"),
    # Records.
    "report_to": Mapped("report_to", _report_to,
                        "tensorboard, wandb, trackio (each when installed), none or all"),
    "log_completions": _to("log_completions"),
    "save_steps": _to("checkpoint.every", lambda v: isinstance(v, int) and v >= 1,
                      "counts steps in tba (an int >= 1), not a share of the run"),
    "save_total_limit": _to("checkpoint.keep"),
    "eval_steps": _to("eval.every", lambda v: isinstance(v, int) and v >= 1,
                      "counts steps in tba (an int >= 1), not a share of the run"),
    "shuffle_dataset": Refused("each searcher always shuffles its own prompt stream", _same(True)),
    "train_sampling_strategy": Refused("each searcher always shuffles its own prompt stream",
                                       _same("random")),
    # The Hub.
    "push_to_hub": _hub("after training: the start", "push"),
    "hub_model_id": _hub("the repository (default: output_dir's name)", "model_id"),
    "hub_token": _hub("the token", "token"),
    "hub_private_repo": _hub("private or public: the repository", "private"),
    "hub_revision": _hub("the branch", "revision"),
    **dict.fromkeys(["hub_strategy", "hub_always_push"], Ignored(_HUB)),
    "log_completions_hub_repo": Ignored("the completions stay in RUN_DIR/completions.jsonl "
                                        "(log_completions), uploaded by no one"),
    # Accepted without effect.
    **dict.fromkeys(["logging_steps", "logging_strategy", "logging_first_step", "logging_dir",
                     "run_name", "disable_tqdm", "num_completions_to_print", "log_unique_prompts",
                     "log_multimodal", "log_level", "log_level_replica", "log_on_each_node",
                     "logging_nan_inf_filter", "include_num_input_tokens_seen", "debug",
                     "skip_memory_metrics", "project", "trackio_space_id", "trackio_bucket_id",
                     "trackio_static_space_id"], Ignored(_LOGGING)),  # fmt: skip
    **dict.fromkeys(["scale_rewards", "loss_type", "epsilon_high", "delta",
                     "importance_sampling_level", "multi_objective_aggregation",
                     "top_entropy_quantile", "sapo_temperature_neg", "sapo_temperature_pos",
                     "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg",
                     "off_policy_mask_threshold", "use_bias_correction_kl",
                     "vllm_importance_sampling_correction", "vllm_importance_sampling_mode",
                     "vllm_importance_sampling_clip_max", "vllm_importance_sampling_clip_min",
                     "vllm_importance_sampling_cap", "label_smoothing_factor",
                     "ref_model_mixup_alpha", "ref_model_sync_steps", "entropy_coef_min",
                     "entropy_coef_max", "entropy_coef_delta", "entropy_target",
                     "max_tool_calling_iterations"], Ignored(_GRPO)),  # fmt: skip
    **dict.fromkeys(["remove_unused_columns", "dataloader_num_workers", "dataloader_pin_memory",
                     "dataloader_drop_last", "dataloader_persistent_workers",
                     "dataloader_prefetch_factor", "dataloader_multiprocessing_context",
                     "dataloader_in_order", "pad_to_multiple_of", "num_generations_eval",
                     "label_names", "length_column_name", "data_seed"],
                    Ignored(_DATA)),  # fmt: skip
    **dict.fromkeys(["save_strategy", "save_safetensors", "save_only_model", "save_on_each_node",
                     "overwrite_output_dir", "enable_jit_checkpoint", "ignore_data_skip",
                     "restore_callback_states_from_checkpoint", "resume_from_checkpoint"],
                    Ignored(_SAVE + "; resume with trainer.train(resume_from_checkpoint=True)")),
    **dict.fromkeys(["eval_strategy", "evaluation_strategy", "per_device_eval_batch_size",
                     "do_train", "do_eval", "do_predict", "eval_delay", "prediction_loss_only",
                     "eval_on_start", "eval_do_concat_batches", "eval_use_gather_object",
                     "eval_accumulation_steps", "include_for_metrics", "batch_eval_metrics",
                     "metric_for_best_model", "greater_is_better"],
                    Ignored(_EVAL)),  # fmt: skip
    "load_best_model_at_end": Refused("tba's final policy is the last one (evaluated and kept "
                                      "in RUN_DIR/final)", _same(False)),
    "optim": Refused("tba's optimizer is AdamW (train.weight_decay)",
                     lambda v: str(getattr(v, "value", v)).startswith("adamw")),
    "optim_args": Refused(_ADAM, lambda v: v is None),
    "optim_target_modules": Refused(_ADAM, lambda v: v is None),
    "adam_beta1": Refused("tba's AdamW keeps beta1 = 0.9", _same(0.9)),
    "adam_beta2": Refused("tba's AdamW keeps beta2 = 0.999", _same(0.999)),
    "adam_epsilon": Refused("tba's AdamW keeps epsilon = 1e-8", _same(1e-8)),
    "auto_find_batch_size": Refused("tba's batches are what the settings say", _same(False)),
    "neftune_noise_alpha": Refused("noise on the input embeddings while training is not TB's "
                                   "objective", lambda v: v is None),
    "entropy_coef": Refused("an entropy bonus is not TB's objective (its target has the "
                            "entropy it has)", _same(0.0)),
    "use_adaptive_entropy": Refused("an entropy bonus is not TB's objective", _same(False)),
    "router_aux_loss_coef": Refused("a mixture-of-experts router loss is not part of TB's "
                                    "objective", lambda v: v is None),
    "sync_ref_model": Refused("TB's reference policy is the starting policy, fixed", _same(False)),
}

# GRPOConfig's own defaults (TRL 1.x) of what it maps: a TBAConfig starts from them, as a
# GRPOConfig does. TRL's beta=0 has no TB equivalent (train.beta stays tba's), nor its bf16
# (mixed precision over fp32 weights, not bf16 weights): neither is among them.
TRL_DEFAULTS: dict[str, Any] = {
    "learning_rate": 1e-6,
    "lr_scheduler_type": "linear",
    "warmup_steps": 0,
    "weight_decay": 0.0,
    "max_grad_norm": 1.0,
    "num_train_epochs": 3.0,
    "max_steps": -1,
    "per_device_train_batch_size": 8,
    "gradient_accumulation_steps": 1,
    "num_generations": 8,
    "num_iterations": 1,
    "max_completion_length": 512,
    "temperature": 1.0,
    "epsilon": 0.2,
    "mask_truncated_completions": False,
    "gradient_checkpointing": True,
    "seed": 42,
    "save_steps": 500,
}

# Settings that mean something only together (a decay needs the run's length): where a script
# sets one of them in tba's own sections, TRL's defaults leave all of them alone.
TOGETHER = (
    ("train.max_steps", "train.num_epochs", "train.max_minutes", "train.lr_schedule"),
    ("train.group_size", "train.samples_per_prompt", "train.num_prompts",
     "train.micro_batch_groups", "train.group_baseline", "searchers.prompts_per_batch",
     "train.sync_generate", "buffer.fresh_uses"),
    ("train.warmup_steps", "train.warmup_ratio"),
)  # fmt: skip


@dataclass
class TrlSettings:
    """TRL's arguments as tba settings: `settings` (dotted keys), `sources` (for each key, the
    arguments that set it, as written), `defaulted` (keys only TRL's defaults set), and the
    arguments accepted without effect (`ignored`, said once when the run starts)."""

    settings: dict[str, Any] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)
    defaulted: set[str] = field(default_factory=set)
    ignored: list[str] = field(default_factory=list)


def from_trl(arguments: dict[str, Any], defaults: dict[str, Any] = TRL_DEFAULTS) -> TrlSettings:
    """TRL-named `arguments`, on top of TRL's `defaults`, as tba settings. ConfigError, one line
    naming the argument as written, for an unknown name or a value tba cannot honour."""
    result = TrlSettings()
    values = defaults | arguments
    for name, value in values.items():
        entry = TRL_ARGUMENTS.get(name)
        if entry is None:
            raise ConfigError(f"unknown setting {name!r}: not a tba section nor a GRPOConfig "
                              "argument (docs/trl.md lists them)")  # fmt: skip
        if isinstance(entry, Refused):
            if not entry.unless(value):
                raise ConfigError(f"{name}={_shown(value)} has no tba equivalent: {entry.reason}")
        elif isinstance(entry, Ignored):
            result.ignored.append(f"{name}={_shown(value)}")
        elif entry is not _BATCH:
            try:
                converted = entry.convert(value)
            except ValueError as error:
                raise ConfigError(f"{name}={_shown(value)}: {error}") from None
            _add(result, converted, f"{name}={_shown(value)}", given=name in arguments)
    batch = {name: values[name] for name in BATCH_ARGUMENTS if name in values}
    if batch:
        given = [f"{name}={value!r}" for name, value in batch.items() if name in arguments]
        _add(result, batch_settings(batch), ", ".join(given) or "TRL's batch defaults",
             given=bool(given))
    if values.get("max_steps") is not None and values["max_steps"] > 0:  # as in TRL
        for key in ("train.num_epochs",):
            result.settings.pop(key, None)
            result.sources.pop(key, None)
            result.defaulted.discard(key)
    return result


def _add(result: TrlSettings, settings: dict[str, Any], source: str, given: bool) -> None:
    for key, value in settings.items():
        result.settings[key] = value
        result.sources[key] = source
        if given:
            result.defaulted.discard(key)
        else:
            result.defaulted.add(key)


def _shown(value: Any) -> str:
    """A value as the script wrote it, on one line (a quantization config prints on many)."""
    text = " ".join(repr(value).split())
    return text if len(text) <= 120 else text[:117] + "..."


def batch_settings(arguments: dict[str, Any]) -> dict[str, Any]:
    """TRL's batch as tba's.

    TRL: an optimizer step trains on per_device_train_batch_size (P) completions a pass, times
    gradient_accumulation_steps (A) passes; a generation makes generation_batch_size completions
    (P * steps_per_generation; default P * A, one generation a step), num_generations (G) for
    each of its prompts, and serves the steps that follow until its completions are used up (each
    num_iterations times).

    tba: a step trains on train.num_prompts groups of train.group_size completions of one
    prompt, groups kept whole in the loss (each group's log Z, or baseline, comes from all of
    its members). So the trained part of a group is the largest that divides both P * A and G,
    K = gcd(P * A, G): G when P * A is a multiple of G, else a part of a prompt's G completions
    (train.samples_per_prompt = G; K = 1 when P * A and G share no factor), the other parts
    trained at the same or the next steps; as in TRL, the group's statistics still come from
    all G (train.group_baseline = generation: the G completions not trained on at a step enter
    its log Z or baseline without gradient, each once). B = P * A / K groups a step,
    max(1, P // K) a pass;
    searchers.prompts_per_batch = generation_batch_size / G prompts a generation, and in the
    synchronous mode a generation only when the buffer holds fewer fresh groups than a step
    takes (train.sync_generate=when_needed), so that every step trains on fresh completions, as
    many as TRL's. num_iterations > 1 reuses them as TRL does: each completion is trained on
    num_iterations times (buffer.fresh_uses), the least-used first, so that a generation serves
    num_iterations times as many steps."""
    get = {name: arguments.get(name) for name in BATCH_ARGUMENTS}
    for name, value in get.items():
        if value is not None and not (isinstance(value, int) and value >= 1):
            raise ConfigError(f"{name}={value!r}: must be a whole number >= 1")
    per_pass = get["per_device_train_batch_size"] or 8
    passes = get["gradient_accumulation_steps"] or 1
    group = get["num_generations"] or 8
    generation, steps = get["generation_batch_size"], get["steps_per_generation"]
    if group < 2:
        raise ConfigError(f"num_generations={group}: a group needs 2 or more completions of a "
                          "prompt (as in TRL)")  # fmt: skip
    if generation is not None and steps is not None:
        raise ConfigError(f"generation_batch_size={generation} and steps_per_generation={steps}: "
                          "set one of them (as in TRL)")  # fmt: skip
    if generation is None:
        generation = per_pass * (steps or passes)
    elif generation % per_pass:
        raise ConfigError(f"generation_batch_size={generation}: must be a multiple of "
                          f"per_device_train_batch_size={per_pass} (as in TRL)")  # fmt: skip
    if generation % group:
        raise ConfigError(f"generation_batch_size={generation} (per_device_train_batch_size * "
                          f"steps_per_generation when not given) must be a multiple of "
                          f"num_generations={group}: a generation makes whole groups (as in "
                          "TRL)")  # fmt: skip
    per_step = per_pass * passes
    size = math.gcd(per_step, group)
    groups = per_step // size
    per_micro_batch = max(1, per_pass // size)
    settings: dict[str, Any] = {
        "train.group_size": size,
        "train.samples_per_prompt": group if size < group else None,
        "train.group_baseline": "generation" if size < group else "trained",
        "train.num_prompts": groups,
        "train.micro_batch_groups": per_micro_batch if per_micro_batch < groups else None,
        "searchers.prompts_per_batch": generation // group,
        "train.sync_generate": "when_needed",
    }
    iterations = get["num_iterations"] or 1
    if iterations > 1:
        settings["buffer.fresh_uses"] = iterations
    return settings


def reference_page() -> str:
    """docs/trl.md: every GRPOConfig argument tba reads, and what it becomes."""
    rows = []
    for name, entry in sorted(TRL_ARGUMENTS.items()):
        default = f" (TRL's default: `{TRL_DEFAULTS[name]!r}`)" if name in TRL_DEFAULTS else ""
        if isinstance(entry, Mapped):
            parts = [f"`{entry.keys}`" if entry.keys else "", entry.why]
            rows.append(f"| `{name}` | {': '.join(p for p in parts if p)}{default} |")
        elif isinstance(entry, Ignored):
            rows.append(f"| `{name}` | no effect: {entry.reason} |")
        else:
            rows.append(f"| `{name}` | refused unless left at its default: {entry.reason} |")
    batches = " ".join(batch_settings.__doc__.split("\n\n", 1)[1].split())
    return "\n".join([
        "# Porting a TRL GRPO script",
        "",
        "A script written for TRL's `GRPOTrainer` runs on tba with three changes: the import, "
        "the trainer class and the config class (`GRPOConfig` -> `TBAConfig`, `GRPOTrainer` -> "
        "`TBATrainer`). Reward functions keep TRL's contract (keyword arguments `prompts`, "
        "`completions`, `completion_ids`, `trainer_state`, `log_extra`, `log_metric`, the "
        "dataset's columns; `None` for a completion a function does not score). The trainer "
        "keeps TRL's calls: `train()` returns TRL's `TrainOutput` (`global_step`, "
        "`training_loss`, `metrics` with `train_runtime`, and tba's own figures), "
        "`save_model(dir)`, `push_to_hub()` (through `huggingface_hub`; offline, one line, and "
        "the model stays in `output_dir`), and a rerun into the same `output_dir` starts the run "
        "afresh unless `train(resume_from_checkpoint=True)`. Generated by `tba config --trl > "
        "docs/trl.md`.",
        "",
        "`TBAConfig` reads every GRPOConfig argument below. It starts from TRL's defaults for "
        "what it maps (the arguments with a default shown), as a `GRPOConfig` does, where the "
        "script sets neither the argument nor tba's setting; `TBAConfig.from_overrides` and "
        "`tba train` start from tba's (docs/configuration.md). The resolved settings are "
        "printed when the run starts, with the arguments accepted without effect. "
        "`TBA_OVERRIDES` (`key=value` settings, as `tba train` takes them) applies on top of "
        "everything, whatever the script sets: `train.max_steps` there replaces the script's "
        "`num_train_epochs`.",
        "",
        f"Batches: {batches}",
        "",
        "| GRPOConfig argument | tba |",
        "|---|---|",
        *rows,
    ]) + "\n"
