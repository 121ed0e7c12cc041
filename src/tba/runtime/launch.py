"""Starting the run's trainer and searchers where the config says.

- The trainer: in this process (`trainer.world_size=1`), or as `trainer.world_size` Ray actors
  sharding the policy with FSDP2 (`ray_trainer.RankedTrainer`).
- The searchers: one inside this process (`searchers.count=0`), or `searchers.count` Ray actors.

Their devices, the GPUs the searcher processes reserve, the GPUs a local Ray instance gets (not
the trainer's) and whether the in-process searcher shares the trainer's module are
`placement`'s decisions.

Ray (a local instance or a cluster, `ray_cluster.ray_session`) lives as long as whatever uses it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tba.config import RunConfig
from tba.core import EventLogger, Task
from tba.policy.model import load_policy
from tba.runtime.in_process import InProcessSearchers
from tba.runtime.placement import (
    local_ray_gpus,
    searcher_device,
    shares_trainer_model,
    trainer_device,
)
from tba.runtime.ray_cluster import ray_session
from tba.runtime.ray_pool import RaySearchers
from tba.runtime.ray_trainer import RankedTrainer
from tba.runtime.searchers import Searchers
from tba.searcher import Searcher
from tba.trainer import Trainer, trainer_settings


@contextmanager
def open_trainer(
    config: RunConfig, policy_dir: Path, pad_id: int, log_event: EventLogger,
    total_steps: int | None,
) -> Iterator[Trainer | RankedTrainer]:  # fmt: skip
    """The run's trainer, at step 0 (a checkpoint is loaded into it by the loop), for a run of
    `total_steps` optimizer steps (its learning-rate schedule); with several ranks, they are
    stopped on exit."""
    if config.trainer.world_size == 1:
        model = load_policy(
            str(policy_dir), trainer_device(config), dtype=config.policy.dtype,
            lora=config.lora, gradient_checkpointing=config.train.gradient_checkpointing,
            quantization=config.quantization,
        )  # fmt: skip
        yield Trainer(model, **trainer_settings(config, pad_id, total_steps))
        return
    with ray_session(config, lambda text: log_event("ray", message=text), local_ray_gpus(config)):
        trainer = RankedTrainer(config, policy_dir, pad_id, log_event, total_steps)
        try:
            yield trainer
        finally:
            trainer.close()


@contextmanager
def open_searchers(
    config: RunConfig,
    policy_dir: Path,
    tokenizer,
    task: Task,
    log_event: EventLogger,
    run_dir: Path,
    state: dict[str, Any] | None = None,
    trainer: Trainer | RankedTrainer | None = None,
) -> Iterator[Searchers]:
    """The run's searchers, continuing a checkpoint's `state` (they take it before their first
    generation, so their processes start from it); with Ray, the Ray instance lives exactly as
    long as they do. A searcher in this process samples with `trainer`'s own module where that
    gives the same samples (`placement.shares_trainer_model`), else with its own copy."""
    if config.searchers.count == 0:
        shared = trainer is not None and shares_trainer_model(config, trainer)
        model = trainer.model if shared else load_policy(
            str(policy_dir), searcher_device(config), dtype=config.policy.dtype,
            lora=config.lora, quantization=config.quantization,
        )  # fmt: skip
        searcher = Searcher(
            model, tokenizer, task.train_rows, task.reward_fns, config, seed=config.seed,
            model_dir=str(policy_dir), shares_trainer_model=shared,
        )  # fmt: skip
        local = InProcessSearchers(searcher)
        if state:
            local.load_state_dict(state)
        yield local
        return
    # Searcher ledgers live in the run directory, which only processes on this machine can see.
    ledger_dir = run_dir / "searchers" if config.ray.address is None else None
    with ray_session(config, lambda text: log_event("ray", message=text), local_ray_gpus(config)):
        searchers = RaySearchers(config, policy_dir, task, log_event, trainer, ledger_dir)
        if state:
            searchers.load_state_dict(state)
        searchers.launch()
        try:
            yield searchers
        finally:
            searchers.close()
