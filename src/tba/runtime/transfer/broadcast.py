"""A broadcast group: the trainer's weight buckets (`tba.runtime.transfer.buckets`) sent by a
`torch.distributed` broadcast, NCCL between GPUs and gloo otherwise, to searchers that cannot map
them (another GPU, another machine), while Ray carries only the version.

**One small group per searcher process.** The trainer (`BroadcastSender`) serves a `TCPStore`,
created when the first searcher needs it and bound to the address Ray uses for the trainer's node
(127.0.0.1 on a local instance; on a cluster, the node's address, which every node reaches: see
docs/cluster.md for what that exposes). A searcher (`BroadcastReceiver`) registers under a name of
its own (searcher, incarnation, process) and forms a two-process group with the trainer: the
trainer is rank 0, the searcher rank 1. A group per searcher, rather than one for all, is what
keeps the others going when one dies or joins: a collective waits for every member, so a dead
member would stall everyone, and a member joining late would need everyone to form a new group.
Here a dead searcher breaks only its own group (its socket closes; the trainer's thread for it
ends and the sender lists it as lost), and a replacement forms a new one and is sent the newest
version at once. The price is that the trainer sends each version once per such searcher rather
than once in all (a tree broadcast would not be): fine for the few searchers a trainer feeds
across machines.

**Nothing blocks the trainer's step.** Each group has a thread on the trainer that, whenever a
newer version is published, holds the newest bucket set under its shared lock (the trainer then
writes the other set, as for a searcher copying from shared memory) and broadcasts a header
(version, step) and then each bucket. A searcher's thread receives into staging buckets of its
own — the header first, outside its lock (it waits there between versions), then the buckets
under the lock — and the searcher copies the newest whole staged version into its model between
two generations (`receive`), so no generation mixes two versions. A slow link delays only its own
searcher, and the trainer's publish only when a version is still on the wire two publishes later
(as a slow copy does with shared buckets).
"""

from __future__ import annotations

import datetime
import json
import socket
import threading
from typing import Any

import torch
import torch.distributed as dist

from tba.errors import first_line
from tba.policy.model import published_state
from tba.runtime.transfer.base import (
    CannotAttach,
    Offer,
    Receiver,
    ReceiverPlace,
    Sender,
    SenderPlace,
)
from tba.runtime.transfer.buckets import (
    LayoutMismatch,
    bucket_sizes,
    check_layout,
    copy_into,
    copy_pairs,
    manifest,
    read_manifest,
    to_dtype,
)

NAME = "broadcast"
# A group's operations wait this long: between two versions a searcher waits in a receive for as
# long as the trainer takes to publish again, which can be minutes; a dead peer is noticed at
# once anyway, by its closed socket.
GROUP_TIMEOUT = datetime.timedelta(days=1)
POLL_S = 0.1  # how often the trainer looks for searchers joining
RECEIVER_THREAD = "broadcast receiver"  # how a receiver's thread is named, then its name


def _group(store: dist.Store, rank: int, backend: str, host: str) -> dist.ProcessGroup:
    """A two-process group (the trainer is rank 0) on `store`, outside any default group; gloo's
    own connections on `host`'s interface."""
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = GROUP_TIMEOUT
        return dist.ProcessGroupNCCL(store, rank, 2, options)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = GROUP_TIMEOUT
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    return dist.ProcessGroupGloo(store, rank, 2, options)


def _broadcast(group: dist.ProcessGroup, tensors: list[torch.Tensor]) -> None:
    """Rank 0's `tensors` into rank 1's, in order, as bytes (any dtype, bf16 included)."""
    options = dist.BroadcastOptions()
    options.rootRank = 0
    for tensor in tensors:
        group.broadcast([tensor.view(torch.uint8)], options).wait()
    for device in {t.device for t in tensors if t.device.type == "cuda"}:
        torch.cuda.synchronize(device)  # received (or sent) before the lock goes


