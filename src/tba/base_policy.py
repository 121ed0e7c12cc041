"""Where the policy comes from: a built-in tiny model (`builtin:math`, the math policy;
`builtin:redteam`, the red-teaming world's attacker; `builtin:summarize`, the summarisation
world's SFT policy), pretrained once and cached, a directory saved with `save_pretrained`, or a
model on the Hugging Face Hub.

A Hub id is resolved here, in the `tba train` process, to a local snapshot in the Hub cache
(downloaded once; `HF_HUB_OFFLINE=1` uses the cache only), and every searcher loads that same
directory: the trainer and the searchers can never load different revisions.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from functools import partial
from pathlib import Path

from tba.config import PretrainConfig
from tba.pretrain import build_redteam_world, build_summarize_world, pretrain_math_policy
from tba.tasks import math as math_task
from tba.tasks import redteam_world, summarize_world

BUILTIN = "builtin:math"
BUILTIN_REDTEAM = "builtin:redteam"
BUILTIN_SUMMARIZE = "builtin:summarize"


def builtin_policy_dir(pretrain: PretrainConfig, seed: int) -> Path:
    """The cache entry is keyed by everything that shapes the base policy."""
    settings = pretrain.model_dump(exclude={"cache_dir"}) | {
        "seed": seed,
        "task_version": math_task.VERSION,
    }
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]
    return Path(pretrain.cache_dir).expanduser() / f"math-{key}"


def built_once(target: Path, ready: str, what: str, build, log=print) -> Path:
    """`target`, built by `build(staging_dir)` unless its file `ready` (written last) is there.
    The build goes to a staging directory renamed into place: atomic, so a half-built model is
    never mistaken for a cached one."""
    if (target / ready).exists():
        return target
    log(f"building {what} (once) into {target}")
    staging = target.with_name(target.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    build(staging)
    staging.rename(target)
    return target


def redteam_world_dir(pretrain: PretrainConfig, log=print) -> Path:
    """The embedded red-teaming world (attacker/, victim/, classifier/), built once: the world is
    the task, so it is the same for every run seed."""
    target = Path(pretrain.cache_dir).expanduser() / f"redteam-v{redteam_world.VERSION}"
    build = partial(build_redteam_world, seed=0, log=log)
    return built_once(target, "classifier/config.json", "the red-teaming world", build, log)


def summarize_world_dir(pretrain: PretrainConfig, log=print) -> Path:
    """The embedded summarisation world (policy/, the SFT summariser, and proxy/, its reward
    model), built once: the world is the task, so it is the same for every run seed."""
    target = Path(pretrain.cache_dir).expanduser() / f"summarize-v{summarize_world.VERSION}"
    build = partial(build_summarize_world, seed=0, log=log)
    return built_once(target, "world.json", "the summarisation world", build, log)


def resolve_policy(model: str, pretrain: PretrainConfig, seed: int, log=print) -> Path:
    """A local directory holding the policy's weights and tokenizer, building it when needed."""
    if model == BUILTIN_REDTEAM:
        return redteam_world_dir(pretrain, log) / "attacker"
    if model == BUILTIN_SUMMARIZE:
        return summarize_world_dir(pretrain, log) / "policy"
    if model != BUILTIN:
        path = Path(model).expanduser()
        if path.is_dir():
            return path
        if _looks_like_a_path(model):
            raise FileNotFoundError(f"policy.model: no model directory at {path}")
        return hub_snapshot(model)
    return built_once(
        builtin_policy_dir(pretrain, seed), "config.json", "the built-in base policy",
        lambda staging: pretrain_math_policy(
            staging, num_examples=pretrain.num_examples, steps=pretrain.steps,
            batch_size=pretrain.batch_size, lr=pretrain.learning_rate,
            sloppy_fraction=pretrain.sloppy_fraction, seed=seed, log=log,
        ),
        log,
    )  # fmt: skip


def _looks_like_a_path(model: str) -> bool:
    """Hub ids are `name` or `owner/name`; anything else can only be meant as a directory."""
    return model.startswith((".", "/", "~")) or model.count("/") > 1 or "\\" in model


def hub_snapshot(model_id: str) -> Path:
    """The local directory of a Hub model's files (weights, config, tokenizer), downloaded into
    the Hub cache unless already there. Any failure becomes one line naming what was looked for."""
    from huggingface_hub import constants, snapshot_download

    # The variable as it is now, not only as it was when huggingface_hub was imported.
    flag = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in {"1", "true", "yes", "on"}
    offline = flag or constants.HF_HUB_OFFLINE
    try:
        return Path(
            snapshot_download(
                model_id,
                local_files_only=offline,
                # Only what `from_pretrained` reads: no other frameworks' copies of the weights.
                ignore_patterns=["*.h5", "*.msgpack", "*.onnx", "*.ot", "*.gguf", "original/*"],
            )
        )
    except Exception as error:  # offline, not found, gated, no network: all the same to the user
        where = f"the Hub cache ({constants.HF_HUB_CACHE})"
        if offline:
            looked = f"{where} only (HF_HUB_OFFLINE=1)"
        else:
            looked = f"the Hugging Face Hub and {where}"
        reason = str(error).strip().splitlines()[0] if str(error).strip() else ""
        raise FileNotFoundError(
            f"policy.model: {model_id!r} is not a local directory and was not found in {looked}: "
            f"{type(error).__name__}{': ' + reason if reason else ''}"
        ) from None
