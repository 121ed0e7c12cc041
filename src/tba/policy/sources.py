"""Where a model's files come from: a local directory, a snapshot in the Hugging Face Hub cache,
or a directory the project builds once and caches (the embedded worlds' models).

A Hub id is resolved in the `tba train` process to a local snapshot (downloaded once;
`HF_HUB_OFFLINE=1` uses the cache only), and every searcher loads that same directory: the
trainer and the searchers can never load different revisions.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

from huggingface_hub import constants, snapshot_download

from tba.errors import ConfigError, first_line
from tba.locks import FileLock, Locked, describe_holder


def model_dir(model: str, key: str = "policy.model") -> Path:
    """A local directory holding the model `model` names: the directory itself, or the Hub
    snapshot of a Hub id (`key` names the setting in error messages)."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if looks_like_a_path(model):
        raise FileNotFoundError(f"{key}: no model directory at {path}")
    return hub_snapshot(model, key)


def looks_like_a_path(model: str) -> bool:
    """Hub ids are `name` or `owner/name`; anything else can only be meant as a directory."""
    return model.startswith((".", "/", "~")) or model.count("/") > 1 or "\\" in model


def hub_snapshot(model_id: str, key: str = "policy.model") -> Path:
    """The local directory of a Hub model's files (weights, config, tokenizer), downloaded into
    the Hub cache unless already there. Any failure becomes one line naming what was looked for."""
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
        raise FileNotFoundError(
            f"{key}: {model_id!r} is not a local directory and was not found in {looked}: "
            f"{type(error).__name__}: {first_line(error)}"
        ) from None


def built_once(
    target: Path, ready: str, what: str, build: Callable[[Path], object], log=print
) -> Path:
    """`target`, built by `build(staging_dir)` unless its file `ready` (written last) is there.
    The build goes to a staging directory renamed into place: atomic, so a half-built model is
    never mistaken for a cached one. Processes that start together (several seeds on a fresh
    machine) take turns under a lock: one builds, the others wait for it and use what it built."""
    if (target / ready).exists():
        return target
    lock = FileLock(target.with_name(target.name + ".lock"))
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        lock.acquire()
    except Locked as error:
        log(f"waiting for {describe_holder(error.holder)}, which is building {what} into {target}")
        lock.acquire(wait=True)
    except OSError as error:
        raise ConfigError(f"cannot build {what} into {target} ({error.strerror or error}): set "
                          "pretrain.cache_dir to a directory you can write to") from None
    try:
        if (target / ready).exists():  # built while we waited
            return target
        log(f"building {what} (once) into {target}")
        staging = target.with_name(target.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        build(staging)
        staging.rename(target)
        return target
    finally:
        lock.release()