def _bucket_order(buckets: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    return [buckets[dtype] for dtype in sorted(buckets)]


def listening_store(host: str, timeout: datetime.timedelta) -> dist.TCPStore:
    """A `TCPStore` server that listens on `host`'s interface alone (by default it listens on
    every interface), on a free port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.bind((host, 0))
        listener.listen(128)
        port = listener.getsockname()[1]
    except OSError:
        listener.close()
        raise
    # The store owns the socket from here on (it closes it): `detach`, not `fileno`.
    return dist.TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=timeout,
                         master_listen_fd=listener.detach())  # fmt: skip


class BroadcastReceiver(Receiver):
    """Joins the trainer's group as the place's name, receives every version it is sent into
    staging buckets in a thread of its own, and copies the newest into the model on request
    (`receive`, between two generations)."""

    name = NAME

    def __init__(self, handles: dict[str, Any], model: torch.nn.Module,
                 place: ReceiverPlace) -> None:  # fmt: skip
        """Check `model` against the trainer's manifest (`CannotAttach` saying why) and start
        joining; a failure to join shows as `error`."""
        self.entries = read_manifest(handles["entries"])
        target = published_state(model)
        try:
            check_layout(self.entries, target)
        except LayoutMismatch as error:
            raise CannotAttach(str(error)) from None
        device = next(iter(target.values())).device
        # NCCL where both ends are GPUs; gloo otherwise (it reads and writes GPU tensors too).
        both_gpus = device.type == "cuda" and handles["device"] == "cuda"
        self.backend = "nccl" if both_gpus and dist.is_nccl_available() else "gloo"
        self._on_wire = device if self.backend == "nccl" else torch.device("cpu")
        self._staging = {d: torch.empty(n, dtype=to_dtype(d), device=self._on_wire)
                         for d, n in bucket_sizes(self.entries).items()}  # fmt: skip
        self._pairs = copy_pairs(self.entries, target, self._staging)
        self.place = place
        self.join_timeout_s = min(handles.get("join_timeout_s", place.timeout_s), place.timeout_s)
        self.staged = (-1, -1)  # (version, step) of the whole version in staging
        self.joined = threading.Event()
        self._staged = threading.Condition()  # held while staging is written or read
        self._thread = threading.Thread(target=self._receive, args=(handles,), daemon=True,
                                        name=f"{RECEIVER_THREAD} {place.name}")  # fmt: skip
        self._thread.start()

    @classmethod
    def attach(cls, handles: Any, model: torch.nn.Module,
               place: ReceiverPlace) -> BroadcastReceiver:  # fmt: skip
        return cls(handles, model, place)

    def _receive(self, handles: dict[str, Any]) -> None:
        try:
            timeout = datetime.timedelta(seconds=self.join_timeout_s)
            store = dist.TCPStore(handles["host"], handles["port"], is_master=False,
                                  timeout=timeout)  # fmt: skip
            number = store.add("joined", 1)
            store.set(f"join/{number}", json.dumps({"name": self.place.name,
                                                    "backend": self.backend}))  # fmt: skip
            group = _group(dist.PrefixStore(self.place.name, store), 1, self.backend,
                           self.place.host or handles["host"])  # fmt: skip
            self.joined.set()
            header = torch.empty(2, dtype=torch.int64, device=self._on_wire)
            while True:
                _broadcast(group, [header])  # waits here until the trainer publishes again
                with self._staged:
                    _broadcast(group, _bucket_order(self._staging))
                    self.staged = (int(header[0]), int(header[1]))
                    self._staged.notify_all()
        except Exception as error:  # cannot join, or the trainer went: the searcher falls back
            with self._staged:
                self.error = f"the trainer's broadcast group: {first_line(error)}"
                self._staged.notify_all()

    def receive(
        self, model: torch.nn.Module, newer_than: int, offer: Offer | None, *, wait: bool = False
    ) -> tuple[int, int] | None:
        """The newest staged version, if newer than `newer_than`. With `wait`, first wait (at
        most the place's timeout, then TimeoutError; RuntimeError, with `error` set, if the group
        failed or is not even joined by then) until the version offered or a newer one is
        staged."""
        timeout_s = self.place.timeout_s
        with self._staged:
            if wait and offer is not None and offer.version > newer_than:
                arrived = self._staged.wait_for(
                    lambda: self.staged[0] >= offer.version or self.error is not None, timeout_s)
                if self.error is not None:
                    raise RuntimeError(self.error)
                if not arrived and not self.joined.is_set():
                    # Still joining (a TCPStore retries until its own, longer, timeout): as
                    # good as a failed group to a caller that cannot wait longer.
                    self.error = (f"the trainer's broadcast group: not joined within "
                                  f"{timeout_s:g} s")  # fmt: skip
                    raise RuntimeError(self.error)
                if not arrived:
                    raise TimeoutError(f"version {offer.version} has not arrived through the "
                                       f"trainer's broadcast group in {timeout_s:g} s")  # fmt: skip
            version, step = self.staged
            if version <= newer_than:
                return None
            copy_into(*self._pairs)
        return version, step


class BroadcastSender(Sender):
    """A store searchers join at, and a thread per joined searcher that sends it every newer
    version of the trainer's buckets."""

    name = NAME
    receiver = BroadcastReceiver
    needs_trainer_module = True

    def __init__(self, settings: Any, trainer: Any, place: SenderPlace) -> None:
        super().__init__(settings, trainer, place)
        self.buckets = place.buckets.get(trainer.model)
        self.join_timeout = datetime.timedelta(seconds=settings.join_timeout_s or place.timeout_s)
        self.store = listening_store(place.host, self.join_timeout)
        self.sent: dict[str, int] = {}  # searcher name -> the newest version sent to it
        self.lost: list[tuple[str, str]] = []  # (searcher name, why), to be reported
        self._new_version = threading.Condition()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._listener = threading.Thread(target=self._listen, daemon=True)
        self._listener.start()

    def publish(self, version: int, step: int) -> None:
        if self.buckets.version < version:  # not written by another transport already
            self.buckets.publish(version, step, timeout_s=self.place.timeout_s)
        with self._new_version:
            self._new_version.notify_all()

    def handles(self) -> dict[str, Any]:
        """What a searcher joins with: small and picklable."""
        return {"host": self.place.host, "port": self.store.port,
                "join_timeout_s": self.join_timeout.total_seconds(),
                "device": self.buckets.device.type,
                "entries": manifest(self.buckets.entries)}  # fmt: skip

    def take_lost(self) -> list[tuple[str, str]]:
        lost, self.lost = self.lost, []
        return lost

    def _listen(self) -> None:
        """Start a sender for every searcher that registers (a counter and a record each)."""
        seen = 0
        while not self._stop.is_set():
            joined = int(self.store.add("joined", 0))
            while seen < joined:
                seen += 1
                record = json.loads(self.store.get(f"join/{seen}"))
                thread = threading.Thread(target=self._serve, args=(record,), daemon=True)
                thread.start()
                self._threads.append(thread)
            self._stop.wait(POLL_S)

    def _serve(self, record: dict[str, str]) -> None:
        """Form the group with one searcher, then send it the newest version whenever there is a
        newer one, until it or the sender goes."""
        name = record["name"]
        try:
            device = self.buckets.device
            if record["backend"] == "nccl":
                torch.cuda.set_device(device)
            group = _group(dist.PrefixStore(name, self.store), 0, record["backend"],
                           self.place.host)  # fmt: skip
            sent = -1
            while not self._stop.is_set():
                if not self._newer_than(sent):
                    continue
                with self.buckets.newest_set() as (version, step, buckets):
                    on_wire = device if record["backend"] == "nccl" else torch.device("cpu")
                    header = torch.tensor([version, step], dtype=torch.int64, device=on_wire)
                    _broadcast(group, [header, *_bucket_order(buckets)])
                sent = self.sent[name] = version
        except Exception as error:  # its process died, or the link broke: only its group ends
            if not self._stop.is_set():
                self.lost.append((name, first_line(error)))

    def _newer_than(self, sent: int) -> bool:
        """Wait (a while) for a version newer than `sent`; whether there is one to send."""
        with self._new_version:
            self._new_version.wait_for(
                lambda: self._stop.is_set() or self.buckets.version > sent, timeout=1.0)
        return not self._stop.is_set() and self.buckets.version > sent

    def close(self) -> None:
        self._stop.set()
        with self._new_version:
            self._new_version.notify_all()
        self._listener.join(timeout=5)
