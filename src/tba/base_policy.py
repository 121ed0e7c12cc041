"""Where the policy comes from: the built-in tiny math policy (pretrained once, then cached) or a
directory saved with `save_pretrained`."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from tba.config import PretrainConfig
from tba.pretrain import pretrain_math_policy
from tba.tasks import math as math_task

BUILTIN = "builtin:math"


def builtin_policy_dir(pretrain: PretrainConfig, seed: int) -> Path:
    """The cache entry is keyed by everything that shapes the base policy."""
    settings = pretrain.model_dump(exclude={"cache_dir"}) | {
        "seed": seed,
        "task_version": math_task.VERSION,
    }
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]
    return Path(pretrain.cache_dir).expanduser() / f"math-{key}"


def resolve_policy(model: str, pretrain: PretrainConfig, seed: int, log=print) -> Path:
    """A local directory holding the policy's weights and tokenizer, building it when needed."""
    if model != BUILTIN:
        path = Path(model).expanduser()
        if not path.is_dir():
            raise FileNotFoundError(f"policy.model: no model directory at {path}")
        return path
    target = builtin_policy_dir(pretrain, seed)
    if (target / "config.json").exists():
        return target
    log(f"building the built-in base policy (once) into {target}")
    staging = target.with_name(target.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    pretrain_math_policy(
        staging,
        num_examples=pretrain.num_examples,
        steps=pretrain.steps,
        batch_size=pretrain.batch_size,
        lr=pretrain.learning_rate,
        sloppy_fraction=pretrain.sloppy_fraction,
        seed=seed,
        log=log,
    )
    staging.rename(target)  # atomic: a half-built policy is never mistaken for a cached one
    return target
