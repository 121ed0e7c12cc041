"""The weight transports (`tba.runtime.transfer`): shared buckets and their broadcast (over gloo
here), packing bit-exact, LoRA's adapters alone, one whole version per generation, a searcher
joining late or dying, and (slow, with Ray) searcher actors that hold the trainer's weights after
every publish, sample what those weights sample, and get them again after a restart."""

from __future__ import annotations

import fcntl
import multiprocessing
import threading
import time

import numpy as np
import pytest
import torch

from tba.config import LoraConfig, RunConfig, load_config
from tba.config.transfer import BroadcastTransfer, SharedTransfer
from tba.errors import RunError
from tba.policy.model import add_lora, get_weights, published_state, set_weights
from tba.runtime.transfer import (
    Candidate,
    CannotAttach,
    Offer,
    ReceiverPlace,
    SenderPlace,
)
from tba.runtime.transfer.broadcast import RECEIVER_THREAD, BroadcastReceiver, BroadcastSender
from tba.runtime.transfer.buckets import (
    BucketCache,
    BucketSets,
    bucket_views,
    pack,
    plan,
    unpack,
)
from tba.runtime.transfer.shared import SharedReceiver, SharedSender


def searcher_config() -> RunConfig:
    """What a searcher process here reads: 2-token responses of the float32 tiny policy."""
    return load_config(None, ["policy.max_new_tokens=2", "policy.dtype=float32"])


def always_one(prompts, completions, **columns):
    return [1.0] * len(completions)


def perturb(model: torch.nn.Module, seed: int) -> None:
    """Change every trainable weight, as an optimizer step would (in place)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.requires_grad:
                noise = torch.randn(param.shape, generator=generator) * 0.01
                param.add_(noise.to(param.dtype))


def assert_same_weights(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and np.array_equal(a[name], b[name]), name


class Held:
    """A trainer's stand-in for the senders: its module, in this process."""

    trains_here = True

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def weights(self) -> dict[str, np.ndarray]:
        return get_weights(self.model)


def sender_place(node: str | None = None) -> SenderPlace:
    return SenderPlace(node=node, host="127.0.0.1", timeout_s=30, buckets=BucketCache())


def receiver_place(name: str = "s0", node: str | None = None, timeout_s: float = 30):
    return ReceiverPlace(node=node, host="127.0.0.1", name=name, timeout_s=timeout_s)


def shared_sender(model: torch.nn.Module, node: str | None = None, sets: int = 2):
    return SharedSender(SharedTransfer(sets=sets), Held(model), sender_place(node))


def broadcast_sender(model: torch.nn.Module) -> BroadcastSender:
    return BroadcastSender(BroadcastTransfer(), Held(model), sender_place())


def close(sender) -> None:
    sender.close()
    sender.place.buckets.close()


# ------------------------------------------------------------------------ packing, without Ray


def test_pack_and_unpack_are_bit_exact_per_dtype_and_tied_tensors_travel_once():
    generator = torch.Generator().manual_seed(0)
    shared = torch.randn(5, 3, generator=generator)
    state = {
        "a": torch.randn(4, 6, generator=generator),
        "b": torch.randn(7, generator=generator).to(torch.bfloat16),
        "c": torch.randn(3, 2, generator=generator).t(),  # not contiguous
        "tied_1": shared,
        "d": torch.tensor([1e-40, -0.0, float("inf"), float("nan")]).to(torch.bfloat16),
        "tied_2": shared,
    }
    entries, sizes = plan(state)
    assert sizes == {"float32": 24 + 6 + 15, "bfloat16": 7 + 4}  # tied_2 takes no room
    assert [e.alias_of for e in entries] == [None] * 5 + ["tied_1"]
    buckets = {d: torch.empty(n, dtype=getattr(torch, d)) for d, n in sizes.items()}
    pack(state, buckets, entries)
    out = unpack(buckets, entries)
    assert out.keys() == state.keys()
    for name, tensor in state.items():
        assert out[name].dtype == tensor.dtype and out[name].shape == tensor.shape
        # Bit for bit (NaN included): compare the integer views.
        bits = torch.int16 if tensor.dtype == torch.bfloat16 else torch.int32
        assert torch.equal(out[name].contiguous().view(bits), tensor.contiguous().view(bits))
    assert out["tied_1"] is out["tied_2"]
    views = bucket_views(buckets, entries)
    assert views["b"].dtype == torch.bfloat16  # bf16 stays bf16: no fp32 round trip


