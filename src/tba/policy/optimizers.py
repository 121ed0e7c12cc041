"""The trainer's optimizer (`train.optimizer`): torch's AdamW, or bitsandbytes' 8-bit AdamW.

- `adamw`: `torch.optim.AdamW`, its two moments in the dtype of what it updates (fp32 masters:
  8 bytes a weight).
- `adamw_8bit`: `bitsandbytes.optim.AdamW8bit`, the same update with both moments held in 8 bits,
  quantized block-wise (256 values a block, each with an fp32 scale): 2 bytes a weight. Tensors
  of fewer than 4096 values (biases, norm weights, heads) keep fp32 moments, as bitsandbytes
  does. It runs on a CPU too.
- `paged_adamw_8bit`: the same, its state in CUDA unified memory that pages to the host under
  memory pressure (`PagedAdamW8bit`); on a CPU there is nothing to page: `adamw_8bit`, with a
  notice.

Both take the trainer's parameter groups (their `lr` and `weight_decay`), and with either,
weight decay is decoupled (AdamW). A checkpoint holds the optimizer's state as tensors and
scalars, flat (`flat_param_state`: bitsandbytes wraps its quantized state in a dict of its own);
`load_optimizer_state` puts it back as it was saved.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from typing import Any

import torch

from tba.config.train import OPTIMIZERS
from tba.errors import ConfigError


def require_bitsandbytes(name: str) -> Any:
    """bitsandbytes, for `train.optimizer=name`; missing, one line saying what to install."""
    if importlib.util.find_spec("bitsandbytes") is None:
        raise ConfigError(f"train.optimizer={name} needs bitsandbytes: pip install "
                          "bitsandbytes (or tba[qlora]), or train.optimizer=adamw")  # fmt: skip
    return importlib.import_module("bitsandbytes")


def check_optimizer(name: str) -> None:
    """Before anything starts: the software `train.optimizer=name` needs."""
    if name != "adamw":
        require_bitsandbytes(name)


def build_optimizer(
    name: str, groups: list[dict[str, Any]], device: torch.device | str
) -> torch.optim.Optimizer:
    """`train.optimizer=name` over the parameter groups `groups`, whose parameters are on
    `device`."""
    if name == "adamw":
        return torch.optim.AdamW(groups, weight_decay=0.0)
    if name not in OPTIMIZERS:
        raise ConfigError(f"train.optimizer is one of {', '.join(OPTIMIZERS)}, not {name!r}")
    bnb = require_bitsandbytes(name)
    paged = name == "paged_adamw_8bit"
    kind = torch.device(device).type
    if paged and kind != "cuda":
        print(f"notice: train.optimizer={name} pages its state in CUDA memory; on {kind} it is "
              "adamw_8bit, unpaged", file=sys.stderr)  # fmt: skip
        paged = False
    optimizer = bnb.optim.PagedAdamW8bit if paged else bnb.optim.AdamW8bit
    return optimizer(groups, weight_decay=0.0)


def flat_param_state(values: dict[str, Any]) -> dict[str, Any]:
    """One parameter's optimizer state, flat: bitsandbytes' `state_dict` wraps its quantized
    state (`state1`, `absmax1`, `qmap1`, ...) in a dict of its own, which its `load_state_dict`
    also reads flat."""
    flat = {}
    for name, value in values.items():
        if isinstance(value, dict):
            flat.update(value)
        else:
            flat[name] = value
    return flat


def load_optimizer_state(
    optimizer: torch.optim.Optimizer, state: dict[int, dict[str, Any]],
    param_groups: list[dict[str, Any]],
) -> None:  # fmt: skip
    """Load a state saved from `optimizer.state_dict()` (flat), each tensor in the dtype it was
    saved in: torch casts a state's floating tensors to its parameter's dtype, and with
    `train.master_weights=none` Adam's fp32 moments of a bf16 weight must stay fp32."""
    optimizer.load_state_dict({"state": state, "param_groups": param_groups})
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for index, values in state.items():
        held = optimizer.state[params[index]]
        for name, value in values.items():
            now = held.get(name)
            if torch.is_tensor(value) and torch.is_tensor(now) and now.dtype != value.dtype:
                held[name] = value.to(now.device, copy=True)
