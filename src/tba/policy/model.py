"""Building, loading, saving and moving policy weights.

The built-in policy is an ordinary Hugging Face `LlamaForCausalLM`, only tiny, so that every
code path it takes (forward, KV cache, `save_pretrained`, `from_pretrained`) is a real model's.

Weights cross process boundaries as numpy arrays (`get_weights` / `set_weights`). numpy has no
bfloat16, so a bf16 tensor travels as the int16 view of its bits and is viewed back as bf16 on
arrival: lossless, and no bigger. With LoRA the trainer and the searchers each wrap their one
copy of the base weights with the same adapters, and only the adapter tensors travel.

Devices: `resolve_device` is the one normalisation of a device setting into a `torch.device`
(here, below every layer that loads a model: policies, reward models, Ray actors), and
`check_device` whether this machine has it; which device each part of a run gets is decided in
`tba.runtime.placement`.
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import peft
import torch
from huggingface_hub import save_torch_state_dict
from peft.tuners.lora import LoraLayer
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, PreTrainedModel

from tba.config import LoraConfig, QuantizationConfig
from tba.errors import ConfigError, first_line
from tba.policy.cpu import resolve_dtype
from tba.policy.gguf import gguf_file, load_gguf_model
from tba.policy.quantization import (
    bnb_config,
    dequantized_weight,
    is_quantized,
    keep_trainable_layout,
    packed_layers,
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def resolve_device(device: str | torch.device) -> torch.device:
    """The one normalisation of a device (a setting such as `auto`, `cuda`, `cuda:1`, `mps`,
    `cpu`, or a `torch.device`), so that two devices compare as devices: a CUDA device always
    has its index, the way a tensor's `.device` names it (`cuda` is `cuda:<current index>`,
    which `torch.device("cuda")` is not equal to), and `mps` is `mps:0`. `auto` is `cuda` when
    torch sees a CUDA device, else `cpu`. Naming a device does not start CUDA: until CUDA
    starts in this process its current GPU is the first. Resolved in the process that uses the
    device: a Ray searcher numbers only the GPUs it reserves, from 0. Where the trainer, the
    searchers and the reward models run is decided in `tba.runtime.placement`."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    target = torch.device(device)
    if target.index is not None:
        return target
    if target.type == "cuda":
        started = torch.cuda.is_initialized()
        return torch.device("cuda", torch.cuda.current_device() if started else 0)
    if target.type == "mps":
        return torch.device("mps", 0)
    return target


def check_device(device: str, key: str) -> None:
    """A device setting (`key`) names a device this machine has: one line saying what it has
    instead of torch's traceback once the model is moved there."""
    target = resolve_device(device)
    if target.type == "cuda":
        count = torch.cuda.device_count()
        if count == 0:
            raise ConfigError(f"{key}={device}: this machine has no CUDA device (torch sees "
                              f"none); set {key}=cpu, or auto")  # fmt: skip
        if target.index >= count:
            have = "cuda:0" if count == 1 else f"cuda:0 to cuda:{count - 1}"
            raise ConfigError(f"{key}={device}: this machine has {count} CUDA device(s), "
                              f"{have}")  # fmt: skip
    if target.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"{key}=mps: this machine has no MPS device; set {key}=cpu, or auto")


def build_tiny_llama(
    vocab_size: int,
    *,
    pad_token_id: int,
    bos_token_id: int,
    eos_token_id: int,
    hidden_size: int = 128,
    num_layers: int = 4,
    num_heads: int = 4,
    max_positions: int = 256,
    seed: int = 0,
) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=4 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=max_positions,
        pad_token_id=pad_token_id,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def load_model(
    path: str, device: torch.device | str, dtype: torch.dtype = torch.float32,
    quantization: QuantizationConfig | None = None,
) -> PreTrainedModel:  # fmt: skip
    """Load a causal LM saved with `save_pretrained` (or any Hugging Face model id), quantized
    when `quantization.bits` > 0; one that cannot be loaded is one line (`ConfigError`) naming it
    and why. A GGUF file (or a directory holding one and no config.json) loads dequantized into a
    plain model in `dtype` (`tba.policy.gguf`)."""
    quantized = bnb_config(quantization, dtype) if quantization is not None else None
    gguf = gguf_file(path)
    if gguf is not None:
        if quantized:
            raise ConfigError(f"policy.model: {gguf} is a GGUF file, which loads dequantized: "
                              "quantization.bits > 0 needs a model directory (save the loaded "
                              "model with save_pretrained)")  # fmt: skip
        return load_gguf_model(gguf, dtype).to(device)
    # A quantized model is placed while it loads, and not moved after.
    placement = ({"quantization_config": quantized, "device_map": {"": torch.device(device)}}
                 if quantized else {})  # fmt: skip
    try:
        # No Hub kernels (transformers >= 5.25 fetches them by default when `kernels` is
        # installed): a download at load time that fails offline.
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, use_kernels=False,
                                                     **placement)  # fmt: skip
    except Exception as error:  # missing, incomplete, damaged or unknown: all one line to a user
        raise ConfigError(f"cannot load a causal LM from {path}: {first_line(error)}") from None
    if not quantized:
        return model.to(device)
    keep_trainable_layout(model)
    return model


