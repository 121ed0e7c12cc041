"""Which transport each searcher takes, and the fallback rule (`tba.runtime.transfer.chain`),
without Ray: the trainer's chain and searchers' `Receiving` ends in this process, the object store
stood in for by a dictionary. Also the digest check, a transport registered from outside the
package, a small /dev/shm, and what the broadcast group listens on."""

from __future__ import annotations

import itertools
import socket
import threading

import numpy as np
import psutil
import pytest
import torch

from tba.config import ConfigError, load_config
from tba.config.transfer import TRANSFER_SETTINGS, TransferSettings
from tba.errors import SearcherError
from tba.policy.model import get_weights
from tba.runtime.transfer import (
    TRANSPORTS,
    Offer,
    Receiver,
    ReceiverPlace,
    Receiving,
    Sender,
    SenderPlace,
    open_chain,
    register_transport,
)
from tba.runtime.transfer import shared as shared_module
from tba.runtime.transfer.broadcast import RECEIVER_THREAD
from tba.runtime.transfer.buckets import BucketCache
from tba.runtime.transfer.digest import Fingerprint
from tba.runtime.transfer.object_store import ObjectStoreReceiver

STORE: dict[int, object] = {}  # the object store's stand-in: reference -> value
_refs = itertools.count()


def put(value: object) -> int:
    ref = next(_refs)
    STORE[ref] = value
    return ref


@pytest.fixture(autouse=True)
def object_store(monkeypatch):
    """`ray.get` of a reference from `put`."""
    import ray

    monkeypatch.setattr(ray, "get", lambda ref, timeout=None: STORE[ref])
    yield
    STORE.clear()


class Held:
    """A trainer's stand-in: its module in this process, and its version counter."""

    trains_here = True

    def __init__(self, model: torch.nn.Module) -> None:
        self.model, self.version, self.step_count = model, 0, 0

    def publish(self) -> tuple[int, int]:
        self.version += 1
        self.step_count += 1
        return self.version, self.step_count

    def weights(self) -> dict[str, np.ndarray]:
        return get_weights(self.model)


def perturb(model: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.01)


def chain_for(model, transfer: str | dict = "auto", *, local: bool = True, node: str = "n0"):
    events: list[tuple[str, dict]] = []
    config = load_config(None, [f"searchers.weight_transfer={transfer}"])
    place = SenderPlace(node=node, host="127.0.0.1", timeout_s=30, buckets=BucketCache(),
                        put=put)  # fmt: skip
    trainer = Held(model)
    chain = open_chain(config.searchers.weight_transfer, trainer, place,
                       lambda kind, **fields: events.append((kind, fields)), local=local)
    return chain, trainer, events


class Searcher:
    """A searcher's end, driven as the actor drives it: take the offer, report."""

    def __init__(self, model, node: str = "n0", name: str = "s0") -> None:
        self.model, self.version = model, 0
        self.receiving = Receiving(model, ReceiverPlace(node, "127.0.0.1", name, 30))

    def take(self, offer: Offer, wait: bool = True) -> None:
        if offer.candidates:
            self.receiving.attach(offer.candidates)
        copied = self.receiving.receive(self.version, offer, wait=wait)
        if copied is not None:
            self.version = copied[0]

    def report(self) -> dict:
        return {"version": self.version, **self.receiving.report()}


def round_trip(chain, trainer, searchers: dict[int, Searcher], rounds: int = 2) -> None:
    """Publish `rounds` versions; each searcher takes each offer and reports twice (offers
    repeat until the chain has read a report)."""
    for _ in range(rounds):
        perturb(trainer.model, trainer.version + 1)
        chain.publish(*trainer.publish())
        for i, searcher in searchers.items():
            for _ in range(2):
                searcher.take(chain.offer(i))
                chain.report(i, searcher.report())


def join_receiver_threads() -> None:
    for thread in threading.enumerate():
        if thread.name.startswith(RECEIVER_THREAD):
            thread.join(timeout=30)


def same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    wa, wb = get_weights(a), get_weights(b)
    return all(np.array_equal(wa[n], wb[n]) for n in wa)


