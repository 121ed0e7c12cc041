"""Which transport each searcher takes the weights by, and the fallback rule, in one place.

The transports to try come from `searchers.weight_transfer`: `auto`'s `order` (shared, broadcast,
object store), or the one asked for. The rule:

1. A transport the trainer cannot serve here is left out, and said once (a `weight_transfer`
   event with `path` and `why`): a trainer whose ranks are Ray actors has no module in this
   process to share; shared memory too small to hold the buckets (`CannotSend`). Asked for
   alone, it is one line instead (`ConfigError`).
2. A searcher is offered the first transport it has not refused, made on the trainer's side
   when a searcher first needs it (the broadcast group, only once a searcher cannot map the
   shared buckets); with `auto`, the object store's copy comes with it meanwhile.
3. A searcher that cannot use what it is offered (`CannotAttach`: another machine, another GPU)
   says why, and is offered the next one.
4. A searcher whose transport breaks later (a broadcast group whose link died) falls back to the
   object store, whatever was asked for: a run that can go on does.

Which way each searcher took is said once per way (`weight_transfer` events), as the searchers
report it. Every publish also records the digest of the version published, which each searcher
reports back for the version it generates with (`digest`): a transport that does not deliver
what it was given is a `weight_digest_mismatch` event, and repeated, a stop naming it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from tba.config import ConfigError
from tba.config.transfer import TRANSFER_SETTINGS, TransferSettings
from tba.core import EventLogger
from tba.errors import SearcherError
from tba.runtime.transfer.base import (
    Candidate,
    CannotAttach,
    CannotSend,
    Offer,
    Receiver,
    ReceiverPlace,
    Sender,
    SenderPlace,
)
from tba.runtime.transfer.digest import Fingerprint
from tba.runtime.transfer.object_store import NAME as OBJECT_STORE
from tba.runtime.transfer.object_store import ObjectStoreReceiver, ObjectStoreSender
from tba.trainer import WeightVersions

# A searcher whose weights differ from the version published this many reports in a row stops
# the run: once can be a report racing a publish it has not taken yet; three cannot.
MAX_DIGEST_MISMATCHES = 3
DIGESTS_KEPT = 16  # published versions whose digest a late report can still be checked against


@dataclass
class _Path:
    """One searcher process's way to the weights, as its reports tell it."""

    using: str | None = None  # the transport its receiver is attached to
    why: str = ""  # why that one (the reason it could not use the ones before)
    declined: dict[str, str] = field(default_factory=dict)  # transport -> why it cannot use it
    said: str | None = None  # the way last said in an event
    mismatches: int = 0  # digest mismatches in a row


