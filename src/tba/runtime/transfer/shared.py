"""Shared buckets: searcher processes on the trainer's machine map the trainer's weight buckets
(`tba.runtime.transfer.buckets`) and copy each new version out of them, without a copy through
host memory or Ray's object store.

The buckets are handed once to each searcher process as PyTorch's own tensor-sharing handles: on
a CPU, the storage moved to shared memory (`UntypedStorage._share_filename_cpu_`, rebuilt with
`torch.multiprocessing.reductions.rebuild_storage_filename`); on a GPU, a CUDA IPC handle
(`reduce_tensor` / `rebuild_cuda_tensor`), which a searcher opens only on the same physical GPU
(compared by UUID). A searcher on another machine (its Ray node or boot id differs), on another
GPU or with a model laid out differently cannot attach (`CannotAttach`, with the reason).

On a CPU the buckets live in /dev/shm, twice the size of what is published (the double buffer):
a container's small /dev/shm (Docker's default is 64 MB) cannot hold them, which the sender says
in one line (`CannotSend`) before any searcher waits on it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import socket
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.multiprocessing.reductions import (
    rebuild_cuda_tensor,
    rebuild_storage_filename,
    reduce_tensor,
)

from tba.errors import first_line
from tba.policy.model import published_state
from tba.runtime.transfer.base import (
    CannotAttach,
    CannotSend,
    Offer,
    Receiver,
    ReceiverPlace,
    Sender,
    SenderPlace,
)
from tba.runtime.transfer.buckets import (
    LayoutMismatch,
    check_layout,
    copy_into,
    copy_pairs,
    dtype_name,
    lock,
    manifest,
    published_nbytes,
    read_manifest,
    to_dtype,
)

NAME = "shared"
SHM = Path("/dev/shm")


def _boot_id() -> str:
    with contextlib.suppress(OSError):
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    return ""


def _gpu_uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def _share_cpu(tensor: torch.Tensor) -> tuple:
    """A handle another process on this machine maps `tensor`'s memory with (the storage moves
    to shared memory)."""
    manager, filename, nbytes = tensor.untyped_storage()._share_filename_cpu_()
    return ("cpu", manager, filename, nbytes, dtype_name(tensor.dtype), tensor.numel())


def _map(handle: tuple, device: torch.device | None) -> torch.Tensor:
    """The tensor a `_share_cpu` or CUDA handle names, in this process (`device`: the local
    CUDA device that is the trainer's GPU)."""
    if handle[0] == "cpu":
        _, manager, filename, nbytes, dtype, numel = handle
        storage = rebuild_storage_filename(torch.UntypedStorage, manager, filename, nbytes)
        return torch.empty(0, dtype=to_dtype(dtype)).set_(storage, 0, (numel,), (1,))
    args = list(handle[1])
    args[6] = device.index  # the trainer's GPU as this process numbers it
    return rebuild_cuda_tensor(*args)


def shm_too_small(needed: int) -> str | None:
    """Why /dev/shm cannot hold `needed` more bytes, or None where it can (or is not there)."""
    try:
        free = shutil.disk_usage(SHM).free
    except OSError:
        return None
    if free >= needed:
        return None
    return (f"shared memory ({SHM}) has {_size(free)} free and the weight buckets need "
            f"{_size(needed)}")  # fmt: skip


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes} bytes"


SHM_ADVICE = ("give the container more (`docker run --shm-size=...`, Kubernetes: an emptyDir "
              "with medium Memory on /dev/shm)")  # fmt: skip


