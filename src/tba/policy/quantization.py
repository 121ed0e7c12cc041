"""QLoRA: the base model loaded quantized by bitsandbytes, frozen, with LoRA adapters on it.

bitsandbytes keeps each quantized linear layer's weight packed (4 bits: two a byte, with
per-block constants beside it in the state dict; 8 bits: int8 with a scale per row), and computes
in the compute dtype. Against full weights, three things differ:
- loading: transformers quantizes while it loads, straight onto the device it is given as its
  `device_map` (a quantized model is not moved afterwards);
- saving: a saved policy is a plain model that any loader (and `tba eval`) reads, so each packed
  weight is dequantized and the adapters merged into it (`tba.policy.model.policy_state_dict`);
- checkpoints: a 4-bit layer's state does not load back into a quantized model, and the base is
  frozen, so a checkpoint keeps only the adapters; the base reloads from `policy.model`, the same.
"""

from __future__ import annotations

import importlib.util

import torch
from peft.utils.integrations import dequantize_bnb_weight
from transformers import BitsAndBytesConfig, PreTrainedModel

from tba.config import QuantizationConfig, RunConfig
from tba.errors import ConfigError

# bitsandbytes' packed parameter classes, told apart by name as peft does (bitsandbytes is an
# optional dependency: importing it to compare classes would make it a required one).
PACKED_WEIGHTS = ("Params4bit", "Int8Params")


def bnb_config(quantization: QuantizationConfig, dtype: torch.dtype) -> BitsAndBytesConfig | None:
    """transformers' loading settings for `quantization` (None: full weights)."""
    if quantization.bits == 8:
        return BitsAndBytesConfig(load_in_8bit=True)
    if quantization.bits == 4:
        return BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type=quantization.quant_type,
            bnb_4bit_use_double_quant=quantization.double_quant, bnb_4bit_compute_dtype=dtype,
        )  # fmt: skip
    return None


def keep_trainable_layout(model: torch.nn.Module) -> None:
    """On a CPU with AVX512-BF16, bitsandbytes repacks a 4-bit layer's weight for its inference
    kernel the first time the layer runs in eval mode without gradients, and from then on
    computes through that kernel, which gives the layer's input no gradient: a policy that
    samples and trains in turn keeps the layout it trains with."""
    for layer in packed_layers(model).values():
        if hasattr(layer, "support_avx512bf16_for_cpu"):
            layer.support_avx512bf16_for_cpu = False


def check_quantization(config: RunConfig) -> None:
    """Before anything starts: a quantized base needs bitsandbytes, and adapters to train (its
    own weights are frozen). Checked at the start of a run rather than in the config, because a
    TRL script gives its `peft_config` to the trainer, after the config."""
    bits = config.quantization.bits
    if not bits:
        return
    if config.lora.r == 0:
        raise ConfigError(f"quantization.bits={bits} freezes the base weights: train LoRA "
                          "adapters on them (lora.r > 0, or peft_config), as QLoRA does")
    if importlib.util.find_spec("bitsandbytes") is None:
        raise ConfigError(f"quantization.bits={bits} needs bitsandbytes: pip install "
                          "bitsandbytes (or tba[qlora])")  # fmt: skip


def is_quantized(model: PreTrainedModel) -> bool:
    """Whether transformers loaded `model` (a Hugging Face model, not peft's wrapper) quantized."""
    return bool(getattr(model, "is_quantized", False))


def packed_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The layers whose weight bitsandbytes holds packed, by module name (the layers that own
    it: peft's wrapper of one shows its weight too)."""
    return {name: module for name, module in model.named_modules()
            if type(module._parameters.get("weight")).__name__ in PACKED_WEIGHTS}  # fmt: skip


def dequantized_weight(layer: torch.nn.Module) -> torch.Tensor:
    """A packed layer's weight as a plain fp32 matrix."""
    return dequantize_bnb_weight(layer.weight, state=getattr(layer, "state", None)).float()
