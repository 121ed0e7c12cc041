"""Checkpoints: everything a run needs to go on exactly where it stopped.

A checkpoint is the run's state: one dict with each component's `state_dict()` under its name
(`trainer`, `buffer`, `searchers`, `feed`, ...: `tba.loop.TrainLoop.state_dict`), stored as

<run_dir>/checkpoints/step000120/
    model.safetensors      state["trainer"]["model"]: the policy (with LoRA: base and adapters; with
                           a quantized base only the adapters)
    optimizer.safetensors  state["trainer"]["optimizer"]: Adam's moments (8-bit ones with their
                           scales), fp32 master weights or Kahan compensations
    buffer.json.gz         state["buffer"]: the replay buffer, every sample in it
    state.json             everything else: step, weight version, schedule, RNG states, each
                           searcher's position in its prompt stream, counters, and the config

A sharded trainer (`trainer.world_size > 1`, `tba.runtime.fsdp`) has its ranks write their own
shards of the policy and of Adam's state instead of the two safetensors files: a
`torch.distributed.checkpoint` directory `trainer/` (its state names `save_shards`, called with
that directory, which returns the rest of the trainer's state). On a cluster the run directory
must be on storage every trainer node sees.

Tensors go to safetensors and everything else to JSON, so loading a checkpoint never unpickles
anything: a checkpoint someone sends cannot run code. A checkpoint is written under a temporary
name and renamed once complete, so a crash or a full disk mid-write leaves the previous ones
intact; the newest `keep` are kept.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from tba.config import QuantizationConfig
from tba.config.loading import quoted
from tba.errors import CheckpointError, writing
from tba.keys import get_key
from tba.objectives import DEFAULT_OBJECTIVE, OBJECTIVES

FORMAT = 2  # 2: one state dict, each component's under its name
PARTIAL_PREFIX = ".partial-"
TENSORS = ("model", "optimizer")  # of state["trainer"], each in <name>.safetensors
SHARDS = "trainer"  # a sharded trainer's torch.distributed.checkpoint directory


@dataclass
class Checkpoint:
    """A checkpoint read back: where it is, and the state that was saved (tensors included)."""

    path: Path
    state: dict[str, Any]

    @property
    def step(self) -> int:
        return self.state["step"]


def save_checkpoint(run_dir: Path, step: int, state: dict[str, Any], keep: int) -> Path:
    """Write `state` as checkpoints/stepNNNNNN atomically, then delete all but the newest `keep`."""
    root = run_dir / "checkpoints"
    root.mkdir(exist_ok=True)
    final = root / f"step{step:06d}"
    if final.exists():  # already saved at this step (a periodic one, then the one at exit)
        return final
    partial = root / f"{PARTIAL_PREFIX}{final.name}"
    shutil.rmtree(partial, ignore_errors=True)
    try:
        with writing(f"checkpoint {final}"):
            partial.mkdir()
            trainer = dict(state["trainer"])
            save_shards = trainer.pop("save_shards", None)
            if save_shards is not None:
                trainer["shards"] = save_shards(str(partial / SHARDS))
            else:
                for name in TENSORS:
                    save_file(_unshared(trainer.pop(name)), partial / f"{name}.safetensors")
            # Level 1: several times faster than the default 9, and JSON still shrinks ~4x.
            buffer = partial / "buffer.json.gz"
            with gzip.open(buffer, "wt", encoding="utf-8", compresslevel=1) as f:
                json.dump(state["buffer"], f)
            rest = {key: value for key, value in state.items() if key != "buffer"}
            text = json.dumps({"format": FORMAT, "step": step, **rest, "trainer": trainer})
            (partial / "state.json").write_text(text)
            _fsync_tree(partial)
            partial.rename(final)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    for old in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first (a partial one is never listed)."""
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step*") if (p / "state.json").is_file())


def load_checkpoint(path: Path) -> Checkpoint:
    try:
        state = json.loads((path / "state.json").read_text())
        if state.get("format") != FORMAT:
            raise CheckpointError(
                f"checkpoint {path} has format {state.get('format')!r}; this version reads "
                f"format {FORMAT}"
            )
        if "shards" in state["trainer"]:  # read by the ranks themselves, when they load it
            if not (path / SHARDS / ".metadata").is_file():
                raise CheckpointError(f"checkpoint {path} has no {SHARDS}/.metadata")
            state["trainer"]["shards_dir"] = str(path / SHARDS)
        else:
            for name in TENSORS:
                state["trainer"][name] = load_file(path / f"{name}.safetensors")
        with gzip.open(path / "buffer.json.gz", "rt", encoding="utf-8") as f:
            state["buffer"] = json.load(f)
        return Checkpoint(path, state)
    except CheckpointError:
        raise
    except Exception as error:  # missing, truncated or corrupted files (safetensors has its own)
        raise CheckpointError(f"cannot read checkpoint {path}: {error}") from None