class TransferChain:
    """The run's senders and every searcher's way to the weights: `publish` a version through
    every transport in use, `offer` it to one searcher as that searcher takes it, and learn from
    each searcher's `report` which way it took."""

    def __init__(self, settings: TransferSettings, trainer: WeightVersions, place: SenderPlace,
                 transports: dict[str, type[Sender]], log_event: EventLogger,
                 *, local: bool) -> None:  # fmt: skip
        """`transports`: the registry; `local`: the searchers can all map shared memory on this
        machine (a local Ray instance, and a trainer on a CPU), so that a searcher that has not
        reported yet needs no copy through the object store meanwhile."""
        self.settings, self.trainer, self.place = settings, trainer, place
        self.log_event, self.local = log_event, local
        self.payloads: dict[str, Any] = {}  # each transport's payload for the newest version
        self._said: set[str] = set()  # the ways said in events
        self.auto = settings.type == "auto"
        order = list(getattr(settings, "order", [settings.type]))
        self.transports = {name: transports[name] for name in order}
        if OBJECT_STORE not in self.transports:  # the way of last resort (rule 4)
            self.transports[OBJECT_STORE] = transports[OBJECT_STORE]
        self.order = order
        self.senders: dict[str, Sender] = {}
        self.unavailable: dict[str, str] = {}  # transport -> why the trainer cannot serve it
        self.paths: dict[int, _Path] = {}
        self.version, self.step = 0, 0
        self.digests: dict[int, str] = {}
        self.fingerprint: Fingerprint | None = None
        for name in order:
            if self.transports[name].needs_trainer_module and not trainer.trains_here:
                self._leave_out(name, "the trainer's ranks are Ray actors")

    # ---------------------------------------------------------------------- the trainer's side

    def publish(self, version: int, step: int) -> None:
        """The trainer's weights as they are now, as `version`, through every transport that
        searchers use or may use (the first of the order that the trainer can serve is opened
        at the first publish, others as searchers need them)."""
        if not self.senders:
            self._open_first()
        self.version, self.step = version, step
        store = self.senders.get(OBJECT_STORE)
        if isinstance(store, ObjectStoreSender):
            store.wanted = any(self._wants_copy(path) for path in self.paths.values())
        self.payloads = {name: sender.publish(version, step)
                         for name, sender in self.senders.items()}  # fmt: skip
        self._record_digest(version)
        for name, sender in self.senders.items():
            for searcher, why in sender.take_lost():
                self.log_event(f"weight_{name}_lost", searcher=searcher, reason=why)

    def _open_first(self) -> None:
        """The first transport of the order the trainer can serve, and the object store."""
        for name in self.order:
            if name not in self.unavailable and self._open(name) is not None:
                break
        self._open(OBJECT_STORE)
        if set(self.senders) == {OBJECT_STORE} and OBJECT_STORE not in self.order:
            raise ConfigError(self._alone_line())

    def _open(self, name: str) -> Sender | None:
        """The sender of `name`, made now if need be; None where the trainer cannot serve it."""
        if name in self.senders or name in self.unavailable:
            return self.senders.get(name)
        settings = self.settings if name == self.settings.type else TRANSFER_SETTINGS[name]()
        try:
            self.senders[name] = self.transports[name](settings, self.trainer, self.place)
        except CannotSend as why:
            if not self.auto and name == self.settings.type:
                raise ConfigError(f"searchers.weight_transfer={name}: {why}") from None
            self._leave_out(name, str(why))
            return None
        if name == OBJECT_STORE and self.trainer.trains_here:
            # A copy on demand, from the buckets another transport (shared, broadcast) holds.
            sets = self.place.buckets.sets
            self.senders[name].source = sets.latest_numpy if sets is not None else None
        return self.senders[name]

    def _leave_out(self, name: str, why: str) -> None:
        if not self.auto and name == self.settings.type:
            raise ConfigError(self._alone_line(why))
        self.unavailable[name] = why
        if name != OBJECT_STORE:
            self.log_event("weight_transfer_unavailable", path=name, why=why)

    def _alone_line(self, why: str = "") -> str:
        name = self.settings.type
        reason = why or self.unavailable.get(name, "it cannot be served here")
        return (f"searchers.weight_transfer={name} needs the trainer in this process "
                f"(trainer.world_size=1): {reason}" if "ranks" in reason
                else f"searchers.weight_transfer={name}: {reason}")  # fmt: skip

    def _record_digest(self, version: int) -> None:
        if self.fingerprint is None:
            self.fingerprint = Fingerprint(self.trainer.model)
        sets = self.place.buckets.sets
        if sets is not None and sets.version == version:
            with sets.newest_set() as (_, _, buckets):
                self.digests[version] = self.fingerprint.of_buckets(buckets)
        else:
            self.digests[version] = self.fingerprint()
        self.digests.pop(version - DIGESTS_KEPT, None)

    # ------------------------------------------------------------------- each searcher's side

    def new_searcher(self, searcher: int) -> None:
        """A new searcher process in this position (a start, or a restart): its way is unknown."""
        self.paths[searcher] = _Path()

    def offer(self, searcher: int) -> Offer:
        """The newest version as this searcher takes it: with the transports to try until it
        has taken one it stays with, and the object store's copy where it may need one."""
        path = self.paths.setdefault(searcher, _Path())
        candidates = self._candidates(path)
        payloads = dict(self.payloads)
        store = self.senders.get(OBJECT_STORE)
        if isinstance(store, ObjectStoreSender) and self._wants_copy(path):
            payloads[OBJECT_STORE] = store.payload()
        return Offer(self.version, self.step, payloads, self.digests.get(self.version),
                     candidates)  # fmt: skip

    def _candidates(self, path: _Path) -> tuple[Candidate, ...] | None:
        """Rule 2: the first transport of the order this searcher has not refused (made now if
        need be), before the one it uses; with `auto`, the object store too while it has
        none."""
        for name in self.order:
            if name == path.using:
                return None
            if name in path.declined or self._open(name) is None:
                continue
            offered = [name]
            if path.using is None and OBJECT_STORE in self.order and name != OBJECT_STORE:
                offered.append(OBJECT_STORE)
            return tuple(Candidate(n, self.transports[n].receiver, self.senders[n].handles())
                         for n in offered)  # fmt: skip
        return None

    def _wants_copy(self, path: _Path) -> bool:
        """Whether this searcher takes the object store's copy: it uses it, or (with `auto`, off
        this machine's shared memory) has not said yet and may have to."""
        undecided = path.using is None and OBJECT_STORE in self.order and not self.local
        return path.using == OBJECT_STORE or undecided

    def report(self, searcher: int, report: dict[str, Any]) -> None:
        """What a searcher said of its way to the weights (`transfer`, `transfer_why`,
        `transfer_declined`) and of the weights it holds (`version`, `digest`)."""
        path = self.paths.setdefault(searcher, _Path())
        path.declined |= report.get("transfer_declined") or {}
        if report.get("transfer"):
            path.using, path.why = report["transfer"], report.get("transfer_why") or ""
        if path.using is not None and path.using != path.said and self._candidates(path) is None:
            path.said = path.using
            self._say(searcher, path)
        self._check_digest(searcher, path, report.get("version"), report.get("digest"))

    def _say(self, searcher: int, path: _Path) -> None:
        """Which way weights reach the searchers: said once per way."""
        if path.using in self._said:
            return
        self._said.add(path.using)
        why = path.why or self._default_why(path.using)
        self.log_event("weight_transfer", path=path.using, why=why, searcher=searcher)

    def _default_why(self, name: str) -> str:
        """Why a searcher takes `name` when it said nothing of its own: what the trainer could
        not serve before it in the order, what was asked for, or where the buckets are."""
        before = self.order[: self.order.index(name)] if name in self.order else self.order
        left_out = [f"{n}: {self.unavailable[n]}" for n in before if n in self.unavailable]
        if left_out:
            return "; ".join(left_out)
        if not self.auto and name == self.settings.type:
            return f"searchers.weight_transfer={name}"
        sets = self.place.buckets.sets
        return f"buckets on the trainer's {sets.device}" if sets is not None else ""

    def _check_digest(self, searcher: int, path: _Path, version: int | None,
                      digest: str | None) -> None:  # fmt: skip
        """A searcher's weights against the version it says they are."""
        expected = self.digests.get(version) if version is not None else None
        if digest is None or expected is None:
            return
        if digest == expected:
            path.mismatches = 0
            return
        path.mismatches += 1
        transport = path.using or "unknown"
        self.log_event("weight_digest_mismatch", searcher=searcher, version=version,
                       transport=transport, expected=expected, got=digest)  # fmt: skip
        if path.mismatches >= MAX_DIGEST_MISMATCHES:
            raise SearcherError(
                f"searcher {searcher} generates with weights that are not those the trainer "
                f"published as version {version} ({path.mismatches} reports in a row): the "
                f"{transport!r} transport does not deliver them (searchers.weight_transfer)"
            )

    def close(self) -> None:
        for sender in self.senders.values():
            sender.close()
        self.place.buckets.close()