def test_auto_on_one_machine_maps_the_buckets_and_makes_no_broadcast_group(tiny_model):
    chain, trainer, events = chain_for(tiny_model)
    searcher = Searcher(type(tiny_model)(tiny_model.config))
    chain.new_searcher(0)
    try:
        round_trip(chain, trainer, {0: searcher})
        assert searcher.receiving.using == "shared" and same(searcher.model, tiny_model)
        assert "broadcast" not in chain.senders  # nobody needed a group: no socket
        assert chain.payloads.get("object_store") is None  # and no copy in the object store
        assert [(k, f["path"]) for k, f in events] == [("weight_transfer", "shared")]
    finally:
        chain.close()


def test_a_searcher_that_cannot_map_the_buckets_is_offered_the_broadcast_then_joins_it(
    tiny_model
):
    """It takes the object store's copy meanwhile (on one machine, none comes until it says it
    needs one); the group is made when it needs it."""
    chain, trainer, events = chain_for(tiny_model)
    searcher = Searcher(type(tiny_model)(tiny_model.config), node="elsewhere")
    chain.new_searcher(0)
    try:
        perturb(tiny_model, 1)
        chain.publish(*trainer.publish())
        assert "broadcast" not in chain.senders
        searcher.take(chain.offer(0))
        assert searcher.receiving.using == "object_store" and searcher.version == 0
        chain.report(0, searcher.report())
        assert "broadcast" in chain.senders and events == []  # not settled: not said yet
        assert chain.offer(0).payloads["object_store"] is not None  # a copy, now it needs one
        round_trip(chain, trainer, {0: searcher})
        assert searcher.receiving.using == "broadcast" and same(searcher.model, tiny_model)
        [(kind, fields)] = events
        assert (kind, fields["path"]) == ("weight_transfer", "broadcast")
        assert "another Ray node" in fields["why"]
    finally:
        join_receiver_threads()
        chain.close()


def test_too_little_shared_memory_falls_back_with_one_line_or_refuses_shared_alone(
    tiny_model, monkeypatch
):
    monkeypatch.setattr(shared_module, "shm_too_small", lambda needed: "no room")
    chain, trainer, events = chain_for(tiny_model)
    searcher = Searcher(type(tiny_model)(tiny_model.config))
    chain.new_searcher(0)
    try:
        round_trip(chain, trainer, {0: searcher})
        assert searcher.receiving.using == "broadcast" and same(searcher.model, tiny_model)
        unavailable = [f for kind, f in events if kind == "weight_transfer_unavailable"]
        assert unavailable == [{"path": "shared", "why": f"no room: {shared_module.SHM_ADVICE}"}]
        assert "--shm-size" in unavailable[0]["why"]
    finally:
        join_receiver_threads()
        chain.close()
    chain, trainer, _ = chain_for(tiny_model, "shared")
    with pytest.raises(ConfigError, match=r"^searchers.weight_transfer=shared: no room: .*shm"):
        chain.publish(*trainer.publish())


def test_explicit_broadcast_whose_group_breaks_falls_back_to_the_object_store(tiny_model):
    chain, trainer, events = chain_for(tiny_model, "broadcast")
    searcher = Searcher(type(tiny_model)(tiny_model.config))
    chain.new_searcher(0)
    try:
        round_trip(chain, trainer, {0: searcher})
        assert searcher.receiving.using == "broadcast"
        searcher.receiving.receiver.error = "the trainer's broadcast group: link died"
        round_trip(chain, trainer, {0: searcher})
        assert searcher.receiving.using == "object_store" and same(searcher.model, tiny_model)
        assert [f["path"] for k, f in events if k == "weight_transfer"] == ["broadcast",
                                                                             "object_store"]
    finally:
        join_receiver_threads()
        chain.close()


class Corrupting(ObjectStoreReceiver):
    """Delivers every version with one tensor not loaded: the adapters that never arrive."""

    name = "corrupting"

    def receive(self, model, newer_than, offer, *, wait=False):
        if offer is None or offer.version <= newer_than:
            return None
        return offer.version, offer.step  # nothing copied


class CorruptingSender(Sender):
    name = "corrupting"
    receiver = Corrupting

    def publish(self, version: int, step: int) -> None:
        return None


class CorruptingSettings(TransferSettings):
    type: str = "corrupting"


