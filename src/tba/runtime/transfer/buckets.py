"""The trainer's weights as flat per-dtype buckets, double-buffered under reader/writer locks: what
the shared-memory and the broadcast transports hand to searchers (`shared`, `broadcast`).

**Buckets.** Everything a searcher needs (`tba.policy.model.published_state`: every weight, or
with LoRA only the adapters) is packed into one contiguous tensor per dtype on the trainer's
device (bf16 stays bf16; LoRA's fp32 adapters on a bf16 base go in an fp32 bucket), described by a
manifest of (name, dtype, offset, shape). A tensor that another name shares (tied embeddings)
travels once, its other names listed as aliases. A publish is a copy of the model into a bucket
(`torch._foreach_copy_`: a device copy on a GPU) and a new version number; the model's tensors
are found once, and again only when its parameters were replaced rather than updated in place.

**Versions: a double buffer under reader/writer locks.** There are two bucket sets; version v
is written into set v % 2. Each set has a lock file, taken with `flock`: exclusively by the
trainer while it writes the set and then stamps the set's header (version, step, in a small
tensor), shared by a reader while it copies the set (a searcher into its model, the broadcast
onto the wire). A reader picks the set with the newest version, takes its shared lock, reads the
header again (authoritative under the lock) and copies, so it always copies one whole version and
knows which: no generation ever mixes two versions (a searcher changes its model only between
generations). The trainer writes the set a reader is *not* reading: a reader copying version
v - 1 holds the other set's lock, and the trainer waits only when a reader still copies version
v - 2 when version v is published (a copy slower than two publishes). `flock` locks are released
by the kernel when a process dies, so a searcher killed mid-copy never blocks the trainer.
`sets=1` halves the memory (one copy of the model, not two) at the price of the trainer waiting
for any copy in progress.

The lock files live in a directory of the trainer process (`tba-weights-<pid>-*` in the system's
temporary directory), removed when the buckets close; one left by a process that was killed is
removed by the next run that makes buckets on the machine.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from tba.policy.model import as_numpy, published_state

SETS = 2  # the double buffer
LOCK_DIR_PREFIX = "tba-weights-"


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


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def to_dtype(name: str) -> torch.dtype:
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
        dtype = dtype_name(tensor.dtype)
        if key in first_name:
            entries.append(Entry(name, dtype, -1, tuple(tensor.shape), alias_of=first_name[key]))
            continue
        first_name[key] = name
        offset = sizes.get(dtype, 0)
        entries.append(Entry(name, dtype, offset, tuple(tensor.shape)))
        sizes[dtype] = offset + tensor.numel()
    return entries, sizes


def published_nbytes(model: torch.nn.Module) -> int:
    """The bytes of one bucket set of `model`'s published tensors."""
    _, sizes = plan(published_state(model))
    return sum(numel * to_dtype(dtype).itemsize for dtype, numel in sizes.items())


def bucket_sizes(entries: list[Entry]) -> dict[str, int]:
    """Each bucket's size in elements, by dtype, from a manifest."""
    sizes: dict[str, int] = {}
    for entry in entries:
        if entry.alias_of is None:
            sizes[entry.dtype] = max(sizes.get(entry.dtype, 0), entry.offset + entry.numel)
    return sizes


def manifest(entries: list[Entry]) -> list[tuple]:
    """A manifest as plain tuples: small and picklable, for a receiver in another process."""
    return [(e.name, e.dtype, e.offset, e.shape, e.alias_of) for e in entries]


def read_manifest(rows: list[tuple]) -> list[Entry]:
    return [Entry(name, dtype, offset, tuple(shape), alias) for name, dtype, offset, shape, alias
            in rows]  # fmt: skip


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


class LayoutMismatch(Exception):
    """A model whose published tensors are not those a manifest describes."""


