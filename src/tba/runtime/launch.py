"""Starting the run's searchers where the config says: one inside the trainer process
(`searchers.count=0`), or `searchers.count` Ray actors on a local Ray instance or a cluster."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tba.config import RunConfig
from tba.core import EventLogger, Task
from tba.policy.model import load_policy, resolve_device
from tba.runtime.in_process import InProcessSearchers
from tba.runtime.pool import Searchers
from tba.runtime.ray_cluster import ray_session
from tba.runtime.ray_pool import RaySearchers
from tba.searcher import Searcher, SearchSettings


@contextmanager
def open_searchers(
    config: RunConfig,
    policy_dir: Path,
    tokenizer,
    task: Task,
    log_event: EventLogger,
    run_dir: Path,
    state: dict[str, Any] | None = None,
) -> Iterator[Searchers]:
    """The run's searchers, continuing a checkpoint's `state` (they take it before their first
    generation, so their processes start from it); with Ray, the Ray instance lives exactly as
    long as they do."""
    if config.searchers.count == 0:
        device = resolve_device(config.searchers.device)
        searcher = Searcher(
            load_policy(str(policy_dir), device, dtype=config.policy.dtype, lora=config.lora),
            tokenizer, task.train_rows, task.reward_fns,
            SearchSettings.from_config(config), seed=config.seed,
        )  # fmt: skip
        local = InProcessSearchers(searcher)
        if state:
            local.load_state_dict(state)
        yield local
        return
    # Searcher ledgers live in the run directory, which only processes on this machine can see.
    ledger_dir = run_dir / "searchers" if config.ray.address is None else None
    with ray_session(config, lambda text: log_event("ray", message=text)):
        searchers = RaySearchers(config, policy_dir, task, log_event, ledger_dir)
        if state:
            searchers.load_state_dict(state)
        searchers.launch()
        try:
            yield searchers
        finally:
            searchers.close()