def test_searcher_copies_each_publish_bit_exact_through_shared_buckets(tiny_model):
    trainer_model = tiny_model
    searcher_model = type(tiny_model)(tiny_model.config).eval()
    sender = shared_sender(trainer_model)
    buckets = sender.sets
    try:
        assert buckets.device.type == "cpu" and len(buckets.sets) == 2
        # Tied embeddings travel once: the buckets hold each distinct tensor once.
        distinct = {p.data_ptr(): p.numel() for p in trainer_model.state_dict().values()}
        assert buckets.nbytes == 4 * sum(distinct.values())
        reader = SharedReceiver.attach(sender.handles(), searcher_model, receiver_place())
        assert reader.receive(searcher_model, 0, None) is None  # nothing published yet
        for version in (1, 2, 3):
            perturb(trainer_model, seed=version)
            sender.publish(version, step=10 * version)
            assert reader.receive(searcher_model, version - 1, None) == (version, 10 * version)
            assert_same_weights(get_weights(searcher_model), get_weights(trainer_model))
            assert reader.receive(searcher_model, version, None) is None
        # A parameter replaced (not updated in place) is found again.
        norm = trainer_model.model.norm
        norm.weight = torch.nn.Parameter(torch.full_like(norm.weight, 3.0))
        sender.publish(4, step=40)
        assert reader.receive(searcher_model, 3, None) == (4, 40)
        assert torch.equal(searcher_model.model.norm.weight, norm.weight)
        # The buckets' numpy copy is the newest version, as `get_weights` gives it.
        version, step, weights = buckets.latest_numpy()
        assert (version, step) == (4, 40)
        assert_same_weights(weights, get_weights(trainer_model))
        reader.close()
    finally:
        close(sender)


def test_bf16_weights_travel_as_bf16(tiny_model):
    trainer_model = tiny_model.to(torch.bfloat16)
    searcher_model = type(tiny_model)(tiny_model.config).to(torch.bfloat16).eval()
    sender = shared_sender(trainer_model)
    try:
        assert {e.dtype for e in sender.sets.entries} == {"bfloat16"}
        reader = SharedReceiver.attach(sender.handles(), searcher_model, receiver_place())
        perturb(trainer_model, seed=1)
        sender.publish(1, step=1)
        assert reader.receive(searcher_model, 0, None) == (1, 1)
        assert_same_weights(get_weights(searcher_model), get_weights(trainer_model))
    finally:
        close(sender)


def test_with_lora_only_the_adapters_travel(tiny_model):
    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    trainer_model = add_lora(tiny_model, lora)
    searcher_model = add_lora(type(tiny_model)(tiny_model.config).eval(), lora)
    sender = shared_sender(trainer_model)
    try:
        names = [e.name for e in sender.sets.entries]
        assert names and all(".lora_A." in n or ".lora_B." in n for n in names)
        assert names == list(published_state(trainer_model))
        adapters = sum(p.numel() for n, p in trainer_model.named_parameters() if "lora_" in n)
        assert sender.sets.nbytes == 4 * adapters  # fp32 adapters, nothing of the base
        reader = SharedReceiver.attach(sender.handles(), searcher_model, receiver_place())
        perturb(trainer_model, seed=3)  # only the adapters are trainable
        sender.publish(1, step=1)
        assert reader.receive(searcher_model, 0, None) == (1, 1)
        assert_same_weights(get_weights(searcher_model), get_weights(trainer_model))
    finally:
        close(sender)


