"""The trainer's view of its searchers: publish weights, get samples.

`LocalSearchers` runs one searcher inside the trainer process (synchronous mode, no Ray).
`RaySearchers` runs `searchers.count` searcher actors. Both offer:

    publish(weights, version)  make these the weights of the next generations
    generate(num_prompts)      sync: generate now with the published weights, and wait
    start()                    async: every searcher generates until closed
    collect(trainer_version)   async: the samples made since the last call, without waiting
    close()

Weights are put into the object store once per publish and every searcher fetches that one copy.
A searcher process that dies is replaced by a new one with the latest weights (up to
`searchers.max_restarts` times each); one that does not answer within `ray.sync_timeout_s` fails
the run with a clear error instead of hanging it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tba.buffer import Sample
from tba.config import RunConfig
from tba.policy.model import load_model, resolve_device
from tba.runtime.errors import SearcherError
from tba.runtime.searcher_worker import SearcherWorker
from tba.searcher import Searcher, SearchSettings
from tba.tasks import Task

EventLog = Callable[..., None]  # log_event(kind, **fields)


def search_settings(config: RunConfig) -> SearchSettings:
    tc = config.train
    return SearchSettings(
        samples_per_prompt=tc.samples_per_prompt or tc.group_size,
        temperature=config.policy.temperature,
        max_new_tokens=config.policy.max_new_tokens,
        truncated=tc.truncated,
        truncation_penalty=tc.truncation_penalty,
    )


def searcher_seed(seed: int, searcher_id: int, incarnation: int) -> int:
    """Distinct, reproducible streams for every searcher and every restart of it."""
    return int(np.random.SeedSequence([seed, searcher_id, incarnation]).generate_state(1)[0])


class LocalSearchers:
    """One searcher in the trainer process: the synchronous mode without Ray."""

    def __init__(self, searcher: Searcher) -> None:
        self.searcher = searcher

    def publish(self, weights: dict[str, np.ndarray], version: int) -> None:
        self.searcher.set_weights(weights, version)

    def generate(self, num_prompts: int) -> tuple[list[Sample], dict[str, float]]:
        return self.searcher.generate(num_prompts)

    def close(self) -> None:
        """Nothing to release: the searcher lives and ends with this process."""


@dataclass
class _Slot:
    """One searcher position; its actor is replaced when the process dies."""

    handle: Any
    incarnation: int = 0
    ready: bool = False  # answered at least once (its process is up)
    pending: tuple[Any, float] | None = None  # (ObjectRef of a collect call, time issued)
    ready_at: float = 0.0
    totals: dict[str, float] = field(default_factory=dict)


class RaySearchers:
    def __init__(
        self, config: RunConfig, policy_dir: Path, task: Task, log_event: EventLog
    ) -> None:
        import ray

        self._ray = ray
        self.config = config
        self.policy_dir = str(policy_dir)
        self.reward_fns = task.reward_fns
        self.log_event = log_event
        self.timeout = config.ray.sync_timeout_s
        sc = config.searchers
        self._actor = ray.remote(SearcherWorker).options(
            num_cpus=sc.num_cpus, num_gpus=sc.num_gpus, max_concurrency=4, max_restarts=0
        )
        self._rows = ray.put(task.train_rows)  # one copy, shared by every searcher
        self._weights: tuple[int, Any] | None = None  # (version, ObjectRef)
        self._running = False
        self.restarts = 0
        self.slots = [_Slot(self._spawn(i, 0)) for i in range(sc.count)]

    # ------------------------------------------------------------------------------ weights

    def publish(self, weights: dict[str, np.ndarray], version: int) -> None:
        self._weights = (version, self._ray.put(weights))
        if self._running:
            for slot in self.slots:
                slot.handle.offer_weights.remote(version, [self._weights[1]])

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
                    self._mark_ready(i, results[i][1]["pid"])
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
            "response_length": tokens / generated,
        }

    def _generate_call(self, i: int, num_prompts: int) -> tuple[Any, float]:
        version, ref = self._latest_weights()
        return self.slots[i].handle.generate_batch.remote(num_prompts, version, [ref]), time.time()

    # --------------------------------------------------------------------- asynchronous mode

    def start(self) -> None:
        self._running = True
        for slot in self.slots:
            self._start(slot)

    def _start(self, slot: _Slot) -> None:
        sc, tc = self.config.searchers, self.config.train
        per_batch = sc.prompts_per_batch or tc.num_prompts
        version, ref = self._latest_weights()
        slot.handle.start.remote(per_batch, sc.max_unsent_samples, version, [ref])

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
            self._mark_ready(i, result["pid"])
            samples += result.pop("samples")
            stats |= self._searcher_stats(i, result, trainer_version)
        stats["searcher_restarts"] = self.restarts
        return samples, stats

    def _searcher_stats(self, i: int, result: dict, trainer_version: int) -> dict[str, float]:
        """Rates since this searcher process started, and its weight-version lag."""
        slot = self.slots[i]
        for key in ("num_samples", "tokens", "gen_seconds", "idle_seconds", "truncated", "dropped"):
            slot.totals[key] = slot.totals.get(key, 0.0) + result.get(key, 0.0)
        elapsed = max(time.time() - slot.ready_at, 1e-9)
        return {
            f"searcher{i}/samples_per_s": slot.totals["num_samples"] / elapsed,
            f"searcher{i}/tokens_per_s": slot.totals["tokens"] / elapsed,
            f"searcher{i}/busy_frac": slot.totals["gen_seconds"] / elapsed,
            f"searcher{i}/version_lag": trainer_version - result["version"],
        }

    # -------------------------------------------------------------------------- failures

    def _spawn(self, i: int, incarnation: int) -> Any:
        sc = self.config.searchers
        return self._actor.remote(
            self.policy_dir, self._rows, self.reward_fns, search_settings(self.config),
            searcher_id=i, seed=searcher_seed(self.config.seed, i, incarnation),
            device=sc.device, num_threads=sc.num_threads or max(1, round(sc.num_cpus)),
            weights_timeout_s=self.timeout,
        )  # fmt: skip

    def _mark_ready(self, i: int, pid: int) -> None:
        slot = self.slots[i]
        if not slot.ready:
            slot.ready, slot.ready_at, slot.totals = True, time.time(), {}
            self.log_event("searcher_ready", searcher=i, pid=pid, incarnation=slot.incarnation)

    def _replace(self, i: int, error: Exception) -> None:
        """A dead searcher process: start a new one in its place, with the latest weights."""
        slot = self.slots[i]
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        if slot.incarnation >= self.config.searchers.max_restarts:
            raise SearcherError(
                f"searcher {i} died {slot.incarnation + 1} times "
                f"(searchers.max_restarts={self.config.searchers.max_restarts}); last: {error}"
            )
        self._ray.kill(slot.handle)
        self.restarts += 1
        slot.incarnation += 1
        slot.handle, slot.ready, slot.pending = self._spawn(i, slot.incarnation), False, None
        self.log_event(
            "searcher_restarted", searcher=i, incarnation=slot.incarnation, reason=reason
        )
        if self._running:
            self._start(slot)

    def _check_timeout(self, i: int, issued: float) -> None:
        waited = time.time() - issued
        if waited > self.timeout:
            state = "answered" if self.slots[i].ready else "started"
            raise SearcherError(
                f"searcher {i} has not {state} for {waited:.0f} s (ray.sync_timeout_s="
                f"{self.timeout:g}): it is stuck, or Ray cannot place it (it asks for "
                f"{self.config.searchers.num_cpus:g} CPU, {self.config.searchers.num_gpus:g} GPU)"
            )

    def _latest_weights(self) -> tuple[int, Any]:
        if self._weights is None:
            raise RuntimeError("publish weights before generating")
        return self._weights

    def close(self) -> None:
        for slot in self.slots:
            self._ray.kill(slot.handle)


@contextmanager
def open_searchers(
    config: RunConfig, policy_dir: Path, tokenizer, task: Task, log_event: EventLog
) -> Iterator[LocalSearchers | RaySearchers]:
    """The run's searchers; with Ray, the Ray instance lives exactly as long as they do."""
    if config.searchers.count == 0:
        device = resolve_device(config.searchers.device)
        searcher = Searcher(
            load_model(str(policy_dir), device), tokenizer, task.train_rows, task.reward_fns,
            search_settings(config), seed=config.seed,
        )  # fmt: skip
        yield LocalSearchers(searcher)
        return
    from tba.runtime.ray_cluster import ray_session

    with ray_session(config):
        searchers = RaySearchers(config, policy_dir, task, log_event)
        try:
            yield searchers
        finally:
            searchers.close()
