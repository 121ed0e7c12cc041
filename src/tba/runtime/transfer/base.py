"""A weight transport: how a version of the trainer's weights reaches the searcher processes.

A transport is two classes: a `Sender` on the trainer's side, which makes the trainer's weights
available as a new version (`publish(version, step)`), and a `Receiver` in each searcher process,
which copies the newest version into the searcher's model (`receive(model, newer_than, offer)`).
Ray carries the rest: once, the sender's `handles()` (what a receiver attaches with: a manifest,
a shared-memory name, an address), and at every publish an `Offer` (the version, the optimizer
step it was published at, and each transport's small `payload` for it, such as an object-store
reference).

A receiver that cannot work where its searcher runs (another machine, another GPU, a model laid
out differently) refuses to attach with `CannotAttach`, saying why; one that breaks later (its
link died) sets `error`. What happens then, the fallback from one transport to the next, is
`tba.runtime.transfer.chain`'s, in one place.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from tba.runtime.transfer.buckets import BucketCache
from tba.trainer import WeightVersions


class CannotAttach(Exception):
    """This searcher process cannot use a transport (another machine, another GPU, another
    model); the message says why."""


class CannotSend(Exception):
    """The trainer's side of a transport cannot be set up here (too little shared memory, no
    trainer module in this process); the message says why and what to do."""


@dataclass(frozen=True)
class SenderPlace:
    """Where a sender runs: what it may need of its surroundings."""

    node: str | None  # the Ray node of the trainer's process
    host: str  # the address Ray uses for this node: where a sender that listens binds
    timeout_s: float  # a peer that does not answer within this many seconds has failed
    buckets: BucketCache  # the trainer's weight buckets, made once for every transport
    put: Any = None  # Ray's `put` (the object store's transport)


@dataclass(frozen=True)
class ReceiverPlace:
    """Where a receiver runs: its searcher's Ray node, the address Ray uses for that node, and a
    name unique to its process."""

    node: str | None
    host: str | None
    name: str
    timeout_s: float


@dataclass(frozen=True)
class Offer:
    """What a searcher is told at a publish: the version, the optimizer step it was published
    at, each transport's payload for it (by transport name; the object store's: a reference),
    the digest of the published weights (`tba.runtime.transfer.digest`), and, until the searcher
    has attached a receiver, the transports to try (`Candidate`s, in order)."""

    version: int
    step: int
    payloads: dict[str, Any] = field(default_factory=dict)
    digest: str | None = None
    candidates: tuple[Candidate, ...] | None = None


@dataclass(frozen=True)
class Candidate:
    """A transport a searcher may attach to: its name, its receiver class (sent by reference,
    so a transport registered in another module travels too) and its sender's handles."""

    name: str
    receiver: type[Receiver]
    handles: Any


class Sender(ABC):
    """The trainer's side of a transport. `publish` is called right after the trainer bumped its
    version (`WeightVersions.publish`), so the trainer's weights as they are then are that
    version."""

    name: ClassVar[str]  # what `searchers.weight_transfer.type` calls it
    receiver: ClassVar[type[Receiver]]  # its other side
    # Whether it reads the trainer's module itself (the trainer in this process), rather than
    # the weights a sharded trainer gathers (`WeightVersions.weights`).
    needs_trainer_module: ClassVar[bool] = False

    def __init__(self, settings: Any, trainer: WeightVersions, place: SenderPlace) -> None:
        self.settings, self.trainer, self.place = settings, trainer, place

    @abstractmethod
    def publish(self, version: int, step: int) -> Any:
        """Make the trainer's weights, as they are now, available as `version` (published at
        optimizer step `step`); the payload a receiver needs with this version (small and
        picklable), or None."""

    def handles(self) -> Any:
        """What a receiver attaches with, once (small and picklable)."""
        return None

    def take_lost(self) -> list[tuple[str, str]]:
        """(receiver, why) for each receiver whose link broke since the last call."""
        return []

    def close(self) -> None:  # noqa: B027 - most senders hold nothing to release
        """Release what the sender holds (memory, sockets, threads)."""


class Receiver(ABC):
    """A searcher's side of a transport."""

    name: ClassVar[str]
    # Set once the receiver can no longer deliver (its link broke): the searcher falls back.
    error: str | None = None

    @classmethod
    @abstractmethod
    def attach(cls, handles: Any, model: torch.nn.Module, place: ReceiverPlace) -> Receiver:
        """A receiver for `model` (the searcher's copy of the policy), from its sender's
        `handles`; `CannotAttach` where it cannot work here, saying why."""

    @abstractmethod
    def receive(
        self, model: torch.nn.Module, newer_than: int, offer: Offer | None, *, wait: bool = False
    ) -> tuple[int, int] | None:
        """Copy into `model` the newest version newer than `newer_than`: (version, step) copied,
        or None when there is none. `offer`: the newest one the trainer offered (None: none
        since the last call); `wait`: wait for the version offered if it is still on its way
        (at most the place's timeout, then TimeoutError)."""

    def close(self) -> None:  # noqa: B027 - most receivers hold nothing to release
        """Release what the receiver holds."""