class SharedReceiver(Receiver):
    """The trainer's buckets mapped into this process; `receive` copies the newest whole
    version into the model."""

    name = NAME

    def __init__(self, handles: dict[str, Any], model: torch.nn.Module,
                 place: ReceiverPlace) -> None:  # fmt: skip
        node = place.node
        if handles["node"] is not None and node is not None and handles["node"] != node:
            raise CannotAttach("the searcher runs on another Ray node than the trainer")
        if handles["host"] != socket.gethostname() or handles["boot_id"] != _boot_id():
            raise CannotAttach("the searcher runs on another machine than the trainer")
        self.entries = read_manifest(handles["entries"])
        target = published_state(model)
        try:
            check_layout(self.entries, target)
        except LayoutMismatch as error:
            raise CannotAttach(str(error)) from None
        device = next(iter(target.values())).device
        local_gpu = None
        if handles["device"] == "cuda":
            local_gpu = self._local_gpu(handles["gpu_uuid"], device)
        try:
            self.header = _map(handles["header"], None).view(-1, 2)  # [set] -> (version, step)
            sets = [{d: _map(h, local_gpu) for d, h in s.items()} for s in handles["sets"]]
            self._fds = [os.open(path, os.O_RDWR) for path in handles["locks"]]
        except Exception as error:  # no shared memory, lock files gone: say why, in one line
            raise CannotAttach(f"cannot map the trainer's buckets: {first_line(error)}") from None
        # Per set: (this model's tensors, the bucket views they copy from).
        self._pairs = [copy_pairs(self.entries, target, buckets) for buckets in sets]

    @classmethod
    def attach(cls, handles: Any, model: torch.nn.Module, place: ReceiverPlace) -> SharedReceiver:
        return cls(handles, model, place)

    @staticmethod
    def _local_gpu(uuid: str, device: torch.device) -> torch.device:
        """This process's number of the trainer's GPU, which the searcher's model must be on."""
        if device.type != "cuda":
            raise CannotAttach("the trainer's buckets are on a GPU and the searcher on a "
                               f"{device.type}")  # fmt: skip
        if _gpu_uuid(device) != uuid:
            raise CannotAttach("the searcher runs on another GPU than the trainer")
        return device

    def receive(
        self, model: torch.nn.Module, newer_than: int, offer: Offer | None, *, wait: bool = False
    ) -> tuple[int, int] | None:
        """The newest published set, under its shared lock so that the trainer does not write
        it meanwhile (the version offered is always written before it is offered)."""
        versions = self.header[:, 0].tolist()
        index = int(np.argmax(versions))
        if versions[index] <= newer_than:
            return None
        fd = self._fds[index]
        lock(fd, exclusive=False)
        try:
            version, step = (int(x) for x in self.header[index])  # authoritative under the lock
            if version <= newer_than:
                return None
            copy_into(*self._pairs[index])
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
        return version, step

    def close(self) -> None:
        for fd in self._fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds = []


class SharedSender(Sender):
    """The trainer's buckets, allocated where the searcher processes on its machine can map them
    (`settings.sets`: 2, the double buffer, or 1)."""

    name = NAME
    receiver = SharedReceiver
    needs_trainer_module = True

    def __init__(self, settings: Any, trainer: Any, place: SenderPlace) -> None:
        super().__init__(settings, trainer, place)
        if next(trainer.model.parameters()).device.type == "cpu":
            too_small = shm_too_small(settings.sets * published_nbytes(trainer.model))
            if too_small is not None:
                raise CannotSend(f"{too_small}: {SHM_ADVICE}")
        self.sets = place.buckets.get(trainer.model, sets=settings.sets, make_bucket=self._bucket)
        try:
            self._handles = [
                {d: _share_cpu(t) if t.device.type == "cpu" else ("cuda", reduce_tensor(t)[1])
                 for d, t in s.items()}
                for s in self.sets.sets
            ]  # fmt: skip
            self._header_handle = _share_cpu(self.sets.header)
        except RuntimeError as error:  # "unable to allocate shared memory(shm) ..."
            raise CannotSend(f"{first_line(error)}: {SHM_ADVICE}") from None

    def _bucket(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """One bucket; on a CPU moved to shared memory, or `CannotSend` saying why not."""
        device = next(self.trainer.model.parameters()).device
        tensor = torch.empty(numel, dtype=dtype, device=device)
        if device.type != "cpu":
            return tensor
        try:
            _share_cpu(tensor)
        except RuntimeError as error:  # "unable to allocate shared memory(shm) ..."
            raise CannotSend(f"{first_line(error)}: {SHM_ADVICE}") from None
        return tensor

    def publish(self, version: int, step: int) -> None:
        try:
            self.sets.publish(version, step, timeout_s=self.place.timeout_s)
        except TimeoutError as error:
            raise TimeoutError(f"{error} (ray.sync_timeout_s={self.place.timeout_s:g})") from None

    def handles(self) -> dict[str, Any]:
        device = self.sets.device
        return {
            "node": self.place.node,
            "host": socket.gethostname(),
            "boot_id": _boot_id(),
            "device": device.type,
            "gpu_uuid": _gpu_uuid(device) if device.type == "cuda" else None,
            "entries": manifest(self.sets.entries),
            "sets": self._handles,
            "header": self._header_handle,
            "locks": self.sets.lock_paths,
        }

    def close(self) -> None:
        """Nothing of its own: the buckets are the run's (`SenderPlace.buckets`)."""