def latest_checkpoint(run_dir: Path, log: Callable[[str], None] = print) -> Checkpoint:
    """The newest checkpoint that reads back whole. A damaged newer one (a file cut short by a
    kill or a full disk) is moved aside, to `damaged-stepNNNNNN`, with a line saying so: the run
    goes on from the one before, and writes its own checkpoint at that step again."""
    checkpoints = list_checkpoints(run_dir)
    if not checkpoints:
        raise CheckpointError(f"no checkpoint in {run_dir / 'checkpoints'} to resume from: the run "
                              "stopped before its first one; start it again instead")  # fmt: skip
    damaged = []
    for path in reversed(checkpoints):
        try:
            checkpoint = load_checkpoint(path)
        except CheckpointError as error:
            damaged.append((path, str(error)))
            continue
        for damaged_path, reason in damaged:
            aside = damaged_path.with_name(f"damaged-{damaged_path.name}")
            shutil.rmtree(aside, ignore_errors=True)
            damaged_path.rename(aside)
            log(f"skipping a damaged checkpoint, moved to {aside}: {reason}")
        return checkpoint
    raise CheckpointError(f"no checkpoint of {run_dir} reads back whole (the newest: "
                          f"{damaged[0][1]}); start the run again instead")  # fmt: skip


def _unshared(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses tensors that share memory (tied embeddings): copy the later ones."""
    seen: set[int] = set()
    out = {}
    for name, tensor in tensors.items():
        tensor = tensor.detach().cpu().contiguous()
        pointer = tensor.untyped_storage().data_ptr()
        out[name] = tensor.clone() if pointer in seen else tensor
        seen.add(pointer)
    return out


def _fsync_tree(path: Path) -> None:
    """On disk before the rename makes the checkpoint visible."""
    for item in [*path.rglob("*"), path]:
        descriptor = os.open(item, os.O_RDONLY)  # a directory's entries need their own fsync
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)


# ------------------------------------------------------------------------ what else it holds

# Settings that define what is trained and on what: a checkpoint resumes only with these equal.
# Everything else (steps, minutes, learning rate, searchers, ...) may change on resume.
IDENTITY_KEYS = ("seed", "policy.model", "policy.dtype", "policy.chat_template", "lora",
                 "quantization", "task")  # fmt: skip
# Sections among those that runs written before them lack: those runs had them at their defaults.
ADDED_SECTIONS = {"quantization": QuantizationConfig}
# Settings under those that change how the run is measured or computed, not what it trains.
FREE_KEYS = ("task.num_eval", "task.num_eval_pass_k", "task.reward_batch_size",
             "task.reward_device")  # fmt: skip
# Settings that decide what the trainer saves beside the policy (a critic, a learned log Z),
# with their defaults and the names runs written before `train.ppo` and `train.tb` gave them: a
# checkpoint of one trainer does not load into another (`check_trainer_parts`).
TRAINER_KEYS = {"train.loss": (DEFAULT_OBJECTIVE, ()),
                "train.ppo.value_model": ("head", ("train.value_model",)),
                "train.tb.log_z": ("vargrad", ("train.log_z",))}  # fmt: skip


def check_compatible(saved: dict[str, Any], current: dict[str, Any], path: Path) -> None:
    """Raise CheckpointError when the checkpoint's config differs on an identity setting (naming
    the settings that differ, and only those), or when it was trained by one process and this
    run shards the trainer, or the other way round (the two write their tensors differently;
    sharded runs resume on any number of ranks)."""
    old_ranks = get_key(saved, "trainer.world_size") or 1  # older runs had no such setting
    new_ranks = get_key(current, "trainer.world_size") or 1
    if (old_ranks > 1) != (new_ranks > 1):
        raise CheckpointError(
            f"checkpoint {path} was written with trainer.world_size={old_ranks}, this run has "
            f"{new_ranks}: a sharded checkpoint resumes on 2 or more ranks, an unsharded one on 1"
        )
    changed = [(key, old, new) for name in IDENTITY_KEYS
               for key, old, new in _differences(name, _identity(saved, name),
                                                 _identity(current, name))
               if key not in FREE_KEYS]  # fmt: skip
    if changed:
        shown = ", ".join(f"{key}={quoted(old, 60)} (this run: {quoted(new, 60)})"
                          for key, old, new in changed[:3])  # fmt: skip
        more = f" (and {len(changed) - 3} more)" if len(changed) > 3 else ""
        raise CheckpointError(
            f"checkpoint {path} was written with {shown}{more}; a checkpoint resumes only the "
            f"same {', '.join(IDENTITY_KEYS)}: set them back, or start a new run"
        )
    check_trainer_parts(saved, current, path)
    check_optimizer_state(saved, current, path)


# Settings that decide the form of the optimizer's state in a checkpoint (torch's moments or
# bitsandbytes' 8-bit ones, paged or not alike; fp32 masters or Kahan compensations), with the
# value of runs written before them: a state of one form does not load as another.
OPTIMIZER_KEYS = {"train.optimizer": "adamw", "train.master_weights": "fp32"}


def check_optimizer_state(saved: dict[str, Any], current: dict[str, Any], path: Path) -> None:
    """Raise CheckpointError, naming the settings and their values then and now, when the
    checkpoint's optimizer state has another form than this run's. `train.master_weights` has
    no effect on an fp32 policy (no weight has a master copy or a compensation): there it may
    change."""
    old, new = ({key: get_key(config, key) or default for key, default in OPTIMIZER_KEYS.items()}
                for config in (saved, current))  # fmt: skip
    # A run records its concrete dtype, and `auto` on resume is the dtype it was trained in
    # (`tba.run.with_concrete_dtype`): `auto` here is a config no run has decided.
    if all(get_key(config, "policy.dtype") in (None, "float32", "auto")
           for config in (saved, current)):  # fmt: skip
        old.pop("train.master_weights")
        new.pop("train.master_weights")
    if [value.removeprefix("paged_") for value in old.values()] == [
            value.removeprefix("paged_") for value in new.values()]:  # fmt: skip
        return
    shown = ", ".join(f"{key}={old[key]!r} (this run: {new[key]!r})" for key in old
                      if old[key] != new[key])  # fmt: skip
    raise CheckpointError(f"checkpoint {path} was written with {shown}: its optimizer state "
                          "does not load into this run's; set it back, or start a new run")


def check_trainer_parts(saved: dict[str, Any], current: dict[str, Any], path: Path) -> None:
    """Raise CheckpointError, naming the settings and their values then and now, when the
    checkpoint's trainer saved other parts than this run's has (a critic, a value head or a
    critic LM, a learned log Z): `train.loss=ppo` resumed as `tb`, say. An objective changed
    without changing them (tb to grpo) resumes."""
    old, new = _trainer_settings(saved), _trainer_settings(current)
    if _trainer_parts(old) == _trainer_parts(new):
        return
    shown = ", ".join(f"{key}={old[key]!r} (this run: {new[key]!r})" for key in TRAINER_KEYS
                      if old[key] != new[key])  # fmt: skip
    raise CheckpointError(
        f"checkpoint {path} was written with {shown}: a trainer with {_trainer_parts(old)} does "
        f"not resume as one with {_trainer_parts(new)}; set it back, or start a new run"
    )


def _trainer_settings(config: dict[str, Any]) -> dict[str, Any]:
    """`TRAINER_KEYS` as `config` sets them (under their older names in older runs)."""
    values = {}
    for key, (default, older) in TRAINER_KEYS.items():
        given = [get_key(config, name) for name in (key, *older)]
        values[key] = next((value for value in given if value is not None), default)
    return values


def _trainer_parts(settings: dict[str, Any]) -> str:
    """What a trainer of these settings saves beside the policy and its optimizer, in words."""
    objective = OBJECTIVES.get(settings["train.loss"])
    needs = getattr(objective, "needs", None)
    parts = []
    if needs is not None and needs.critic:
        parts.append("a critic LM" if settings["train.ppo.value_model"] == "critic"
                     else "a value head")  # fmt: skip
    if needs is not None and needs.learned_log_z and settings["train.tb.log_z"] == "learned":
        parts.append("a learned log Z")
    return " and ".join(parts) or "no critic or learned log Z"


def _identity(config: dict[str, Any], name: str) -> Any:
    value = get_key(config, name)
    if value is None and name in ADDED_SECTIONS:
        return ADDED_SECTIONS[name]().model_dump()
    return value


def _differences(key: str, old: Any, new: Any) -> list[tuple[str, Any, Any]]:
    """The settings under `key` whose values differ, as (dotted key, old, new)."""
    if isinstance(old, dict) and isinstance(new, dict):
        return [difference for name in dict.fromkeys([*old, *new])
                for difference in _differences(f"{key}.{name}", old.get(name), new.get(name))]
    return [] if old == new else [(key, old, new)]