def load_policy(
    path: str,
    device: torch.device | str,
    *,
    dtype: str = "float32",
    lora: LoraConfig | None = None,
    gradient_checkpointing: bool | str = False,
    quantization: QuantizationConfig | None = None,
) -> PreTrainedModel:
    """The policy as trainer and searchers hold it: in `dtype`, with adapters when `lora.r > 0`
    (fresh adapters leave the model's outputs unchanged: their B matrix starts at zero), its
    base quantized when `quantization.bits > 0` (`tba.policy.quantization`), its activations
    recomputed in the backward pass with `gradient_checkpointing=True`. `auto` leaves it off
    here: the trainer decides at its first step, when it knows its micro-batches
    (`tba.policy.activation_memory`). `dtype=auto` is decided here as a run decides it
    (`tba.policy.cpu.resolve_dtype`), for a caller given a config no run has decided: a run
    decides it once, before any process loads the policy, so that all of them agree."""
    dtype, _ = resolve_dtype(dtype, device, path)
    model = load_model(path, device, DTYPES[dtype], quantization)
    disable_dropout(model)
    if gradient_checkpointing is True:
        enable_checkpointing(model)
    if lora is not None and lora.r > 0:
        model = add_lora(model, lora)
    return model


def enable_checkpointing(model: PreTrainedModel) -> None:
    """Recompute each layer's activations in the backward pass instead of keeping them."""
    # Non-reentrant checkpointing also works when only adapters need gradients.
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # the newer name in transformers
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    # transformers also hooks the embeddings to make their output require a gradient, which only
    # reentrant checkpointing needs, and which stops the compiled sampler's graph: removed.
    if hasattr(model, "disable_input_require_grads"):
        model.disable_input_require_grads()


def is_checkpointing(model: torch.nn.Module) -> bool:
    """Whether any layer recomputes its activations (the test transformers itself uses)."""
    return any(getattr(module, "gradient_checkpointing", False) for module in model.modules())


def disable_dropout(model: torch.nn.Module) -> None:
    """No dropout in the policy (GPT-2 has 0.1 in three places). The trainer runs in training
    mode, and its log-probs are compared with those the searchers computed without dropout: the
    noise would bias TB's residuals and every importance ratio."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0  # attention implementations read it as a float


def add_lora(model: PreTrainedModel, lora: LoraConfig) -> PreTrainedModel:
    """Wrap `model` with trainable low-rank adapters; its own weights are frozen, not copied."""
    config = peft.LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=lora.target_modules,
        task_type="CAUSAL_LM",
    )
    # Adapters stay in fp32 even on a bf16 base (peft's default): they are what is trained.
    return peft.get_peft_model(model, config)


def is_lora(model: torch.nn.Module) -> bool:
    return hasattr(model, "peft_config")


def unwrapped(model: PreTrainedModel) -> PreTrainedModel:
    """The Hugging Face model itself: under PEFT's wrapper (its adapters stay in its layers)."""
    return model.get_base_model() if is_lora(model) else model


def frozen_copy(model: PreTrainedModel) -> PreTrainedModel:
    """An independent copy in eval mode with gradients off (the reference policy)."""
    first = next(model.parameters())
    copy = type(model)(model.config).to(device=first.device, dtype=first.dtype)
    copy.load_state_dict(model.state_dict())
    copy.eval().requires_grad_(False)
    return copy


def get_weights(model: torch.nn.Module) -> dict[str, np.ndarray]:
    """What a searcher needs to become this policy, as numpy arrays (the format that crosses
    process boundaries without copies): every weight, or with LoRA only the adapters. Copied, so
    that later training steps do not change a published version."""
    return as_numpy(_published_state(model))