def test_a_searcher_that_cannot_map_the_buckets_says_why(tiny_model, tokenizer):
    sender = shared_sender(tiny_model, node="trainer-node")
    try:
        with pytest.raises(CannotAttach, match="another Ray node"):
            SharedReceiver.attach(sender.handles(), tiny_model, receiver_place(node="other-node"))
        handles = sender.handles() | {"boot_id": "another boot"}
        with pytest.raises(CannotAttach, match="another machine"):
            SharedReceiver.attach(handles, tiny_model, receiver_place(node="trainer-node"))
        other = type(tiny_model)(tiny_model.config.__class__(
            **(tiny_model.config.to_dict() | {"num_hidden_layers": 1})))  # fmt: skip
        with pytest.raises(CannotAttach, match="laid out unlike"):
            SharedReceiver.attach(sender.handles(), other, receiver_place(node="trainer-node"))
    finally:
        close(sender)


def publish_then_set(buckets: BucketSets, version: int, done: threading.Event) -> None:
    buckets.publish(version, step=version)
    done.set()


def test_the_trainer_never_writes_a_set_a_searcher_is_copying(tiny_model):
    """With one set, a publish waits for the searcher's copy in progress (its shared lock); with
    the double buffer it writes the other set and does not wait."""
    searcher_model = type(tiny_model)(tiny_model.config).eval()
    for sets, waits in ((1, True), (2, False)):
        sender = shared_sender(tiny_model, sets=sets)
        buckets = sender.sets
        try:
            reader = SharedReceiver.attach(sender.handles(), searcher_model, receiver_place())
            buckets.publish(1, step=1)
            # A copy in progress: the searcher holds the lock of version 1's set.
            fcntl.flock(reader._fds[1 % sets], fcntl.LOCK_SH)
            done = threading.Event()
            thread = threading.Thread(target=publish_then_set, args=(buckets, 2, done))
            thread.start()
            assert done.wait(0.5) is not waits
            if waits:  # a searcher stuck mid-copy fails the publish instead of hanging it
                with pytest.raises(TimeoutError, match="stuck"):
                    buckets.publish(3, step=3, timeout_s=0.1)
            fcntl.flock(reader._fds[1 % sets], fcntl.LOCK_UN)
            thread.join(5)
            assert done.is_set() and buckets.version == 2
            reader.close()
        finally:
            close(sender)


def test_a_publish_during_a_generation_never_mixes_versions(tmp_path, tiny_model, tokenizer):
    """A searcher (the actor's loop, in this process) whose slow generations check, before and
    after, that their weights are one whole published version; the trainer publishes all the
    while, every version a weight pattern of its own."""
    from tba.runtime.ray_actor import SearcherActor

    tiny_model.save_pretrained(tmp_path / "policy")
    tokenizer.save_pretrained(tmp_path / "policy")
    worker = SearcherActor(
        str(tmp_path / "policy"), [{"prompt": "Q\n"}], [always_one], searcher_config(),
        searcher_id=0, seed=0, device="cpu", num_threads=1, weights_timeout_s=5,
    )  # fmt: skip
    trainer_model = tiny_model

    def stamp(version: int) -> None:  # every weight of version v holds v: a torn copy shows
        with torch.no_grad():
            for param in trainer_model.parameters():
                param.fill_(float(version))

    def held(model) -> set[float]:
        return {float(v) for p in model.parameters() for v in p.detach().unique()}

    seen: list[tuple[int, set[float], set[float]]] = []

    def slow_generate(num_prompts):
        before = held(worker.searcher.policy)
        time.sleep(0.02)  # a publish lands meanwhile
        seen.append((worker.searcher.version, before, held(worker.searcher.policy)))
        return [], {"reward_dropped": 0, "reward_unscored": 0, "gen_tokens": 0,
                    "gen_seconds": 0.02, "dropped": 0, "truncated_frac": 0.0, "generated": 0}

    worker.searcher.generate = slow_generate
    sender = shared_sender(trainer_model)
    try:
        stamp(1)
        sender.publish(1, step=1)
        candidates = (Candidate("shared", SharedReceiver, sender.handles()),)
        worker.start(1, 100, Offer(1, 1, candidates=candidates))
        for version in range(2, 60):
            stamp(version)
            sender.publish(version, step=version)
            time.sleep(0.003)
        deadline = time.time() + 10
        while len(seen) < 20 and time.time() < deadline:
            time.sleep(0.01)
        assert worker.collect()["transfer"] == "shared"
    finally:
        worker.stop()
        close(sender)
    assert len(seen) >= 20
    assert all(before == after == {float(version)} for version, before, after in seen), seen
    assert len({version for version, _, _ in seen}) > 3  # it did adopt new versions meanwhile


