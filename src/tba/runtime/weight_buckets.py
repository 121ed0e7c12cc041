"""Handing the trainer's weights to searcher processes on the same machine without copying them
through host memory and Ray's object store: flat per-dtype buckets in shared memory.

**Buckets.** Everything a searcher needs (`tba.policy.model.published_state`: every weight, or
with LoRA only the adapters) is packed into one contiguous tensor per dtype on the trainer's
device (bf16 stays bf16; LoRA's fp32 adapters on a bf16 base go in an fp32 bucket), described by a
manifest of (name, dtype, offset, shape). A tensor that another name shares (tied embeddings)
travels once, its other names listed as aliases. A publish is a copy of the model into a bucket
(`torch._foreach_copy_`: a device copy on a GPU) and a new version number; the model's tensors
are found once, and again only when its parameters were replaced rather than updated in place.

**Sharing.** The buckets are handed once to each searcher process as PyTorch's own
tensor-sharing handles: on a CPU, the storage moved to shared memory
(`UntypedStorage._share_filename_cpu_`, rebuilt with
`torch.multiprocessing.reductions.rebuild_storage_filename`); on a GPU, a CUDA IPC handle
(`reduce_tensor` / `rebuild_cuda_tensor`), which a searcher opens only on the same physical GPU
(compared by UUID). The searcher maps the trainer's buckets and copies from them into its own
model, between two generations. `BucketReader.attach` refuses (`CannotAttach`, with the reason)
a searcher on another machine (its Ray node or boot id differs) or on another GPU: the caller
then takes the object-store path.

**Versions: a double buffer under reader/writer locks.** There are two bucket sets; version v
is written into set v % 2. Each set has a lock file, taken with `flock`: exclusively by the
trainer while it writes the set and then stamps the set's header (version, step, in a small
shared tensor), shared by a searcher while it copies the set into its model. A searcher picks the
set with the newest version, takes its shared lock, reads the header again (authoritative under
the lock) and copies, so it always copies one whole version and knows which: no generation ever
mixes two versions (a searcher changes its model only between generations). The trainer writes
the set a searcher is *not* reading: a searcher copying version v - 1 holds the other set's lock,
and the trainer waits only when a searcher still copies version v - 2 when version v is
published (a copy slower than two publishes). `flock` locks are released by the kernel when a
process dies, so a searcher killed mid-copy never blocks the trainer; a restarted searcher
attaches again and copies the newest set. The version still travels through Ray as before (the
searcher is offered it and copies before its next generation); the header only lets it pick the
newest whole set. `sets=1` halves the memory (one copy of the model, not two) at the price of
the trainer waiting for any copy in progress.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
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
from tba.policy.model import as_numpy, published_state

SETS = 2  # the double buffer


class CannotAttach(Exception):
    """This process cannot map the trainer's buckets (another machine, another GPU, another
    model); the message says why."""


@dataclass(frozen=True)
class Entry:
    """Where one published tensor lies: `numel` elements of the `dtype` bucket from `offset`;
    `alias_of` names the entry whose memory it shares (then it takes no room of its own)."""

    name: str
    dtype: str  # e.g. "bfloat16"
    offset: int
    shape: tuple[int, ...]
    alias_of: str | None = None

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def _memory_key(tensor: torch.Tensor) -> tuple:
    return (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape),
            tuple(tensor.stride()), tensor.dtype)  # fmt: skip


def plan(state: dict[str, torch.Tensor]) -> tuple[list[Entry], dict[str, int]]:
    """The manifest of `state` (in its order) and each bucket's size in elements, by dtype."""
    entries: list[Entry] = []
    sizes: dict[str, int] = {}
    first_name: dict[tuple, str] = {}
    for name, tensor in state.items():
        key = _memory_key(tensor)
        dtype = _dtype_name(tensor.dtype)
        if key in first_name:
            entries.append(Entry(name, dtype, -1, tuple(tensor.shape), alias_of=first_name[key]))
            continue
        first_name[key] = name
        offset = sizes.get(dtype, 0)
        entries.append(Entry(name, dtype, offset, tuple(tensor.shape)))
        sizes[dtype] = offset + tensor.numel()
    return entries, sizes