def set_weights(model: torch.nn.Module, weights: dict[str, np.ndarray]) -> None:
    """Adopt weights made by `get_weights` on a model of the same architecture and dtype."""
    target = _published_state(model)
    unknown = sorted(set(weights) - set(target))
    if unknown:
        raise KeyError(f"weights that this model does not have: {', '.join(unknown[:5])}")
    state = {name: _from_numpy(array, target[name].dtype) for name, array in weights.items()}
    if not is_lora(model):
        model.load_state_dict(state)
        return
    peft.set_peft_model_state_dict(model, state)


def published_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What a searcher needs to become this policy, as the model's own tensors (not copies:
    they share the parameters' memory): every weight, or with LoRA only the adapters."""
    return _published_state(model)


def _published_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    if not is_lora(model):
        return model.state_dict()
    return peft.get_peft_model_state_dict(model)


def as_numpy(tensors: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """Tensors as numpy arrays (copies); bf16 ones as their bits, in int16 (`_from_numpy`)."""
    return {name: _to_numpy(tensor) for name, tensor in tensors.items()}


def _to_numpy(tensor: torch.Tensor) -> np.ndarray:
    tensor = tensor.detach().cpu()
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.view(torch.int16)  # numpy has no bfloat16: the same 16 bits, as int16
    return tensor.numpy().copy()


def _from_numpy(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    tensor = torch.from_numpy(np.asarray(array))
    if dtype == torch.bfloat16 and tensor.dtype == torch.int16:
        tensor = tensor.view(torch.bfloat16)
    return tensor


def policy_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The policy as one plain model's state dict; with LoRA, the base weights with the adapters
    merged in (W + alpha/r * B A, computed in fp32 and kept in fp32), without touching the model,
    so that the keys and the shapes are those of the base model. A quantized base's weights are
    dequantized (fp32), and their quantization constants left out."""
    if not is_lora(model):
        return model.state_dict()
    base = model.get_base_model()
    packed = packed_layers(base)
    constants = tuple(f"{name}." for name in packed)  # and their weight and bias
    kept = {f"{name}.{part}" for name in packed for part in ("weight", "bias")}
    state = {
        name.replace(".base_layer.", "."): tensor
        for name, tensor in base.state_dict().items()
        if ".lora_" not in name and (name in kept or not name.startswith(constants))
    }
    for name, layer in packed.items():
        state[f"{name}.weight".replace(".base_layer.", ".")] = dequantized_weight(layer)
    with torch.no_grad():
        for name, module in base.named_modules():
            if isinstance(module, LoraLayer):
                for adapter in module.active_adapters:
                    key = f"{name}.weight"
                    delta = module.get_delta_weight(adapter).float()
                    state[key] = state[key].float() + delta
    return state


def snapshot_weights(model: torch.nn.Module) -> dict[str, np.ndarray]:
    """The whole policy (adapters merged) as fp32 numpy arrays, to score after the run."""
    return {
        name: tensor.detach().float().cpu().numpy().copy()
        for name, tensor in policy_state_dict(model).items()
    }


def save_policy(model: PreTrainedModel, path: Path) -> None:
    """`path` loadable with `from_pretrained` (the adapters merged into the base weights, in
    fp32); with LoRA also the adapters alone in `path/adapter` (`peft.PeftModel.from_pretrained`
    on the base model)."""
    if not is_lora(model):
        model.save_pretrained(path)
        return
    base = model.get_base_model()
    if is_quantized(base):  # saved as the plain model its weights now make
        config = copy.deepcopy(base.config)
        del config.quantization_config
        config.save_pretrained(path)
        base.generation_config.save_pretrained(path)
        save_torch_state_dict(policy_state_dict(model), path)
    else:
        base.save_pretrained(path, state_dict=policy_state_dict(model))
    model.save_pretrained(path / "adapter")


def checkpoint_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's part of a checkpoint: its state dict, or with a quantized base only the
    adapters (the frozen base reloads from policy.model as it was)."""
    return _published_state(model) if is_quantized(unwrapped(model)) else model.state_dict()


def load_checkpoint_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Adopt what `checkpoint_state` gave."""
    if is_quantized(unwrapped(model)):
        peft.set_peft_model_state_dict(model, state)
    else:
        model.load_state_dict(state)
