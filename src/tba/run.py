"""`tba train`: wire task, searchers, buffer and trainer, and record everything in a run directory.

Data flows one way: prompts -> searchers -> buffer -> trainer -> weights -> searchers.

- **async** (TBA): the searchers generate without pause, each with the latest weights it has
  adopted. The trainer starts once the buffer holds `train.initial_buffer_samples`; then it only
  samples batches and steps. Every `train.sync_every` steps it publishes its weights and merges
  what the searchers made since the last sync. It never waits on a generation in flight.
- **sync** (on-policy baseline, same components): every step the searchers generate B prompts with
  the weights published last, the trainer waits for them and trains on a batch sampled from the
  buffer (with the default `recent_prob=1` and `sync_every=1`: exactly the samples just made).

The trainer runs in this process; the searchers run as Ray actors (`searchers.count >= 1`) or, in
the synchronous mode with `searchers.count=0`, inside this process without Ray.
"""

from __future__ import annotations

import json
import math
import os
import random
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from transformers import AutoTokenizer

from tba.base_policy import resolve_policy
from tba.buffer import ReplayBuffer
from tba.config import RunConfig, dump_config
from tba.evaluation import greedy_pass_at_1, sampled_pass_at_k
from tba.objectives import BetaSchedule
from tba.policy.model import load_model, resolve_device
from tba.rundir import (
    EventLog,
    MetricsLog,
    create_run_dir,
    plot_curves,
    read_metrics,
    save_snapshot,
)
from tba.runtime.feed import DataFeed
from tba.runtime.searchers import open_searchers
from tba.tasks import Task, build_task
from tba.trainer import Trainer


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def evaluate(model, tokenizer, task: Task, config: RunConfig, *, pass_k: bool) -> dict[str, float]:
    result = {
        "eval_pass@1": greedy_pass_at_1(
            model, tokenizer, task.eval_rows, task.correct_fn,
            max_new_tokens=config.policy.max_new_tokens,
        )
    }  # fmt: skip
    if pass_k:
        result |= sampled_pass_at_k(
            model, tokenizer, task.eval_rows[: config.task.num_eval_pass_k], task.correct_fn,
            k=config.eval.pass_k, max_new_tokens=config.policy.max_new_tokens,
            temperature=config.policy.temperature, seed=config.seed,
        )  # fmt: skip
    return result


def trainer_threads(config: RunConfig) -> int | None:
    """Torch threads of the trainer: as configured; else, in the asynchronous mode on this
    machine, the cores the searchers do not reserve (else the trainer starves them and keeps
    stepping on ever staler samples)."""
    sc = config.searchers
    if config.policy.num_threads:
        return config.policy.num_threads
    if config.train.mode == "async" and config.ray.address is None:
        return max(1, (os.cpu_count() or 1) - math.ceil(sc.count * sc.num_cpus))
    return None


def build_trainer(config: RunConfig, policy_dir: Path, tokenizer, device) -> Trainer:
    return Trainer(
        load_model(str(policy_dir), device),
        pad_id=tokenizer.pad_token_id,
        temperature=config.policy.temperature,
        learning_rate=config.train.learning_rate,
        warmup_steps=config.train.warmup_steps,
        max_grad_norm=config.train.max_grad_norm,
        loss=config.train.loss,
        clip_eps=config.train.clip_eps,
    )


@contextmanager
def stop_on_interrupt() -> Iterator[threading.Event]:
    """The first Ctrl-C asks the loop to stop after the current step; a second one aborts."""
    stop = threading.Event()

    def handler(signum, frame) -> None:
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()

    if threading.current_thread() is not threading.main_thread():
        yield stop  # signals only reach the main thread
        return
    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield stop
    finally:
        signal.signal(signal.SIGINT, previous)


def train(config: RunConfig, console: Console | None = None) -> Path:
    console = console or Console(stderr=True)
    threads = trainer_threads(config)
    if threads:
        torch.set_num_threads(threads)
    policy_dir = resolve_policy(config.policy.model, config.pretrain, config.seed, console.log)
    run_dir = create_run_dir(config.output_dir)
    (run_dir / "config.yaml").write_text(dump_config(config))
    seed_everything(config.seed)
    tokenizer = AutoTokenizer.from_pretrained(policy_dir)
    task = build_task(
        config.task.name, num_train=config.task.num_train, num_eval=config.task.num_eval,
        seed=config.seed,
    )  # fmt: skip
    trainer = build_trainer(config, policy_dir, tokenizer, resolve_device(config.policy.device))
    events = EventLog(run_dir / "events.jsonl", console.log)
    console.log(f"run directory: {run_dir} ({config.train.mode} mode)")
    try:
        # Searcher processes start while the base policy is evaluated here.
        with open_searchers(config, policy_dir, tokenizer, task, events) as searchers:
            base = evaluate(trainer.model, tokenizer, task, config, pass_k=True)
            console.log("base policy: " + ", ".join(f"{k} {v:.3f}" for k, v in base.items()))
            with stop_on_interrupt() as stop:
                loop = _train_loop(config, trainer, searchers, tokenizer, task, run_dir, console,
                                   events, base, stop)  # fmt: skip
        final = evaluate(trainer.model, tokenizer, task, config, pass_k=True)
    finally:
        events.close()
    with MetricsLog(run_dir / "metrics.jsonl") as metrics:
        metrics.write({"step": trainer.step_count, "time": loop["train_minutes"] * 60, **final})
    summary = {"base": base, "final": final, **loop}
    save_results(run_dir, summary, trainer.model, tokenizer)
    console.log("final policy: " + ", ".join(f"{k} {v:.3f}" for k, v in final.items()))
    return run_dir