def bucket_views(buckets: dict[str, torch.Tensor], entries: list[Entry]) -> dict[str, torch.Tensor]:
    """Each entry's tensor as a view of its bucket (an alias: its original's view)."""
    views: dict[str, torch.Tensor] = {}
    for entry in entries:
        if entry.alias_of is not None:
            views[entry.name] = views[entry.alias_of]
        else:
            flat = buckets[entry.dtype][entry.offset : entry.offset + entry.numel]
            views[entry.name] = flat.view(entry.shape)
    return views


def pack(state: dict[str, torch.Tensor], buckets: dict[str, torch.Tensor],
         entries: list[Entry]) -> None:  # fmt: skip
    """Copy `state` into `buckets` as `entries` lay it out (aliases once)."""
    views = bucket_views(buckets, entries)
    originals = [e.name for e in entries if e.alias_of is None]
    copy_into([views[name] for name in originals], [state[name] for name in originals])


def unpack(buckets: dict[str, torch.Tensor], entries: list[Entry]) -> dict[str, torch.Tensor]:
    """The published tensors, as copies out of `buckets` (an alias's copy is its original's)."""
    views = bucket_views(buckets, entries)
    copies: dict[str, torch.Tensor] = {}
    for entry in entries:
        source = entry.alias_of or entry.name
        if source not in copies:
            copies[source] = views[source].clone()
        copies[entry.name] = copies[source]
    return copies


def check_layout(entries: list[Entry], target: dict[str, torch.Tensor]) -> None:
    """`CannotAttach` unless the model whose `published_state` is `target` has the tensors the
    manifest describes (names, dtypes, shapes)."""
    mine = {name: (_dtype_name(t.dtype), tuple(t.shape)) for name, t in target.items()}
    theirs = {e.name: (e.dtype, e.shape) for e in entries}
    if mine != theirs:
        differ = sorted(set(mine.items()) ^ set(theirs.items()))[:3]
        raise CannotAttach(f"the searcher's model is laid out unlike the trainer's: {differ}")


Pairs = tuple[list[torch.Tensor], list[torch.Tensor]]


def copy_pairs(entries: list[Entry], target: dict[str, torch.Tensor],
               buckets: dict[str, torch.Tensor]) -> Pairs:  # fmt: skip
    """(a model's tensors, the bucket views they copy from): what `copy_into` takes to load a
    version into the model. An alias is copied only where the model does not already share the
    memory of its original (tied embeddings)."""
    views = bucket_views(buckets, entries)
    targets, sources = [], []
    for entry in entries:
        tied = entry.alias_of is not None and (
            _memory_key(target[entry.name]) == _memory_key(target[entry.alias_of]))
        if not tied:
            targets.append(target[entry.name])
            sources.append(views[entry.name])
    return targets, sources