def test_a_transport_that_does_not_deliver_is_an_event_then_a_stop_naming_it(tiny_model):
    register_transport(CorruptingSender, CorruptingSettings)
    try:
        chain, trainer, events = chain_for(tiny_model, "corrupting")
        searcher = Searcher(type(tiny_model)(tiny_model.config))
        chain.new_searcher(0)
        perturb(tiny_model, 1)
        chain.publish(*trainer.publish())
        searcher.take(chain.offer(0))
        chain.report(0, searcher.report())
        assert [k for k, _ in events].count("weight_digest_mismatch") == 1
        with pytest.raises(SearcherError, match="'corrupting' transport does not deliver"):
            for _ in range(2):
                chain.report(0, searcher.report())
        assert [k for k, _ in events].count("weight_digest_mismatch") == 3
    finally:
        TRANSPORTS.pop("corrupting")
        TRANSFER_SETTINGS.pop("corrupting")


def test_the_digest_is_the_same_from_the_model_and_from_its_buckets_and_cheap(tiny_model):
    """And it changes with any weight that moves."""
    chain, trainer, _ = chain_for(tiny_model)
    try:
        chain.publish(*trainer.publish())
        fingerprint = Fingerprint(tiny_model)
        assert chain.digests[1] == fingerprint()
        perturb(tiny_model, 5)
        assert fingerprint() != chain.digests[1]
    finally:
        chain.close()


def listening_addresses(pid: int) -> set[str]:
    return {c.laddr.ip for c in psutil.Process(pid).net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN}  # fmt: skip


def test_the_broadcast_group_listens_on_the_address_ray_gives_alone(tiny_model):
    """Its store, and gloo's own connections: 127.0.0.1 here, not every interface."""
    import os

    before = listening_addresses(os.getpid())
    chain, trainer, _ = chain_for(tiny_model, "broadcast")
    searcher = Searcher(type(tiny_model)(tiny_model.config))
    chain.new_searcher(0)
    try:
        round_trip(chain, trainer, {0: searcher})
        assert searcher.receiving.using == "broadcast"
        opened = listening_addresses(os.getpid()) - before
        assert opened and all(ip == "127.0.0.1" for ip in opened), opened
        with socket.socket() as client:  # the store itself answers on loopback
            client.connect(("127.0.0.1", chain.senders["broadcast"].store.port))
    finally:
        join_receiver_threads()
        chain.close()


def test_a_transport_needs_the_trainer_here_unless_auto_leaves_it_out(tiny_model):
    chain, trainer, _ = chain_for(tiny_model)
    trainer.trains_here = False
    with pytest.raises(ConfigError, match="needs the trainer in this process"):
        open_chain(load_config(None, ["searchers.weight_transfer=shared"]).searchers
                   .weight_transfer, trainer, chain.place, lambda *a, **k: None, local=True)
    auto = open_chain(TRANSFER_SETTINGS["auto"](), trainer, chain.place, lambda *a, **k: None,
                      local=True)  # fmt: skip
    assert set(auto.unavailable) == {"shared", "broadcast"}


def test_receiving_attaches_once_and_keeps_what_it_uses(tiny_model):
    """Offers repeat their candidates until the trainer reads a report: the receiver stays."""
    model = type(tiny_model)(tiny_model.config)
    receiving = Receiving(model, ReceiverPlace(None, None, "s0", 5))

    class Counting(Receiver):
        name = "counting"
        made = 0

        @classmethod
        def attach(cls, handles, model, place):
            cls.made += 1
            return cls()

        def receive(self, model, newer_than, offer, *, wait=False):
            return None

    from tba.runtime.transfer import Candidate

    for _ in range(3):
        receiving.attach((Candidate("counting", Counting, None),))
    assert Counting.made == 1 and receiving.using == "counting"


@pytest.mark.slow
def test_the_digest_benchmark_runs_on_tiny_shapes():
    from benchmarks.digest import main

    rows = main(["--small", "--repeats", "3", "--device", "cpu"])
    assert [r["model"] for r in rows] == ["built-in policy", "narrow shape"]
    assert all(r["publish_s"] > 0 and r["trainer_s"] > 0 and r["searcher_s"] > 0 for r in rows)
