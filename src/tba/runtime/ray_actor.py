"""A searcher in its own process (a Ray actor): it generates in a background thread and hands over
what it made whenever the trainer asks.

The actor is threaded: the generation loop runs in its own thread, so `collect` and
`offer_weights` answer at once even while a batch is being generated, and the trainer never waits
on generation in flight. Weights are offered as an object-store reference and adopted between
batches; new samples wait in an outbox until the trainer collects them. On the trainer's machine
the offer comes with the handles of the trainer's shared weight buckets (once), and the searcher
copies the newest version out of them instead (`tba.runtime.weight_buckets`); where it cannot map
them (another machine, another GPU), it joins the trainer's broadcast group when it is offered one
(`tba.runtime.weight_broadcast`), else takes the object store's, and says which in its reports. A
full outbox pauses the loop, so memory stays bounded however slow the trainer is.

With a `ledger_path`, the actor records after every batch how many samples it has made and how
far it is in its prompt stream, before the batch can be collected. The file outlives the process,
so when a searcher (or the whole run) is killed, the trainer can count exactly the samples that
were made but never handed over: work lost in flight, as opposed to data lost.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
import traceback
from collections import Counter
from pathlib import Path

import torch

from tba.config import LoraConfig, QuantizationConfig
from tba.core import RewardFn, Sample
from tba.errors import RunError
from tba.policy.model import get_weights, load_policy, resolve_device
from tba.policy.tokenizer import load_tokenizer
from tba.quiet import quiet_libraries
from tba.runtime.weight_broadcast import BroadcastReceiver
from tba.runtime.weight_buckets import BucketReader, CannotAttach
from tba.searcher import Searcher, SearchSettings


class SearcherActor:
    """A `Searcher` in its own process, generating in a background thread (`start`) or one batch
    at a time (`generate_batch`), with the weights the trainer offers."""

    def __init__(
        self,
        policy_dir: str,
        rows: list[dict],
        reward_fns: list[RewardFn],
        settings: SearchSettings,
        *,
        searcher_id: int,
        seed: int,
        device: str,
        num_threads: int,
        weights_timeout_s: float,
        incarnation: int = 0,
        stream_seed: int | None = None,
        stream_taken: int = 0,
        ledger_path: str | None = None,
        dtype: str = "float32",
        lora: LoraConfig | None = None,
        quantization: QuantizationConfig | None = None,
    ) -> None:
        # Ray sets OMP_NUM_THREADS=1 in workers; the thread count is ours to choose.
        torch.set_num_threads(num_threads)
        self.niceness = normal_priority()
        import ray  # a Ray actor's process: Ray is there, and was imported by Ray itself

        # (None when the class is used outside Ray, as the tests do.)
        self.node = ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
        quiet_libraries()
        tokenizer = load_tokenizer(policy_dir, chat_template=settings.chat_template)
        model = load_policy(policy_dir, resolve_device(device), dtype=dtype, lora=lora,
                            quantization=quantization)  # fmt: skip
        self.searcher = Searcher(
            model, tokenizer, rows, reward_fns, settings, searcher_id=searcher_id, seed=seed,
            incarnation=incarnation, stream_seed=stream_seed, stream_taken=stream_taken,
            model_dir=policy_dir,
        )  # fmt: skip
        self.weights_timeout_s = weights_timeout_s
        self.ledger_path = ledger_path
        self._ledger_lock = threading.Lock()
        self._ledger_closed = False
        # The stream position after the last batch put in the outbox: where a replacement
        # continues, so prompts in flight at a kill are generated again, not skipped.
        self._stream_taken = stream_taken
        self._faults: list[tuple[str, str, int]] = []
        self._lock = threading.Condition()
        self._outbox: list[Sample] = []
        # (version, the optimizer step it was published at, ObjectRef of the weights)
        self._offer: tuple[int, int, object] | None = None
        # The trainer's shared weight buckets: their handles until this searcher tries them,
        # then the reader mapping them or the receiver of the trainer's broadcast (neither: the
        # object store's path), and which path it took.
        self._bucket_handles: dict | None = None
        self._reader: BucketReader | None = None
        self._receiver: BroadcastReceiver | None = None
        self.weight_transfer: str | None = None  # "shared", "broadcast", "object_store"
        self.weight_transfer_why = ""
        self._counters: Counter[str] = Counter()
        self._error: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def offer_weights(
        self, version: int, step: int, refs: list, buckets: dict | None = None
    ) -> None:
        """Weights of `version`, published at optimizer step `step`, to adopt before the next
        batch (wrapped in a list so that Ray passes the reference instead of fetching the arrays
        here; [None] when they come only through the shared buckets). `buckets`: the handles of
        the trainer's shared weight buckets, tried once before the next batch."""
        with self._lock:
            if buckets is not None and self.weight_transfer is None:
                self._bucket_handles = buckets
            if self._offer is None or version > self._offer[0]:
                self._offer = (version, step, refs[0])

    def generate_batch(
        self, num_prompts: int, version: int, step: int, refs: list, buckets: dict | None = None
    ) -> tuple[list[Sample], dict[str, float]]:
        """Synchronous mode: one batch with the given weights, returned at once."""
        self.offer_weights(version, step, refs, buckets)
        self._adopt_offered_weights(exact=True)
        samples, stats = self.searcher.generate(num_prompts)
        self._write_ledger()
        return samples, stats | {
            "version": self.searcher.version,
            **self._whereabouts(),
            "stream_taken": self.searcher.stream.taken,
            "reward_faults": self.searcher.take_reward_faults(),
        }

    def start(
        self, prompts_per_batch: int, max_unsent: int, version: int, step: int, refs: list,
        buckets: dict | None = None,
    ) -> None:  # fmt: skip
        """Asynchronous mode: generate until stopped, starting with the given weights."""
        self.offer_weights(version, step, refs, buckets)
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._loop, args=(prompts_per_batch, max_unsent), daemon=True
            )
            self._thread.start()

    def collect(self) -> dict:
        """Samples made since the last call, with counters; re-raises a failure of the loop."""
        with self._lock:
            samples, self._outbox = self._outbox, []
            counters, self._counters = dict(self._counters), Counter()
            faults, self._faults = self._faults, []
            stream_taken = self._stream_taken
            self._lock.notify_all()
        if self._error is not None:
            raise RuntimeError(self._error)
        return {
            "samples": samples,
            "version": self.searcher.version,
            **self._whereabouts(),
            "stream_taken": stream_taken,
            "reward_faults": faults,
            **counters,
        }

    def weights(self) -> tuple[int, dict]:
        """The version this searcher holds and its weights, as `get_weights` gives them (to
        check a hand-off)."""
        return self.searcher.version, get_weights(self.searcher.policy)

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)

    # ------------------------------------------------------------------------------ internals

    def _adopt_offered_weights(self, exact: bool = False) -> None:
        """The newest weights offered, before the next batch. `exact` (synchronous mode): the
        version offered, waited for if it is still on its way (broadcast)."""
        import ray  # this process is a Ray actor: Ray is there, and was imported by Ray itself

        with self._lock:
            offer, self._offer = self._offer, None
            handles, self._bucket_handles = self._bucket_handles, None
        if handles is not None:
            self._attach(handles)
        start = time.time()
        copied, fell_back = None, False
        if self._receiver is not None:
            copied = self._copy_broadcast(offer, exact)
            if self._receiver.error is not None:  # cannot join the group, or it broke
                self.weight_transfer, self.weight_transfer_why = "object_store", \
                    self._receiver.error  # fmt: skip
                self._receiver, fell_back = None, True
        if self._reader is not None:  # the newest whole version out of the shared buckets
            copied = self._reader.copy_newest(newer_than=self.searcher.version)
        if copied is not None:
            self.searcher.weights_copied(*copied)
        elif offer is not None and offer[0] > self.searcher.version and self._receiver is None \
                and self._reader is None:  # fmt: skip
            version, step, ref = offer
            if ref is None and fell_back and not exact:
                # The trainer sends copies once it reads the report; until one comes, the
                # weights it has (synchronous mode must have the version offered: it fails).
                return
            if ref is None:
                raise RunError(
                    f"weights of version {version} were offered only through the trainer's "
                    f"shared buckets or broadcast, which this searcher cannot use "
                    f"({self.weight_transfer_why}); set searchers.weight_transfer=object_store"
                )
            self.searcher.set_weights(ray.get(ref, timeout=self.weights_timeout_s), version, step)
        else:
            return
        self._counters["sync_seconds"] += time.time() - start
        self._counters["weight_updates"] += 1

    def _copy_broadcast(self, offer: tuple | None, exact: bool) -> tuple[int, int] | None:
        """The newest version the trainer's broadcast staged, if newer than the model's: waited
        for in synchronous mode (`exact`), and by a searcher that has received nothing yet (as
        one given its weights through the object store starts with them); None also when the
        group failed meanwhile (`self._receiver.error` says how)."""
        behind = offer is not None and offer[0] > self.searcher.version
        first = self._receiver.staged[0] < 0
        wait = offer[0] if behind and (exact or first) else None
        try:
            return self._receiver.copy_newest(newer_than=self.searcher.version, wait_for=wait,
                                              timeout_s=self.weights_timeout_s)  # fmt: skip
        except RuntimeError:  # the group failed while it waited
            return None

    def _attach(self, handles: dict) -> None:
        """Map the trainer's shared weight buckets; where it cannot, join its broadcast group if
        it has one; else note why not (the object store's path)."""
        try:
            if handles.get("only") == "broadcast":
                raise CannotAttach("searchers.weight_transfer=broadcast")
            self._reader = BucketReader(handles, self.searcher.policy, self.node)
            self.weight_transfer, self.weight_transfer_why = "shared", ""
        except CannotAttach as why:
            self.weight_transfer, self.weight_transfer_why = "object_store", str(why)
            if handles.get("broadcast") is not None:
                name = f"searcher{self.searcher.searcher_id}.{self.searcher.incarnation}." \
                    f"{os.getpid()}"  # fmt: skip
                self._receiver = BroadcastReceiver(handles["broadcast"], self.searcher.policy,
                                                   name, self.weights_timeout_s)  # fmt: skip
                self.weight_transfer = "broadcast"

    def _whereabouts(self) -> dict:
        engine_start = getattr(self.searcher.engine, "start_seconds", None)
        return {"pid": os.getpid(), "node": self.node, "nice": self.niceness,
                "engine_start_seconds": engine_start, "weight_transfer": self.weight_transfer,
                "weight_transfer_why": self.weight_transfer_why}  # fmt: skip

    def _loop(self, prompts_per_batch: int, max_unsent: int) -> None:
        normal_priority()  # this thread, and the torch threads it starts
        try:
            while not self._stop.is_set():
                with self._lock:
                    start = time.time()
                    while len(self._outbox) >= max_unsent and not self._stop.is_set():
                        self._lock.wait(timeout=1.0)
                    self._counters["idle_seconds"] += time.time() - start
                self._adopt_offered_weights()
                samples, stats = self.searcher.generate(prompts_per_batch)
                self._write_ledger()
                with self._lock:
                    self._outbox += samples
                    self._stream_taken = self.searcher.stream.taken
                    self._faults += self.searcher.take_reward_faults()
                    self._counters["reward_dropped"] += stats["reward_dropped"]
                    self._counters["reward_unscored"] += stats["reward_unscored"]
                    self._counters["num_samples"] += len(samples)
                    self._counters["tokens"] += stats["gen_tokens"]
                    self._counters["gen_seconds"] += stats["gen_seconds"]
                    self._counters["dropped"] += stats["dropped"]
                    self._counters["truncated"] += stats["truncated_frac"] * stats["generated"]
        except BaseException as error:  # reported to the trainer by the next `collect`
            # An explained failure (a reward function broken for good, no usable samples) is its
            # one line; anything else also leaves its traceback in the searcher's log.
            if not isinstance(error, RunError):
                traceback.print_exc()
            self._error = f"{type(error).__name__}: {error}"

    def close_ledger(self) -> None:
        """Write the ledger no more: what it says now is final, whatever this process still does
        before it is killed (a batch in flight is then neither counted nor handed over)."""
        with self._ledger_lock:
            self._ledger_closed = True

    def _write_ledger(self) -> None:
        if self.ledger_path is None:
            return
        searcher = self.searcher
        record = {"generated": searcher.num_generated, "stream_taken": searcher.stream.taken}
        partial = f"{self.ledger_path}.partial"
        with self._ledger_lock:
            if self._ledger_closed:
                return
            with open(partial, "w") as file:
                json.dump(record, file)
            os.replace(partial, self.ledger_path)  # a reader never sees half a record


def normal_priority() -> int:
    """Every thread of this process at nice 0, where allowed: Ray starts its workers at nice 15,
    and beside a trainer that wants every core, searchers at 15 all but stop. Lowering the
    niceness needs the privilege to (root, or CAP_SYS_NICE); without it nothing changes. Returns
    the niceness this thread runs at."""
    tasks = Path("/proc/self/task")
    threads = [int(tid) for tid in os.listdir(tasks)] if tasks.is_dir() else [0]
    for thread in threads:
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, thread, 0)
    return os.getpriority(os.PRIO_PROCESS, 0)