def copy_into(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """targets[i] <- sources[i]; one fused call where they share a device."""
    if not targets:
        return
    with torch.no_grad():
        devices = {t.device for t in targets} | {s.device for s in sources}
        if len(devices) == 1:
            torch._foreach_copy_(targets, sources)
        else:
            for target, source in zip(targets, sources):
                target.copy_(source, non_blocking=True)
        for device in devices:
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # done before the lock is let go


def _boot_id() -> str:
    with contextlib.suppress(OSError):
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    return ""


def _gpu_uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def _share_cpu(tensor: torch.Tensor) -> tuple:
    """A handle another process on this machine maps `tensor`'s memory with."""
    manager, filename, nbytes = tensor.untyped_storage()._share_filename_cpu_()
    return ("cpu", manager, filename, nbytes, _dtype_name(tensor.dtype), tensor.numel())


def _map(handle: tuple, device: torch.device | None) -> torch.Tensor:
    """The tensor a `_share_cpu` or CUDA handle names, in this process (`device`: the local
    CUDA device that is the trainer's GPU)."""
    if handle[0] == "cpu":
        _, manager, filename, nbytes, dtype, numel = handle
        storage = rebuild_storage_filename(torch.UntypedStorage, manager, filename, nbytes)
        return torch.empty(0, dtype=_dtype(dtype)).set_(storage, 0, (numel,), (1,))
    args = list(handle[1])
    args[6] = device.index  # the trainer's GPU as this process numbers it
    return rebuild_cuda_tensor(*args)


def _lock(fd: int, exclusive: bool, timeout_s: float | None = None) -> float:
    """Take `fd`'s lock (waiting at most `timeout_s`, then TimeoutError); the seconds waited."""
    start = time.perf_counter()
    mode = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
    if timeout_s is None:
        fcntl.flock(fd, mode)
        return time.perf_counter() - start
    while True:
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
            return time.perf_counter() - start
        except BlockingIOError:
            if time.perf_counter() - start > timeout_s:
                raise TimeoutError(f"a searcher has been copying the weights for over "
                                   f"{timeout_s:g} s: it is stuck") from None  # fmt: skip
            time.sleep(0.001)


class WeightBuckets:
    """The trainer's side: `sets` bucket sets of its model's published tensors, on the model's
    device, written by `publish`; `handles()` is what a searcher attaches with."""

    def __init__(self, model: torch.nn.Module, *, node: str | None = None,
                 sets: int = SETS) -> None:  # fmt: skip
        self.model = model
        state = published_state(model)
        self.entries, sizes = plan(state)
        self.names = [e.name for e in self.entries if e.alias_of is None]
        self.device = next(iter(state.values())).device
        self.node = node
        self.nbytes = sum(n * _dtype(d).itemsize for d, n in sizes.items())
        self.sets = [
            {dtype: torch.empty(n, dtype=_dtype(dtype), device=self.device)
             for dtype, n in sizes.items()}
            for _ in range(sets)
        ]  # fmt: skip
        # [set] -> (version, step) of what it holds; -1: nothing yet.
        self.header = torch.full((sets, 2), -1, dtype=torch.int64)
        self._header_handle = _share_cpu(self.header)
        if self.device.type == "cpu":
            self._handles = [{d: _share_cpu(t) for d, t in s.items()} for s in self.sets]
        else:
            self._handles = [{d: ("cuda", reduce_tensor(t)[1]) for d, t in s.items()}
                             for s in self.sets]  # fmt: skip
        self.lock_dir = Path(tempfile.mkdtemp(prefix="tba-weights-"))
        self.lock_paths = [str(self.lock_dir / f"set{i}.lock") for i in range(sets)]
        self._fds = [os.open(path, os.O_RDWR | os.O_CREAT, 0o600) for path in self.lock_paths]
        # Per set, the bucket views the published tensors are copied into; the model's tensors
        # themselves are found again only when its parameters were replaced (finding them takes
        # longer than copying them: 0.14 s with PEFT's adapters on a 0.5B model).
        self._views = [[bucket_views(s, self.entries)[n] for n in self.names] for s in self.sets]
        self._sources = [state[name] for name in self.names]
        self._pointers = self._parameter_pointers()
        self.version = -1
        self.step = -1
        self.waited_s = 0.0  # for searchers still copying the set being written, all publishes

    def _parameter_pointers(self) -> tuple[int, ...]:
        return tuple(p.data_ptr() for p in self.model.parameters())

    def _tensors(self) -> list[torch.Tensor]:
        """The model's tensors to publish (those of `published_state`, in manifest order)."""
        pointers = self._parameter_pointers()
        if pointers != self._pointers:  # parameters replaced, not updated in place
            state = published_state(self.model)
            self._sources, self._pointers = [state[name] for name in self.names], pointers
        return self._sources

    def publish(self, version: int, step: int, timeout_s: float | None = None) -> float:
        """The model as it is now, as `version` (published at optimizer step `step`), into set
        `version % sets`; returns the seconds it took (waiting for a reader included: at most
        `timeout_s`, then TimeoutError)."""
        start = time.perf_counter()
        index = version % len(self.sets)
        fd = self._fds[index]
        self.waited_s += _lock(fd, exclusive=True, timeout_s=timeout_s)
        try:
            copy_into(self._views[index], self._tensors())  # synchronised before the lock goes
            self.header[index, 0], self.header[index, 1] = version, step
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
        self.version, self.step = version, step
        return time.perf_counter() - start

    @contextlib.contextmanager
    def newest_set(self) -> Iterator[tuple[int, int, dict[str, torch.Tensor]]]:
        """(version, step, buckets) of the newest published set, under its shared lock, for a
        reader in this process (the broadcast to searchers elsewhere, a numpy copy): a lock file
        opened for the purpose, so that it conflicts with the trainer's own."""
        index = self.version % len(self.sets)
        fd = os.open(self.lock_paths[index], os.O_RDWR)
        try:
            _lock(fd, exclusive=False)
            version, step = (int(x) for x in self.header[index])  # authoritative under the lock
            yield version, step, self.sets[index]
        finally:
            os.close(fd)  # which lets go of the lock

    def latest_numpy(self) -> tuple[int, int, dict[str, np.ndarray]]:
        """The newest published version as `get_weights` gives it (for a searcher that cannot
        attach): (version, step, weights)."""
        with self.newest_set() as (version, step, buckets):
            tensors = unpack(buckets, self.entries)
        return version, step, as_numpy(tensors)

    def handles(self) -> dict[str, Any]:
        """What a searcher process attaches with (`BucketReader`): small and picklable."""
        return {
            "node": self.node,
            "host": socket.gethostname(),
            "boot_id": _boot_id(),
            "device": self.device.type,
            "gpu_uuid": _gpu_uuid(self.device) if self.device.type == "cuda" else None,
            "entries": [(e.name, e.dtype, e.offset, e.shape, e.alias_of) for e in self.entries],
            "sets": self._handles,
            "header": self._header_handle,
            "locks": self.lock_paths,
        }

    def close(self) -> None:
        for fd in self._fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds = []
        shutil.rmtree(self.lock_dir, ignore_errors=True)


class BucketReader:
    """A searcher's side: the trainer's buckets mapped into this process, and `copy_newest`
    into its model."""

    def __init__(self, handles: dict[str, Any], model: torch.nn.Module, node: str | None) -> None:
        """Map the buckets for `model` (the searcher's), or raise `CannotAttach` saying why."""
        if handles["node"] is not None and node is not None and handles["node"] != node:
            raise CannotAttach("the searcher runs on another Ray node than the trainer")
        if handles["host"] != socket.gethostname() or handles["boot_id"] != _boot_id():
            raise CannotAttach("the searcher runs on another machine than the trainer")
        self.entries = [Entry(n, d, o, tuple(s), a) for n, d, o, s, a in handles["entries"]]
        target = published_state(model)
        check_layout(self.entries, target)
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

    @staticmethod
    def _local_gpu(uuid: str, device: torch.device) -> torch.device:
        """This process's number of the trainer's GPU, which the searcher's model must be on."""
        if device.type != "cuda":
            raise CannotAttach("the trainer's buckets are on a GPU and the searcher on a "
                               f"{device.type}")  # fmt: skip
        if _gpu_uuid(device) != uuid:
            raise CannotAttach("the searcher runs on another GPU than the trainer")
        return device

    def newest(self) -> tuple[int, int]:
        """(version, step) of the newest whole set, read without a lock: a hint."""
        versions = [(int(v), int(s)) for v, s in self.header.tolist()]
        return max(versions)

    def copy_newest(self, newer_than: int) -> tuple[int, int] | None:
        """Copy the newest published version into the model if it is newer than `newer_than`:
        (version, step) copied, or None. Under the set's shared lock, so that the trainer does
        not write it meanwhile."""
        versions = self.header[:, 0].tolist()
        index = int(np.argmax(versions))
        if versions[index] <= newer_than:
            return None
        fd = self._fds[index]
        _lock(fd, exclusive=False)
        try:
            version, step = (int(x) for x in self.header[index])  # authoritative under the lock
            if version <= newer_than:
                return None
            targets, sources = self._pairs[index]
            copy_into(targets, sources)
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
        return version, step

    def close(self) -> None:
        for fd in self._fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds = []
