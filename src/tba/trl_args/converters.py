"""The value converters: one TRL argument's value as the tba settings (dotted keys) that mean
the same.

Each takes the value as the script wrote it and returns the settings, or raises ValueError with
what is wrong (`from_trl` adds the argument's name, so the line names what the script wrote).
TRL's "not set" (None, -1) sets nothing: tba's or TRL's default then decides.
"""

from __future__ import annotations

import importlib.util
from typing import Any

TRACKERS = ("tensorboard", "wandb", "trackio")


def _installed(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def report_to(value: Any) -> dict[str, Any]:
    """TRL's report_to: one name, a list, "none" or "all". A tracker that is not installed is
    refused now rather than when the run's first step logs."""
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


def bf16(value: Any) -> dict[str, Any]:
    """bf16=True: bf16 weights; bf16=False: float32, as the script says (tba's own default,
    `auto`, may choose bf16 on a CPU that multiplies it natively); None: not set."""
    if value is None:
        return {}
    return {"policy.dtype": "bfloat16" if value else "float32"}


def cpu(value: Any) -> dict[str, Any]:
    """use_cpu / no_cuda: every process of the run on the CPU, not only the trainer."""
    if not value:
        return {}
    return {"policy.device": "cpu", "searchers.device": "cpu", "task.reward_device": "cpu"}


def max_steps(value: Any) -> dict[str, Any]:
    """TRL's -1 means: no step limit (the epochs decide). A step limit replaces tba's default
    time limit; that it also wins over the epochs is the run's rule (`tba.limits.step_limit`)."""
    if value is None or value < 0:
        return {}
    return {"train.max_steps": value, "train.max_minutes": None}


def epochs(value: Any) -> dict[str, Any]:
    """The epochs replace tba's default time limit, as TRL has none."""
    if not value > 0:
        raise ValueError("must be > 0")
    return {"train.num_epochs": float(value), "train.max_minutes": None}


def warmup_steps(value: Any) -> dict[str, Any]:
    """Transformers 5 reads a warmup_steps below 1 as a share of the run's steps."""
    if not value >= 0:
        raise ValueError("must be >= 0")
    if value < 1:
        return {"train.warmup_ratio": float(value)} if value > 0 else {"train.warmup_steps": 0}
    return {"train.warmup_steps": int(value)}


def _name(value: Any) -> str:
    """TRL passes a scheduler's or an optimizer's name as a string or as an enum."""
    return str(getattr(value, "value", value))


SCHEDULES = {"constant": "constant", "constant_with_warmup": "constant", "linear": "linear",
             "cosine": "cosine"}  # fmt: skip


def schedule(value: Any) -> dict[str, Any]:
    """lr_scheduler_type: tba's warmup is separate, so constant_with_warmup is tba's constant."""
    name = _name(value)
    if name not in SCHEDULES:
        raise ValueError(f"tba's learning-rate schedules are {', '.join(SCHEDULES)}")
    return {"train.lr_schedule": SCHEDULES[name]}


# optim: transformers' AdamWs as train.optimizer. The full-precision ones (torch's, fused or not,
# and the older names of the same update) are tba's torch AdamW; bitsandbytes' 8-bit ones its
# 8-bit AdamW. Others (Adafactor, Lion, torchao's 4- and 8-bit AdamWs, ...) have no equivalent.
OPTIMIZER_NAMES = {
    **dict.fromkeys(["adamw_torch", "adamw_torch_fused", "adamw_hf", "adamw_apex_fused",
                     "adamw_torch_xla", "adamw_torch_npu_fused"], "adamw"),
    **dict.fromkeys(["adamw_8bit", "adamw_bnb_8bit"], "adamw_8bit"),
    "paged_adamw_8bit": "paged_adamw_8bit",
}  # fmt: skip


def optimizer(value: Any) -> dict[str, Any]:
    """optim: an AdamW of transformers (adamw_torch, adamw_bnb_8bit, ...) as train.optimizer."""
    if value is None:
        return {}
    name = _name(value)
    if name not in OPTIMIZER_NAMES:
        raise ValueError("tba's optimizers are AdamW (adamw_torch, adamw_torch_fused) and "
                         "bitsandbytes' 8-bit AdamW (adamw_8bit, adamw_bnb_8bit, "
                         "paged_adamw_8bit): train.optimizer")  # fmt: skip
    return {"train.optimizer": OPTIMIZER_NAMES[name]}


def truncated(value: Any) -> dict[str, Any]:
    return {"train.truncated": "drop" if value else "score"}


MODEL_PLUMBING = ("attn_implementation", "device_map", "low_cpu_mem_usage", "use_cache",
                  "use_kernels")  # fmt: skip


def model_init(value: Any) -> dict[str, Any]:
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
        settings |= policy_dtype(dtype, f"the dtype {dtype!r}")
    return settings


def policy_dtype(dtype: Any, what: str) -> dict[str, Any]:
    """A torch dtype (or its name) as policy.dtype: float32 or bfloat16 as named; `auto` leaves
    tba's own choice (`policy.dtype=auto`). One parse for every argument that names a dtype, so
    that they agree."""
    name = str(dtype).removeprefix("torch.")
    if name == "auto":
        return {}
    if name in ("float32", "bfloat16"):
        return {"policy.dtype": name}
    raise ValueError(f"{what}: tba computes in float32 or bfloat16")


# BitsAndBytesConfig's settings that tba's quantization section does not offer, at their defaults.
BNB_FIXED = {"llm_int8_threshold": 6.0, "llm_int8_skip_modules": None,
             "llm_int8_enable_fp32_cpu_offload": False, "llm_int8_has_fp16_weight": False,
             "bnb_4bit_quant_storage": "uint8"}  # fmt: skip


def quantization_settings(quantization: Any) -> dict[str, Any]:
    """A transformers quantization config (object or dict) as tba's `quantization` section:
    bitsandbytes' 4 or 8 bits; its 4-bit compute dtype as policy.dtype. Also read from a model
    the script loaded quantized (`tba.api`), so that every process loads it alike."""
    values = _quantization_values(quantization)
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
    return settings | policy_dtype(compute, f"quantization_config with "
                                   f"bnb_4bit_compute_dtype={compute}")  # fmt: skip


def _quantization_values(quantization: Any) -> dict[str, Any]:
    """The config's values, checked: bitsandbytes, with nothing tba's section cannot say (a
    setting tba would drop would quantize another model than the script's)."""
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
    return values
