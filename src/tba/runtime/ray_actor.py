"""A searcher in its own process (a Ray actor): it generates in a background thread and hands over
what it made whenever the trainer asks.

The actor is threaded: the generation loop runs in its own thread, so `collect` and `offer`
answer at once even while a batch is being generated, and the trainer never waits on generation
in flight. Each published version is offered (`tba.runtime.transfer.Offer`) and taken between
batches, through the transport the searcher attached to (`tba.runtime.transfer.Receiving`: the
first the trainer offered that works here; its reports say which, and the digest of the weights
it generates with); new samples wait in an outbox until the trainer collects them. A full outbox
pauses the loop, so memory stays bounded however slow the trainer is.

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

from tba.config import RunConfig
from tba.core import RewardFn, Sample
from tba.errors import RunError
from tba.policy.engines import Engine
from tba.policy.model import get_weights, load_policy, resolve_device
from tba.policy.tokenizer import load_tokenizer
from tba.quiet import quiet_libraries
from tba.runtime.transfer import Offer, ReceiverPlace, Receiving
from tba.searcher import Searcher


class SearcherActor:
    """A `Searcher` in its own process, generating in a background thread (`start`) or one batch
    at a time (`generate_batch`), with the weights the trainer offers. `config`: the run's (the
    searcher's settings, and how its policy loads: `policy.dtype`, `lora`, `quantization`);
    `engine`: the class of its engine, the trainer's own (an engine registered in the trainer's
    process alone is not in this one's registry)."""

    def __init__(
        self,
        policy_dir: str,
        rows: list[dict],
        reward_fns: list[RewardFn],
        config: RunConfig,
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
        engine: type[Engine] | None = None,
    ) -> None:
        # Ray sets OMP_NUM_THREADS=1 in workers; the thread count is ours to choose.
        torch.set_num_threads(num_threads)
        self.niceness = normal_priority()
        import ray  # a Ray actor's process: Ray is there, and was imported by Ray itself

        # (None when the class is used outside Ray, as the tests do.)
        self.node = ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
        quiet_libraries()
        tokenizer = load_tokenizer(policy_dir, chat_template=config.policy.chat_template)
        model = load_policy(policy_dir, resolve_device(device), dtype=config.policy.dtype,
                            lora=config.lora, quantization=config.quantization)  # fmt: skip
        self.searcher = Searcher(
            model, tokenizer, rows, reward_fns, config, searcher_id=searcher_id, seed=seed,
            incarnation=incarnation, stream_seed=stream_seed, stream_taken=stream_taken,
            model_dir=policy_dir, engine=engine,
        )  # fmt: skip
        self.ledger_path = ledger_path
        self._ledger_lock = threading.Lock()
        self._ledger_closed = False
        # The stream position after the last batch put in the outbox: where a replacement
        # continues, so prompts in flight at a kill are generated again, not skipped.
        self._stream_taken = stream_taken
        self._faults: list[tuple[str, str, int]] = []
        self._lock = threading.Condition()
        self._outbox: list[Sample] = []
        self._offer: Offer | None = None  # the newest version offered, not taken yet
        self._candidates: tuple | None = None  # transports to try before the next batch
        host = ray.util.get_node_ip_address() if ray.is_initialized() else None
        name = f"searcher{searcher_id}.{incarnation}.{os.getpid()}"
        self.receiving = Receiving(self.searcher.policy,
                                   ReceiverPlace(self.node, host, name, weights_timeout_s))
        self._counters: Counter[str] = Counter()
        self._error: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def offer(self, offer: Offer) -> None:
        """A published version to take before the next batch (with the transports to try, until
        this searcher has taken one it stays with)."""
        with self._lock:
            if offer.candidates is not None:
                self._candidates = offer.candidates
            if self._offer is None or offer.version > self._offer.version:
                self._offer = offer

    def generate_batch(self, num_prompts: int, offer: Offer) -> tuple[list[Sample], dict]:
        """Synchronous mode: one batch with the version offered, returned at once."""
        self.offer(offer)
        self._take_offered_weights(exact=True)
        samples, stats = self.searcher.generate(num_prompts)
        self._write_ledger()
        return samples, stats | self._whereabouts() | {
            "stream_taken": self.searcher.stream.taken,
            "reward_faults": self.searcher.take_reward_faults(),
        }

    def start(self, prompts_per_batch: int, max_unsent: int, offer: Offer) -> None:
        """Asynchronous mode: generate until stopped, starting with the version offered."""
        self.offer(offer)
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

    def _take_offered_weights(self, exact: bool = False) -> None:
        """The newest version offered, before the next batch, through the transport this
        searcher attached to. `exact` (synchronous mode): the version offered, waited for if it
        is still on its way; so is the first version a searcher takes (it has nothing else)."""
        with self._lock:
            offer, self._offer = self._offer, None
            candidates, self._candidates = self._candidates, None
        if candidates:
            self.receiving.attach(candidates)
        if offer is None and self.receiving.using is None:
            return
        start = time.time()
        first = self.searcher.version == 0  # it has nothing to generate with but the base
        try:
            copied = self.receiving.receive(self.searcher.version, offer, wait=first,
                                            exact=exact)  # fmt: skip
        except RuntimeError as error:
            raise RunError(f"{error}; set searchers.weight_transfer=object_store") from None
        if copied is None:
            return
        self.searcher.adopt(*copied)
        self._counters["sync_seconds"] += time.time() - start
        self._counters["weight_updates"] += 1

    def _whereabouts(self) -> dict:
        return {"pid": os.getpid(), "node": self.node, "nice": self.niceness,
                "engine_start_seconds": self.searcher.engine.start_seconds,
                "version": self.searcher.version,
                **self.receiving.report()}  # fmt: skip

    def _loop(self, prompts_per_batch: int, max_unsent: int) -> None:
        normal_priority()  # this thread, and the torch threads it starts
        try:
            while not self._stop.is_set():
                with self._lock:
                    start = time.time()
                    while len(self._outbox) >= max_unsent and not self._stop.is_set():
                        self._lock.wait(timeout=1.0)
                    self._counters["idle_seconds"] += time.time() - start
                self._take_offered_weights()
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