def check_layout(entries: list[Entry], target: dict[str, torch.Tensor]) -> None:
    """`LayoutMismatch` unless the model whose `published_state` is `target` has the tensors the
    manifest describes (names, dtypes, shapes)."""
    mine = {name: (dtype_name(t.dtype), tuple(t.shape)) for name, t in target.items()}
    theirs = {e.name: (e.dtype, e.shape) for e in entries}
    if mine != theirs:
        differ = sorted(set(mine.items()) ^ set(theirs.items()))[:3]
        raise LayoutMismatch(f"the searcher's model is laid out unlike the trainer's: {differ}")


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


def lock(fd: int, exclusive: bool, timeout_s: float | None = None) -> float:
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


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_stale_lock_dirs(root: Path | None = None) -> None:
    """Lock directories of trainer processes that are gone (killed before they could remove
    their own)."""
    root = Path(root or tempfile.gettempdir())
    pattern = re.compile(rf"^{LOCK_DIR_PREFIX}(\d+)-")
    for path in root.glob(f"{LOCK_DIR_PREFIX}*"):
        match = pattern.match(path.name)
        if match and not _process_alive(int(match.group(1))):
            shutil.rmtree(path, ignore_errors=True)


class BucketSets:
    """`sets` bucket sets of a model's published tensors, on the model's device, written by
    `publish` and read under their locks (`newest_set`; in another process, through the lock
    files `lock_paths`). `make_bucket(dtype, numel)` allocates each bucket (the shared-memory
    transport allocates them where other processes can map them)."""

    def __init__(self, model: torch.nn.Module, *, sets: int = SETS,
                 make_bucket=None) -> None:  # fmt: skip
        self.model = model
        state = published_state(model)
        self.entries, sizes = plan(state)
        self.names = [e.name for e in self.entries if e.alias_of is None]
        self.device = next(iter(state.values())).device
        self.nbytes = sum(n * to_dtype(d).itemsize for d, n in sizes.items())
        allocate = make_bucket or (lambda dtype, n: torch.empty(n, dtype=dtype,
                                                                 device=self.device))
        self.sets = [{dtype: allocate(to_dtype(dtype), n) for dtype, n in sizes.items()}
                     for _ in range(sets)]  # fmt: skip
        # [set] -> (version, step) of what it holds; -1: nothing yet.
        self.header = torch.full((sets, 2), -1, dtype=torch.int64)
        remove_stale_lock_dirs()
        self.lock_dir = Path(tempfile.mkdtemp(prefix=f"{LOCK_DIR_PREFIX}{os.getpid()}-"))
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
        self.waited_s = 0.0  # for readers still copying the set being written, all publishes

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
        self.waited_s += lock(fd, exclusive=True, timeout_s=timeout_s)
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
            lock(fd, exclusive=False)
            version, step = (int(x) for x in self.header[index])  # authoritative under the lock
            yield version, step, self.sets[index]
        finally:
            os.close(fd)  # which lets go of the lock

    def latest_numpy(self) -> tuple[int, int, dict[str, np.ndarray]]:
        """The newest published version as `get_weights` gives it: (version, step, weights)."""
        with self.newest_set() as (version, step, buckets):
            tensors = unpack(buckets, self.entries)
        return version, step, as_numpy(tensors)

    def close(self) -> None:
        for fd in self._fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds = []
        shutil.rmtree(self.lock_dir, ignore_errors=True)


class BucketCache:
    """The trainer's bucket sets, made by the first transport that needs them and read by the
    others: the sets in shared memory that searchers on the machine map are also what the
    broadcast sends, so the model is copied once a publish, not once per transport."""

    def __init__(self) -> None:
        self.sets: BucketSets | None = None

    def get(self, model: torch.nn.Module, *, sets: int = SETS, make_bucket=None) -> BucketSets:
        if self.sets is None:
            self.sets = BucketSets(model, sets=sets, make_bucket=make_bucket)
        return self.sets

    def close(self) -> None:
        if self.sets is not None:
            self.sets.close()