def test_an_offer_only_through_buckets_it_cannot_map_fails_clearly(tmp_path, tiny_model,
                                                                   tokenizer):  # fmt: skip
    from tba.runtime.ray_actor import SearcherActor

    tiny_model.save_pretrained(tmp_path / "policy")
    tokenizer.save_pretrained(tmp_path / "policy")
    worker = SearcherActor(
        str(tmp_path / "policy"), [{"prompt": "Q\n"}], [always_one], searcher_config(),
        searcher_id=0, seed=0, device="cpu", num_threads=1, weights_timeout_s=5,
    )  # fmt: skip
    sender = shared_sender(tiny_model, node="trainer-node")
    worker.receiving.place = receiver_place(node="elsewhere")
    try:
        sender.publish(1, step=0)
        candidates = (Candidate("shared", SharedReceiver, sender.handles()),)
        with pytest.raises(RunError, match="cannot use.*another Ray node.*object_store"):
            worker.generate_batch(1, Offer(1, 0, candidates=candidates))
        assert worker.receiving.using is None and "shared" in worker.receiving.declined
    finally:
        close(sender)


# ---------------------------------------------------------------- the broadcast group (gloo)


def join_receiver_threads() -> None:
    """A receiver that gave up may still sit in TCPStore's own connect timeout: a daemon thread
    inside C++ code when the interpreter exits aborts it (exit 134)."""
    for thread in threading.enumerate():
        if thread.name.startswith(RECEIVER_THREAD):
            thread.join(timeout=30)


@pytest.mark.parametrize("kind", ["float32", "bfloat16", "lora"])
def test_a_searcher_in_the_broadcast_group_holds_each_publish_bit_exact(tiny_model, kind):
    searcher_model = type(tiny_model)(tiny_model.config).eval()
    trainer_model = tiny_model
    if kind == "bfloat16":
        trainer_model, searcher_model = tiny_model.bfloat16(), searcher_model.bfloat16()
    if kind == "lora":
        lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
        trainer_model, searcher_model = add_lora(tiny_model, lora), add_lora(searcher_model, lora)
    hub = broadcast_sender(trainer_model)
    buckets = hub.buckets
    try:
        receiver = BroadcastReceiver.attach(hub.handles(), searcher_model, receiver_place())
        assert receiver.joined.wait(30)
        assert receiver.receive(searcher_model, -1, None) is None  # nothing published yet
        for version in (1, 2, 3):
            perturb(trainer_model, seed=version)
            hub.publish(version, step=10 * version)
            copied = receiver.receive(searcher_model, version - 1, Offer(version, 10 * version),
                                      wait=True)  # fmt: skip
            assert copied == (version, 10 * version)
            assert_same_weights(get_weights(searcher_model), get_weights(trainer_model))
        # What travels is exactly the buckets: bf16 as bf16, with LoRA the adapters alone.
        staged = {d: t.dtype for d, t in receiver._staging.items()}
        assert staged == {d: t.dtype for d, t in buckets.sets[0].items()}
        assert sum(t.numel() * t.element_size() for t in receiver._staging.values()) \
            == buckets.nbytes  # fmt: skip
        deadline = time.time() + 10  # its thread notes what it sent after the send returns
        while hub.sent != {"s0": 3} and time.time() < deadline:
            time.sleep(0.01)
        assert hub.sent == {"s0": 3} and hub.take_lost() == []
    finally:
        close(hub)