class Receiving:
    """A searcher's end of the chain: it attaches the first transport offered that it can use
    (rule 3), falls back to the object store when that one breaks (rule 4), copies each newer
    version into the model, and keeps the digest of what the model holds."""

    def __init__(self, model: torch.nn.Module, place: ReceiverPlace) -> None:
        self.model, self.place = model, place
        self.receiver: Receiver | None = None
        self.using: str | None = None
        self.why = ""  # why it uses that one: what it could not use before
        self.declined: dict[str, str] = {}
        self.fingerprint = Fingerprint(model)
        self.digest: str | None = None  # of the version the model holds (None: the base)

    def attach(self, candidates: tuple[Candidate, ...]) -> None:
        """The first of `candidates` this process can use, in place of the one it has (kept
        where it comes first: offers repeat until the trainer reads this searcher's report)."""
        for candidate in candidates:
            if candidate.name == self.using:
                return
            if candidate.name in self.declined:
                continue
            try:
                receiver = candidate.receiver.attach(candidate.handles, self.model, self.place)
            except CannotAttach as why:
                self.declined[candidate.name] = str(why)
                continue
            if self.receiver is not None:
                self.receiver.close()
            self.receiver, self.using = receiver, candidate.name
            break
        self.why = "; ".join(self.declined.values())

    def receive(self, newer_than: int, offer: Offer | None, *, wait: bool = False,
                exact: bool = False) -> tuple[int, int] | None:  # fmt: skip
        """The newest version newer than `newer_than` copied into the model ((version, step)),
        or None. `wait`: for the version offered, if it is on its way; `exact`: it must come
        (synchronous mode), else RuntimeError. A transport that breaks meanwhile is replaced by
        the object store, which delivers the version once the trainer offers its copy."""
        if self.receiver is None:
            if offer is None or offer.version <= newer_than:
                return None
            raise RuntimeError(f"version {offer.version} was offered only by ways this searcher "
                               f"cannot use ({self.why or 'none offered'})")
        try:
            copied = self.receiver.receive(self.model, newer_than, offer, wait=wait or exact)
        except RuntimeError:
            if self.receiver.error is None:
                raise
            copied = None
        if self.receiver.error is not None:
            self._fall_back(self.receiver.error)
            copied = self.receiver.receive(self.model, newer_than, offer)
        if copied is not None:
            self.digest = self.fingerprint()
        elif exact and offer is not None and offer.version > newer_than:
            raise RuntimeError(f"version {offer.version} did not come by {self.using}"
                               + (f" ({self.why})" if self.why else ""))
        return copied

    def _fall_back(self, why: str) -> None:
        self.declined[self.using or "?"] = why
        self.receiver.close()
        self.receiver = ObjectStoreReceiver.attach(None, self.model, self.place)
        self.using, self.why = OBJECT_STORE, why

    def report(self) -> dict[str, Any]:
        """What the trainer's chain learns from this searcher (`TransferChain.report`)."""
        return {"transfer": self.using, "transfer_why": self.why,
                "transfer_declined": dict(self.declined), "digest": self.digest}  # fmt: skip

    def close(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