def _train_loop(
    config: RunConfig,
    trainer: Trainer,
    searchers,
    tokenizer,
    task: Task,
    run_dir: Path,
    console: Console,
    events: EventLog,
    base: dict[str, float],
    stop: threading.Event,
) -> dict:
    """Steps until `max_steps`, `max_minutes` or Ctrl-C; returns the run summary."""
    tc = config.train
    buffer = ReplayBuffer(config.buffer.capacity, config.buffer.per_prompt_capacity)
    feed = DataFeed(config, searchers, trainer, buffer)
    rng = np.random.default_rng(config.seed)
    beta_at = BetaSchedule(tc.beta, tc.beta_end, tc.beta_start_frac, tc.beta_end_frac)
    max_seconds = tc.max_minutes * 60 if tc.max_minutes else float("inf")
    snapshot_every = config.eval.snapshot_minutes * 60 if config.eval.snapshot_minutes else None
    staleness_hist: Counter[int] = Counter()
    waiting = Counter()  # seconds after warm-up: waited for data, synced, evaluated, in total
    last_eval = base
    progress = Progress(
        TextColumn("[bold]train"), BarColumn(), TextColumn("step {task.completed:.0f}"),
        TimeElapsedColumn(), TextColumn("{task.fields[status]}"), console=console,
        transient=False,
    )  # fmt: skip
    with MetricsLog(run_dir / "metrics.jsonl") as metrics, progress:
        metrics.write({"step": 0, "time": 0.0, **base})
        bar = progress.add_task("train", total=tc.max_steps, status="filling the buffer")
        start = time.time()
        warmup_seconds = feed.start(stop)
        next_snapshot = snapshot_every
        for step in range(1, tc.max_steps + 1):
            elapsed = time.time() - start
            if elapsed >= max_seconds or stop.is_set():
                break
            step_start = time.time()
            record: dict = {"step": step, **feed.before_step(step, stop)}
            if len(buffer) == 0:  # interrupted while waiting for data
                break
            groups = buffer.sample(
                tc.num_prompts, tc.group_size, rng, recent_prob=config.buffer.recent_prob,
                reward_weight=config.buffer.reward_weight,
                reward_temperature=config.buffer.reward_temperature,
            )  # fmt: skip
            lags = [trainer.version - s.version for g in groups for s in g]
            staleness_hist.update(lags)
            beta = beta_at(max((step - 1) / tc.max_steps, elapsed / max_seconds))
            record |= {
                "beta": beta,
                "reward_mean": float(np.mean([s.reward for g in groups for s in g])),
                **trainer.step(groups, beta),
                "buffer_size": len(buffer),
                "staleness_mean": float(np.mean(lags)),
                "staleness_max": max(lags),
            }
            waiting["wait"] += record["wait_seconds"]
            waiting["sync"] += record["sync_seconds"]
            if step % config.eval.every == 0:
                eval_start = time.time()
                last_eval = evaluate(trainer.model, tokenizer, task, config, pass_k=False)
                record |= last_eval
                waiting["eval"] += time.time() - eval_start
            now = time.time()
            waiting["total"] += now - step_start
            record |= {
                "time": now - start,
                "step_seconds": now - step_start,
                "trainer_wait_frac": (waiting["wait"] + waiting["sync"]) / waiting["total"],
            }
            if next_snapshot is not None and now - start >= next_snapshot:
                record["snapshot"] = save_snapshot(run_dir, trainer.weights(), step)
                next_snapshot += snapshot_every
            metrics.write(record)
            progress.update(
                bar, completed=step,
                status=f"reward {record['reward_mean']:.2f}  pass@1 {last_eval['eval_pass@1']:.3f}",
            )  # fmt: skip
        train_seconds = time.time() - start
        if snapshot_every is not None:  # the policy as the run ends, too
            snapshot = save_snapshot(run_dir, trainer.weights(), trainer.step_count)
            metrics.write({"step": trainer.step_count, "time": train_seconds, "snapshot": snapshot})
    if stop.is_set():
        events("interrupted", step=trainer.step_count)
    return {
        "mode": tc.mode,
        "steps": trainer.step_count,
        "train_minutes": train_seconds / 60,
        "interrupted": stop.is_set(),
        "warmup_seconds": warmup_seconds,
        # Of the trainer's time after warm-up (evaluation included): waiting for data and syncing.
        "trainer_wait_frac": (waiting["wait"] + waiting["sync"]) / max(waiting["total"], 1e-9),
        "trainer_sync_frac": waiting["sync"] / max(waiting["total"], 1e-9),
        "eval_frac": waiting["eval"] / max(waiting["total"], 1e-9),
        "staleness_histogram": {str(lag): n for lag, n in sorted(staleness_hist.items())},
        "samples_merged": feed.merged,
        "samples_per_s": feed.merged / max(train_seconds, 1e-9),
        "evicted_stale": feed.stale_evicted,
        "evicted_capacity": feed.capacity_evicted,
        "searcher_restarts": getattr(searchers, "restarts", 0),
    }


def save_results(run_dir: Path, summary: dict, model, tokenizer) -> None:
    """eval.json, the trained policy in final/, and the curves plot."""
    (run_dir / "eval.json").write_text(json.dumps(summary, indent=2))
    model.save_pretrained(run_dir / "final")
    tokenizer.save_pretrained(run_dir / "final")
    plot_curves(read_metrics(run_dir / "metrics.jsonl"), run_dir / "curves.png", "tba train")
