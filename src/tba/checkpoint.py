"""Checkpoints: everything a run needs to go on exactly where it stopped.

<run_dir>/checkpoints/step000120/
    model.safetensors      the trainer's policy (with LoRA: base weights and adapters)
    optimizer.safetensors  the optimizer's tensors (Adam's moments, fp32 master weights)
    buffer.json.gz         the replay buffer, every sample in it
    state.json             step, weight version, schedule, RNG states, each searcher's position
                           in its prompt stream, counters, and the config that wrote it

Tensors go to safetensors and everything else to JSON, so loading a checkpoint never unpickles
anything: a checkpoint someone sends cannot run code. A checkpoint is written under a temporary
name and renamed once complete, so a crash or a full disk mid-write leaves the previous ones
intact; the newest `keep` are kept.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from tba.buffer import ReplayBuffer
from tba.errors import CheckpointError

FORMAT = 1
PARTIAL_PREFIX = ".partial-"


@dataclass
class Checkpoint:
    path: Path
    model: dict[str, torch.Tensor]
    optimizer: dict[str, torch.Tensor]
    buffer_state: dict[str, Any]  # ReplayBuffer.state_dict()
    state: dict[str, Any]

    @property
    def step(self) -> int:
        return self.state["step"]


def save_checkpoint(
    run_dir: Path,
    step: int,
    *,
    model: dict[str, torch.Tensor],
    optimizer: dict[str, torch.Tensor],
    buffer: ReplayBuffer,
    state: dict[str, Any],
    keep: int,
) -> Path:
    """Write checkpoints/stepNNNNNN atomically, then delete all but the newest `keep`."""
    root = run_dir / "checkpoints"
    root.mkdir(exist_ok=True)
    final = root / f"step{step:06d}"
    if final.exists():  # already saved at this step (a periodic one, then the one at exit)
        return final
    partial = root / f"{PARTIAL_PREFIX}{final.name}"
    shutil.rmtree(partial, ignore_errors=True)
    try:
        partial.mkdir()
        save_file(_unshared(model), partial / "model.safetensors")
        save_file(_unshared(optimizer), partial / "optimizer.safetensors")
        buffer.save(partial / "buffer.json.gz")
        (partial / "state.json").write_text(json.dumps({"format": FORMAT, "step": step, **state}))
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
        return Checkpoint(
            path=path,
            model=load_file(path / "model.safetensors"),
            optimizer=load_file(path / "optimizer.safetensors"),
            buffer_state=ReplayBuffer.read_state(path / "buffer.json.gz"),
            state=state,
        )
    except CheckpointError:
        raise
    except Exception as error:  # missing, truncated or corrupted files (safetensors has its own)
        raise CheckpointError(f"cannot read checkpoint {path}: {error}") from None


def latest_checkpoint(run_dir: Path) -> Checkpoint:
    checkpoints = list_checkpoints(run_dir)
    if not checkpoints:
        raise CheckpointError(f"no checkpoint in {run_dir / 'checkpoints'} to resume from")
    return load_checkpoint(checkpoints[-1])


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
    for file in path.iterdir():
        with file.open("rb") as handle:
            os.fsync(handle.fileno())
    directory = os.open(path, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


# ------------------------------------------------------------------------ what else it holds

# Settings that define what is trained and on what: a checkpoint resumes only with these equal.
# Everything else (steps, minutes, learning rate, searchers, ...) may change on resume.
IDENTITY_KEYS = ("seed", "policy.model", "policy.dtype", "policy.chat_template", "lora", "task")


def check_compatible(saved: dict[str, Any], current: dict[str, Any], path: Path) -> None:
    """Raise CheckpointError when the checkpoint's config differs on an identity setting."""
    for key in IDENTITY_KEYS:
        old, new = _get(saved, key), _get(current, key)
        if old != new:
            raise CheckpointError(
                f"checkpoint {path} was written with {key}={old!r}, this run has {new!r}; "
                f"a checkpoint resumes only the same {', '.join(IDENTITY_KEYS)}"
            )


def _get(config: dict[str, Any], dotted: str) -> Any:
    value: Any = config
    for part in dotted.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def rng_states(sampler: np.random.Generator) -> dict[str, Any]:
    """Every random state of the trainer process, as JSON values."""
    legacy = np.random.get_state(legacy=False)
    legacy["state"] = {"key": legacy["state"]["key"].tolist(), "pos": legacy["state"]["pos"]}
    return {
        "sampler": sampler.bit_generator.state,
        "python": random.getstate(),
        "numpy": legacy,
        "torch": torch.get_rng_state().tolist(),
    }


def restore_rng_states(sampler: np.random.Generator, states: dict[str, Any]) -> None:
    sampler.bit_generator.state = states["sampler"]
    version, internal, gauss = states["python"]
    random.setstate((version, tuple(internal), gauss))
    legacy = states["numpy"]
    key = np.asarray(legacy["state"]["key"], dtype=np.uint32)
    np.random.set_state(legacy | {"state": legacy["state"] | {"key": key}})
    torch.set_rng_state(torch.tensor(states["torch"], dtype=torch.uint8))
