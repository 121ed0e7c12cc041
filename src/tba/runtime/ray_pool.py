"""Searchers as Ray actors: `RaySearchers` runs `searchers.count` of them (`ray_actor`), on a
local Ray instance or a cluster. A publish goes out through the run's weight transports
(`tba.runtime.transfer`: by default shared buckets that searchers on the trainer's machine map,
a broadcast group for the others, the object store as the way of last resort); Ray carries each
searcher its offer of the version. Which way each searcher takes is logged once per way
(`weight_transfer`), and the digest of the weights each one generates with is checked against
the version it says they are.

A searcher process that dies is replaced by a new one with the latest weights (up to
`searchers.max_restarts` times each); one that does not answer within `ray.sync_timeout_s`
fails the run with a clear error instead of hanging it.

A replacement continues its predecessor's prompt stream from the last batch handed over, so the
prompts in flight at a kill are generated again, not skipped.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tba.config import RunConfig
from tba.core import EventLogger, Sample, Task
from tba.errors import SearcherError, first_line
from tba.policy.engines import ENGINES
from tba.runtime.placement import searcher_gpus
from tba.runtime.ray_actor import SearcherActor
from tba.runtime.ray_cluster import cluster_address
from tba.runtime.searchers import AsyncSearchers
from tba.runtime.transfer import SenderPlace, open_chain
from tba.runtime.transfer.buckets import BucketCache
from tba.trainer import WeightVersions

LEDGER_CLOSE_TIMEOUT_S = 5.0  # a live searcher answers at once: its generation runs in a thread


def searcher_seed(seed: int, searcher_id: int, incarnation: int) -> int:
    """Distinct, reproducible streams for every searcher and every restart of it."""
    return int(np.random.SeedSequence([seed, searcher_id, incarnation]).generate_state(1)[0])


@dataclass
class _Slot:
    """One searcher position; its actor is replaced when the process dies."""

    handle: Any = None  # the actor, once launched
    incarnation: int = 0
    ready: bool = False  # answered at least once (its process is up)
    pending: tuple[Any, float] | None = None  # (ObjectRef of a collect call, time issued)
    ready_at: float = 0.0
    totals: dict[str, float] = field(default_factory=dict)
    stream_taken: int = 0  # stream position after the last batch handed over
    handed: int = 0  # samples this incarnation has handed over
    restarts: int = 0  # deaths replaced so far (a resume starts a new incarnation, not a restart)
    node: str | None = None  # the Ray node it runs on, once it reported


class RaySearchers(AsyncSearchers):
    """`searchers.count` searcher actors; `launch` starts their processes (after
    `load_state_dict` when the run continues from a checkpoint)."""

    def __init__(
        self,
        config: RunConfig,
        policy_dir: Path,
        task: Task,
        log_event: EventLogger,
        trainer: WeightVersions,
        ledger_dir: Path | None = None,
    ) -> None:
        # Imported here, not at the top: a run without searcher processes needs no Ray, and Ray
        # must be imported after `ray_cluster.ray_session` has set its environment.
        import ray

        self._ray = ray
        self.config = config
        self.policy_dir = str(policy_dir)
        self.reward_fns = task.reward_fns
        self.log_event = log_event
        self.timeout = config.ray.sync_timeout_s
        sc = config.searchers
        self.num_gpus = searcher_gpus(config)[0]
        self._actor = ray.remote(SearcherActor).options(
            num_cpus=sc.num_cpus, num_gpus=self.num_gpus, max_concurrency=4, max_restarts=0
        )
        self._rows = ray.put(task.train_rows)  # one copy, shared by every searcher
        self.transfer = open_chain(
            sc.weight_transfer, trainer, self._sender_place(), log_event,
            local=cluster_address(config) is None and trainer.trains_here
            and next(trainer.model.parameters()).device.type == "cpu",
        )  # fmt: skip
        self._published = False
        self._running = False
        self._reward_faults: list[tuple[str, str, int]] = []
        self.ledger_dir = ledger_dir
        if ledger_dir is not None:
            ledger_dir.mkdir(parents=True, exist_ok=True)
        self.slots = [_Slot() for _ in range(sc.count)]
        self._discarded = 0  # by this run's searchers
        self._killed: list[dict[str, Any]] = []  # searchers of killed runs, from the checkpoint

    def _sender_place(self) -> SenderPlace:
        """Where the trainer's side of the weight transports runs: this process, on this node."""
        ray = self._ray
        return SenderPlace(node=ray.get_runtime_context().get_node_id(),
                           host=ray.util.get_node_ip_address(), timeout_s=self.timeout,
                           buckets=BucketCache(), put=ray.put)  # fmt: skip

    def launch(self) -> None:
        """Start every searcher's process."""
        for i, slot in enumerate(self.slots):
            slot.handle = self._spawn(i, slot.incarnation, slot.stream_taken)
            self.transfer.new_searcher(i)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue a checkpoint's streams, each searcher as a new incarnation (the processes of
        the run that wrote it are gone, or going)."""
        self._discarded = state["discarded_in_flight"]
        # The killed run's searchers may still finish a batch (and write it in their ledgers)
        # while their Ray processes wind down: what they made is read when it is asked for.
        self._killed = [*state.get("killed", []), *(
            {"searcher": i, "handed": saved["handed"],
             "incarnations": [saved["incarnation"], self._last_ledger_incarnation(i)]}
            for i, saved in enumerate(state["slots"])
        )]  # fmt: skip
        self.restarts = state["restarts"]
        for i, (slot, saved) in enumerate(zip(self.slots, state["slots"])):
            slot.incarnation = max(saved["incarnation"], self._last_ledger_incarnation(i)) + 1
            slot.stream_taken, slot.restarts = saved["stream_taken"], saved["restarts"]

    @property
    def discarded_in_flight(self) -> int:
        """Samples made but never handed over (work lost, not data): by this run's searchers,
        and by a killed run's after its last checkpoint (handed over to a trainer that died
        before its next checkpoint, or never handed over)."""
        return self._discarded + sum(self._made_after_checkpoint(killed) for killed in self._killed)

    def _made_after_checkpoint(self, killed: dict[str, Any]) -> int:
        first, last = killed["incarnations"]
        made = sum(self.generated_by(killed["searcher"], i) or 0 for i in range(first, last + 1))
        return max(0, made - killed["handed"])

    def state_dict(self) -> dict[str, Any]:
        return {
            "slots": [
                {"incarnation": s.incarnation, "stream_taken": s.stream_taken, "handed": s.handed,
                 "restarts": s.restarts}
                for s in self.slots
            ],
            "discarded_in_flight": self._discarded,
            "killed": self._killed,
            "restarts": self.restarts,
        }

    def total_generated(self) -> int | None:
        """Samples made by every searcher process this run directory has seen (all restarts
        and resumes), from their ledgers; None without ledgers."""
        if self.ledger_dir is None:
            return None
        return sum(json.loads(p.read_text())["generated"] for p in self.ledger_dir.glob("*.json"))

    def take_reward_faults(self) -> list[tuple[str, str, int]]:
        faults, self._reward_faults = self._reward_faults, []
        return faults

    # ------------------------------------------------------------------------------ weights

    def publish(self, trainer: WeightVersions) -> None:
        """A new version through the run's weight transports, offered to every searcher."""
        version, step = trainer.publish()
        try:
            self.transfer.publish(version, step)
        except TimeoutError as error:
            raise SearcherError(str(error)) from None
        self._published = True
        if self._running:
            for i, slot in enumerate(self.slots):
                slot.handle.offer.remote(self._offer(i))

    def _offer(self, i: int) -> Any:
        if not self._published:
            raise RuntimeError("publish weights before generating")
        return self.transfer.offer(i)

    # ---------------------------------------------------------------------- synchronous mode

    def generate(self, num_prompts: int) -> tuple[list[Sample], dict[str, float]]:
        """`num_prompts` split over the searchers, generated with the published weights."""
        start = time.time()
        shares = [len(part) for part in np.array_split(np.arange(num_prompts), len(self.slots))]
        calls = {i: self._generate_call(i, n) for i, n in enumerate(shares) if n}
        results: dict[int, tuple[list[Sample], dict[str, float]]] = {}
        while calls:
            refs = [ref for ref, _ in calls.values()]
            self._ray.wait(refs, num_returns=len(refs), timeout=self.timeout)
            for i, (ref, issued) in list(calls.items()):
                if not self._ray.wait([ref], timeout=0)[0]:
                    self._check_timeout(i, issued)
                    continue
                del calls[i]
                try:
                    results[i] = self._ray.get(ref)
                    self._handed_over(i, results[i][0], results[i][1])
                except self._ray.exceptions.RayActorError as error:
                    self._replace(i, error)
                    calls[i] = self._generate_call(i, shares[i])
                except self._ray.exceptions.RayTaskError as error:
                    raise SearcherError(f"searcher {i} failed: {error.cause}") from None
        # In searcher order, whatever order they finished in: same seed, same batch.
        samples = [s for i in sorted(results) for s in results[i][0]]
        stats = [results[i][1] for i in sorted(results)]
        generated = sum(st["generated"] for st in stats)
        tokens = sum(st["gen_tokens"] for st in stats)
        elapsed = time.time() - start
        return samples, {
            "gen_seconds": elapsed,
            "generated": generated,
            "gen_tokens": tokens,
            "gen_tokens_per_s": tokens / elapsed,
            "truncated_frac": sum(st["truncated_frac"] * st["generated"] for st in stats)
            / generated,
            "dropped": sum(st["dropped"] for st in stats),
            "reward_dropped": sum(st["reward_dropped"] for st in stats),
            "reward_unscored": sum(st["reward_unscored"] for st in stats),
            "response_length": tokens / generated,
        }

    def _generate_call(self, i: int, num_prompts: int) -> tuple[Any, float]:
        call = self.slots[i].handle.generate_batch.remote(num_prompts, self._offer(i))
        return call, time.time()

    # --------------------------------------------------------------------- asynchronous mode

    def start(self) -> None:
        self._running = True
        for i in range(len(self.slots)):
            self._start(i)

    def _start(self, i: int) -> None:
        sc, tc = self.config.searchers, self.config.train
        per_batch = sc.prompts_per_batch or tc.num_prompts
        self.slots[i].handle.start.remote(per_batch, sc.max_unsent_samples, self._offer(i))

    def collect(self, trainer_version: int) -> tuple[list[Sample], dict[str, float]]:
        """New samples of every searcher that answers; never waits on generation in flight."""
        now = time.time()
        for slot in self.slots:
            if slot.pending is None:
                slot.pending = (slot.handle.collect.remote(), now)
        # Searchers that are up answer within milliseconds; one still starting is not waited for.
        up = [slot.pending[0] for slot in self.slots if slot.ready]
        if up:
            self._ray.wait(up, num_returns=len(up), timeout=self.timeout)
        samples: list[Sample] = []
        reward_dropped = reward_unscored = 0
        stats: dict[str, float] = {}
        for i, slot in enumerate(self.slots):
            ref, issued = slot.pending
            if not self._ray.wait([ref], timeout=0)[0]:
                self._check_timeout(i, issued)
                continue
            slot.pending = None
            try:
                result = self._ray.get(ref)
            except self._ray.exceptions.RayActorError as error:
                self._replace(i, error)
                continue
            except self._ray.exceptions.RayTaskError as error:
                raise SearcherError(f"searcher {i} failed: {error.cause}") from None
            self._handed_over(i, result["samples"], result)
            reward_dropped += result.get("reward_dropped", 0)
            reward_unscored += result.get("reward_unscored", 0)
            samples += result.pop("samples")
            stats |= self._searcher_stats(i, result, trainer_version)
        stats["searcher_restarts"] = self.restarts
        stats["reward_dropped"] = reward_dropped
        stats["reward_unscored"] = reward_unscored
        return samples, stats

    def _handed_over(self, i: int, samples: list[Sample], report: dict) -> None:
        slot = self.slots[i]
        self._mark_ready(i, report)
        self.transfer.report(i, report)
        slot.handed += len(samples)
        slot.stream_taken = report["stream_taken"]
        self._reward_faults += report["reward_faults"]

    def _searcher_stats(self, i: int, result: dict, trainer_version: int) -> dict[str, float]:
        """Rates since this searcher process started, and its weight-version lag."""
        slot = self.slots[i]
        for key in ("num_samples", "tokens", "gen_seconds", "idle_seconds", "truncated", "dropped",
                    "reward_dropped", "sync_seconds", "weight_updates"):  # fmt: skip
            slot.totals[key] = slot.totals.get(key, 0.0) + result.get(key, 0.0)
        elapsed = max(time.time() - slot.ready_at, 1e-9)
        return {
            f"searcher{i}/samples_per_s": slot.totals["num_samples"] / elapsed,
            f"searcher{i}/tokens_per_s": slot.totals["tokens"] / elapsed,
            f"searcher{i}/busy_frac": slot.totals["gen_seconds"] / elapsed,
            f"searcher{i}/version_lag": trainer_version - result["version"],
            # Fetching a version's weights and loading them into the engine, per version.
            f"searcher{i}/weight_sync_s": (slot.totals["sync_seconds"]
                                           / max(slot.totals["weight_updates"], 1)),
        }

    # -------------------------------------------------------------------------- failures

    def _spawn(self, i: int, incarnation: int, stream_taken: int) -> Any:
        """Searcher i's process: its own sampling seed per incarnation, while the prompt stream
        is the searcher's (seeded as incarnation 0) and continues at `stream_taken`. It gets the
        run's config and its engine's class from this process's registry (Ray sends a class
        registered from a script or a test by value)."""
        sc, seed = self.config.searchers, self.config.seed
        return self._actor.remote(
            self.policy_dir, self._rows, self.reward_fns, self.config,
            searcher_id=i, seed=searcher_seed(seed, i, incarnation),
            device=sc.device, num_threads=sc.num_threads or max(1, round(sc.num_cpus)),
            weights_timeout_s=self.timeout, incarnation=incarnation,
            stream_seed=searcher_seed(seed, i, 0), stream_taken=stream_taken,
            ledger_path=self._ledger_path(i, incarnation), engine=ENGINES[sc.engine.type],
        )  # fmt: skip

    def _ledger_path(self, i: int, incarnation: int) -> str | None:
        if self.ledger_dir is None:
            return None
        return str(self.ledger_dir / f"searcher{i}-{incarnation}.json")

    def _last_ledger_incarnation(self, i: int) -> int:
        if self.ledger_dir is None:
            return -1
        names = self.ledger_dir.glob(f"searcher{i}-*.json")
        return max((int(p.stem.rsplit("-", 1)[1]) for p in names), default=-1)

    def generated_by(self, i: int, incarnation: int) -> int | None:
        """Samples searcher i made in that incarnation, from its ledger (None without one)."""
        path = self._ledger_path(i, incarnation)
        try:
            return json.loads(Path(path).read_text())["generated"] if path else None
        except FileNotFoundError:
            return 0  # died before finishing a batch

    def _mark_ready(self, i: int, report: dict) -> None:
        slot = self.slots[i]
        if not slot.ready:
            slot.ready, slot.ready_at, slot.totals = True, time.time(), {}
            slot.node = report["node"]
            self.log_event("searcher_ready", searcher=i, pid=report["pid"], node=report["node"],
                           nice=report["nice"], incarnation=slot.incarnation,
                           engine_start_seconds=report["engine_start_seconds"])  # fmt: skip
            if report["nice"] > 0:
                self.log_event(
                    "searcher_low_priority", searcher=i, nice=report["nice"],
                    advice="start the Ray nodes with RAY_worker_niceness=0",
                )  # fmt: skip

    def cpus_beside_trainer(self) -> float:
        """CPUs the searchers that have reported so far reserve on the trainer's machine."""
        here = self._ray.get_runtime_context().get_node_id()
        sc = self.config.searchers
        return sum(sc.num_cpus for slot in self.slots if slot.node == here)

    def _replace(self, i: int, error: Exception) -> None:
        """A dead searcher process: start a new one in its place, with the latest weights."""
        slot = self.slots[i]
        reason = first_line(error)
        if slot.restarts >= self.config.searchers.max_restarts:
            raise SearcherError(
                f"searcher {i} died {slot.restarts + 1} times "
                f"(searchers.max_restarts={self.config.searchers.max_restarts}); last: {error}"
            )
        self._kill(slot)
        self.restarts += 1
        slot.restarts += 1
        generated = self.generated_by(i, slot.incarnation)
        discarded = max(0, generated - slot.handed) if generated is not None else None
        self._discarded += discarded or 0
        slot.incarnation += 1
        slot.handle = self._spawn(i, slot.incarnation, slot.stream_taken)
        self.transfer.new_searcher(i)
        slot.ready, slot.pending, slot.handed = False, None, 0
        self.log_event(
            "searcher_restarted", searcher=i, incarnation=slot.incarnation, reason=reason,
            discarded_in_flight=discarded,
        )  # fmt: skip
        if self._running:
            self._start(i)

    def _kill(self, slot: _Slot) -> None:
        """Kill a searcher's process, its ledger closed first: `ray.kill` returns before the
        process is gone, and a batch it finished meanwhile would be counted as made, never as
        discarded."""
        with contextlib.suppress(Exception):  # dead or stuck: its ledger is as it left it
            self._ray.get(slot.handle.close_ledger.remote(), timeout=LEDGER_CLOSE_TIMEOUT_S)
        self._ray.kill(slot.handle)

    def _check_timeout(self, i: int, issued: float) -> None:
        """A searcher that is up must answer within `ray.sync_timeout_s`; one still starting
        (loading its model) gets `ray.start_timeout_s`."""
        waited = time.time() - issued
        if self.slots[i].ready and waited > self.timeout:
            raise SearcherError(
                f"searcher {i} has not answered for {waited:.0f} s (ray.sync_timeout_s="
                f"{self.timeout:g}): it is stuck"
            )
        start_timeout = self.config.ray.start_timeout_s
        if not self.slots[i].ready and waited > start_timeout:
            sc = self.config.searchers
            raise SearcherError(
                f"searcher {i} has not started for {waited:.0f} s (ray.start_timeout_s="
                f"{start_timeout:g}): it is stuck loading, or Ray cannot place it (it asks for "
                f"{sc.num_cpus:g} CPU, {self.num_gpus:g} GPU)"
            )

    def close(self) -> None:
        """Stop every searcher; what they made but did not hand over is counted as discarded."""
        for slot in self.slots:
            self._kill(slot)
        for i, slot in enumerate(self.slots):
            generated = self.generated_by(i, slot.incarnation)
            self._discarded += max(0, (generated or 0) - slot.handed)
        self.transfer.close()