def join_and_wait(handles, config, ready) -> None:
    """A searcher process that joins the group, says so, and waits to be killed."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(config)
    receiver = BroadcastReceiver.attach(handles, model, receiver_place("doomed"))
    receiver.receive(model, -1, Offer(1, 1), wait=True)
    ready.set()
    time.sleep(600)


def test_a_dead_searcher_stalls_no_one_and_a_late_one_gets_the_current_weights(tiny_model):
    """One searcher process joins and is killed; the trainer goes on publishing to another, and
    a searcher joining later is sent the newest version at once, with no new publish."""
    hub = broadcast_sender(tiny_model)
    context = multiprocessing.get_context("spawn")
    ready = context.Event()
    process = context.Process(target=join_and_wait, args=(hub.handles(), tiny_model.config, ready))
    try:
        hub.publish(1, step=1)
        process.start()
        live_model = type(tiny_model)(tiny_model.config).eval()
        live = BroadcastReceiver.attach(hub.handles(), live_model, receiver_place("live"))
        assert ready.wait(60)
        assert live.receive(live_model, -1, Offer(1, 1), wait=True) == (1, 1)
        process.kill()
        process.join(10)
        for version in (2, 3):
            perturb(tiny_model, seed=version)
            hub.publish(version, step=version)
            copied = live.receive(live_model, version - 1, Offer(version, version), wait=True)
            assert copied == (version, version)
        assert_same_weights(get_weights(live_model), get_weights(tiny_model))
        deadline = time.time() + 10
        while not hub.lost and time.time() < deadline:
            time.sleep(0.05)
        assert [name for name, _ in hub.take_lost()] == ["doomed"]
        late_model = type(tiny_model)(tiny_model.config).eval()
        late = BroadcastReceiver.attach(hub.handles(), late_model, receiver_place("late"))
        assert late.receive(late_model, -1, Offer(3, 3), wait=True) == (3, 3)
        assert_same_weights(get_weights(late_model), get_weights(tiny_model))
    finally:
        if process.is_alive():
            process.kill()
        close(hub)


def test_a_searcher_that_cannot_join_says_why(tiny_model):
    hub = broadcast_sender(tiny_model)
    try:
        handles = hub.handles() | {"port": 1}  # nobody serves there
        model = type(tiny_model)(tiny_model.config)
        receiver = BroadcastReceiver.attach(handles, model, receiver_place("lost", timeout_s=1))
        with pytest.raises(RuntimeError, match="the trainer's broadcast group"):
            receiver.receive(model, -1, Offer(1, 1), wait=True)
        other = type(tiny_model)(tiny_model.config.__class__(
            **(tiny_model.config.to_dict() | {"num_hidden_layers": 1})))  # fmt: skip
        with pytest.raises(CannotAttach, match="laid out unlike"):
            BroadcastReceiver.attach(hub.handles(), other, receiver_place("other", timeout_s=1))
    finally:
        join_receiver_threads()
        close(hub)


def test_a_searcher_whose_broadcast_group_fails_falls_back_to_the_object_store(
    tmp_path, tiny_model, tokenizer
):
    """Asynchronous: it says so in its reports and keeps its weights until a copy comes;
    synchronous (which must have the version offered): one line saying why."""
    from tba.runtime.ray_actor import SearcherActor

    tiny_model.save_pretrained(tmp_path / "policy")
    tokenizer.save_pretrained(tmp_path / "policy")
    hub = broadcast_sender(tiny_model)
    try:
        hub.publish(1, step=0)
        unreachable = hub.handles() | {"port": 1}
        offer = Offer(1, 0, candidates=(Candidate("broadcast", BroadcastReceiver, unreachable),))
        for exact in (False, True):
            worker = SearcherActor(
                str(tmp_path / "policy"), [{"prompt": "Q\n"}], [always_one], searcher_config(),
                searcher_id=0, seed=0, device="cpu", num_threads=1, weights_timeout_s=5,
            )  # fmt: skip
            worker.offer(offer)
            if exact:
                with pytest.raises(RunError, match="broadcast group.*object_store"):
                    worker._take_offered_weights(exact=True)
            else:
                worker._take_offered_weights()
                assert worker.searcher.version == 0  # its weights, until a copy comes
            assert worker.receiving.using == "object_store"
            assert "the trainer's broadcast group" in worker.receiving.why
    finally:
        join_receiver_threads()
        close(hub)


# ------------------------------------------------------------------------------- with Ray


@pytest.mark.slow
@pytest.mark.parametrize("transfer", ["auto", "broadcast", "object_store"])
def test_ray_searchers_hold_and_sample_the_published_weights_and_a_restart_rejoins(
    tmp_path, policy_dir, tokenizer, transfer
):
    """Two searcher actors beside a trainer: after every publish (through the shared buckets,
    which `auto` takes here, their broadcast over gloo, or the object store) each holds the
    trainer's weights bit for bit and samples exactly what a fresh searcher with those weights
    samples; one killed is replaced and gets the current weights."""
    import ray

    from tba.core import Task
    from tba.policy.model import load_policy
    from tba.runtime.ray_cluster import ray_session
    from tba.runtime.ray_pool import RaySearchers, searcher_seed
    from tba.searcher import Searcher
    from tba.trainer import Trainer, trainer_settings

    config = load_config(None, [
        "train.mode=sync", "searchers.count=2", "searchers.num_cpus=0.5", "ray.num_cpus=1",
        "train.num_prompts=2", "train.group_size=2", "policy.max_new_tokens=4",
        "searchers.max_restarts=1", f"searchers.weight_transfer={transfer}",
    ])  # fmt: skip
    shared = transfer != "object_store"  # no copy in the object store
    path = {"auto": "shared", "broadcast": "broadcast", "object_store": "object_store"}[transfer]
    def constant(prompts, completions, **columns):  # (a closure: Ray pickles it by value)
        return [1.0] * len(completions)

    rows = [{"prompt": f"Q{i}\n"} for i in range(8)]
    task = Task(name="t", train_rows=rows, eval_rows=[], reward_fns=[constant])
    events: list[tuple[str, dict]] = []
    trainer = Trainer(load_policy(str(policy_dir), "cpu"),
                      **trainer_settings(config, tokenizer.pad_token_id, None))  # fmt: skip
    # What searcher 0's first process samples, in this process, with the weights it is given.
    seed0 = searcher_seed(config.seed, 0, 0)
    local = Searcher(load_policy(str(policy_dir), "cpu"), tokenizer, rows, task.reward_fns,
                     config, searcher_id=0, seed=seed0, stream_seed=seed0)  # fmt: skip
    with ray_session(config):
        searchers = RaySearchers(config, policy_dir, task, lambda kind, **f: events.append(
            (kind, f)), trainer)  # fmt: skip
        searchers.launch()
        try:
            for publish in range(1, 4):
                perturb(trainer.model, seed=publish)
                searchers.publish(trainer)
                # A copy in the object store only where searchers take it.
                assert (searchers.transfer.payloads.get("object_store") is None) is shared
                samples, _ = searchers.generate(2)  # one prompt each
                expected = get_weights(trainer.model)
                for slot in searchers.slots:
                    version, weights = ray.get(slot.handle.weights.remote())
                    assert version == publish
                    assert_same_weights(weights, expected)
                set_weights(local.policy, expected)
                local.version = publish
                mine, _ = local.generate(1)
                theirs = [s for s in samples if s.searcher_id == 0]
                assert [s.response_ids for s in theirs] == [s.response_ids for s in mine]
                assert [s.behaviour_logp for s in theirs] == [s.behaviour_logp for s in mine]
            paths = searchers.transfer.paths
            assert [paths[i].using for i in range(2)] == [path] * 2
            assert [f["path"] for kind, f in events if kind == "weight_transfer"] == [path]
            # Kill searcher 1: the next generation replaces it, and it maps the buckets (or joins
            # the broadcast) again.
            ray.kill(searchers.slots[1].handle)
            perturb(trainer.model, seed=9)
            searchers.publish(trainer)
            searchers.generate(2)
            assert searchers.restarts == 1 and searchers.slots[1].incarnation == 1
            version, weights = ray.get(searchers.slots[1].handle.weights.remote())
            assert version == trainer.version
            assert_same_weights(weights, get_weights(trainer.model))
            assert searchers.transfer.paths[1].using == path
        finally:
            searchers.close()


@pytest.mark.slow
def test_the_handoff_benchmark_runs_on_tiny_shapes():
    from benchmarks.handoff import PATHS, main

    rows = main(["--small", "--repeats", "1", "--device", "cpu"])
    assert [(r["model"], r["path"]) for r in rows] == [
        (model, path) for model in ("builtin (small)", "qwen2.5-0.5b (small)") for path in PATHS
    ]
    assert all(0 < r["blocking_s"] <= r["handoff_s"] for r in rows)
