"""`tba train`: wire task, searchers, buffer and trainer, and record everything in a run directory.

Data flows one way: prompts -> searchers -> buffer -> trainer -> weights -> searchers.

- **async** (TBA): the searchers generate without pause, each with the latest weights it has
  adopted. The trainer starts once the buffer holds `train.initial_buffer_samples`; then every
  step it merges what the searchers made since the step before, samples a batch (fresh samples
  first, replay when none are left) and steps; every `train.sync_every` steps it publishes its
  weights. It never waits on a generation in flight.
- **sync** (on-policy baseline, same components): every step the searchers generate B prompts with
  the weights published last, the trainer waits for them and trains on a batch sampled from the
  buffer (with the default `recent_prob=1` and `sync_every=1`: exactly the samples just made).

How the data reaches the buffer is `tba.runtime.feed` (`SyncFeed`, `AsyncFeed`); each step records
how stale the batch was (weight versions, and optimizer steps since its weights were published),
how many of its groups were fresh, reused or identical to one of the step before.

The trainer runs in this process; the searchers run as Ray actors (`searchers.count >= 1`) or, in
the synchronous mode with `searchers.count=0`, inside this process without Ray. The loop writes
checkpoints (`tba.checkpoint`) as it goes and at exit; `train(..., resume=True)` continues the run
in `output_dir` from its newest one.
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

from tba import evaluation
from tba.base_policy import resolve_policy
from tba.buffer import ReplayBuffer
from tba.checkpoint import (
    Checkpoint,
    check_compatible,
    latest_checkpoint,
    restore_rng_states,
    rng_states,
    save_checkpoint,
)
from tba.config import ConfigError, RunConfig, dump_config
from tba.errors import CheckpointError, TrainingError
from tba.evaluation import EvalSettings
from tba.objectives import BetaSchedule
from tba.policy.model import load_policy, resolve_device, save_policy, snapshot_weights
from tba.policy.tokenizer import load_tokenizer
from tba.rundir import (
    EventLog,
    MetricsLog,
    SampleLog,
    create_run_dir,
    plot_curves,
    read_metrics,
    require_tensorboard,
    save_snapshot,
    truncate_metrics,
)
from tba.runtime.feed import make_feed
from tba.runtime.searchers import open_searchers
from tba.tasks import Task, load_task
from tba.trainer import Trainer


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def evaluate(model, tokenizer, task: Task, config: RunConfig, *, pass_k: bool) -> dict[str, float]:
    return evaluation.evaluate(model, tokenizer, task, EvalSettings.from_config(config, pass_k))


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
        load_policy(
            str(policy_dir), device, dtype=config.policy.dtype, lora=config.lora,
            gradient_checkpointing=config.train.gradient_checkpointing,
        ),  # fmt: skip
        pad_id=tokenizer.pad_token_id,
        temperature=config.policy.temperature,
        learning_rate=config.train.learning_rate,
        warmup_steps=config.train.warmup_steps,
        max_grad_norm=config.train.max_grad_norm,
        loss=config.train.loss,
        clip_eps=config.train.clip_eps,
        trust_region=config.train.trust_region,
        log_z=config.train.log_z,
        log_z_lr=config.train.log_z_lr,
        micro_batch_groups=config.train.micro_batch_groups,
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


def train(
    config: RunConfig, console: Console | None = None, *, resume: bool = False,
    overwrite: bool = False, task: Task | None = None,
) -> Path:
    """Train as `config` says, in `config.output_dir`; `resume`: continue the run there from its
    newest checkpoint; `overwrite`: replace a run already there; `task`: train on this task
    instead of the one `config.task` describes (the Python API's own data and rewards)."""
    console = console or Console(stderr=True)
    threads = trainer_threads(config)
    if threads:
        torch.set_num_threads(threads)
    # The data first: a bad file or row stops the run before any model is loaded.
    if task is None:
        task = load_task(config.task, seed=config.seed, policy_model=config.policy.model,
                         cache_dir=config.pretrain.cache_dir, log=console.log)  # fmt: skip
    if task.conversational and not config.policy.chat_template:
        raise ConfigError("the prompts are conversational: set policy.chat_template=true")
    if "tensorboard" in config.report_to:
        require_tensorboard()
    policy_dir = resolve_policy(config.policy.model, config.pretrain, config.seed, console.log)
    checkpoint = None
    if resume:
        run_dir = Path(config.output_dir)
        checkpoint = latest_checkpoint(run_dir)
        check_compatible(checkpoint.state["config"], config.model_dump(), checkpoint.path)
        truncate_metrics(run_dir / "metrics.jsonl", checkpoint.step)
    else:
        run_dir = create_run_dir(config.output_dir, overwrite)
    (run_dir / "config.yaml").write_text(dump_config(config))
    seed_everything(config.seed)
    tokenizer = load_tokenizer(str(policy_dir), chat_template=config.policy.chat_template)
    trainer = build_trainer(config, policy_dir, tokenizer, resolve_device(config.policy.device))
    if checkpoint is not None:
        restore_trainer(trainer, checkpoint)
    events = EventLog(run_dir / "events.jsonl", console.log)
    console.log(f"run directory: {run_dir} ({config.train.mode} mode)")
    restored = checkpoint.state["searchers"] if checkpoint else None
    try:
        # Searcher processes start while the base policy is evaluated here.
        with open_searchers(config, policy_dir, tokenizer, task, events, run_dir,
                            restored) as searchers:  # fmt: skip
            if checkpoint is None:
                base = evaluate(trainer.model, tokenizer, task, config, pass_k=True)
            else:
                base = checkpoint.state["base"]
                events("resumed", step=checkpoint.step, checkpoint=checkpoint.path.name,
                       discarded_in_flight=searchers.discarded_in_flight)  # fmt: skip
            console.log("base policy: " + ", ".join(f"{k} {v:.3f}" for k, v in base.items()))
            with stop_on_interrupt() as stop:
                loop = TrainLoop(config, trainer, searchers, tokenizer, task, run_dir, events,
                                 base, checkpoint)  # fmt: skip
                loop.run(console, stop)
        final = evaluate(trainer.model, tokenizer, task, config, pass_k=True)
    finally:
        events.close()
    summary = {"base": base, "final": final, **loop.summary(searchers)}
    with MetricsLog(run_dir / "metrics.jsonl", tensorboard_dir(config, run_dir)) as metrics:
        metrics.write({"step": trainer.step_count, "time": summary["train_minutes"] * 60, **final})
    save_results(run_dir, summary, trainer.model, tokenizer, task.metrics)
    console.log("final policy: " + ", ".join(f"{k} {v:.3f}" for k, v in final.items()))
    return run_dir


def tensorboard_dir(config: RunConfig, run_dir: Path) -> Path | None:
    return run_dir / "tensorboard" if "tensorboard" in config.report_to else None


def restore_trainer(trainer: Trainer, checkpoint: Checkpoint) -> None:
    try:
        trainer.load_state_dict(
            checkpoint.model, checkpoint.optimizer, checkpoint.state["trainer"]
        )
    except (RuntimeError, KeyError, ValueError) as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
        raise CheckpointError(
            f"checkpoint {checkpoint.path} does not fit this policy: {first}"
        ) from None


class TrainLoop:
    """Steps until `max_steps`, `max_minutes` or Ctrl-C, checkpointing on the way.

    Everything it carries from step to step is in `state()`, so that a run resumed from a
    checkpoint continues with the same buffer, sampler, counters and clock."""

    def __init__(
        self,
        config: RunConfig,
        trainer: Trainer,
        searchers,
        tokenizer,
        task: Task,
        run_dir: Path,
        events: EventLog,
        base: dict[str, float],
        checkpoint: Checkpoint | None,
    ) -> None:
        self.config, self.trainer, self.searchers = config, trainer, searchers
        self.tokenizer, self.task, self.run_dir, self.events = tokenizer, task, run_dir, events
        self.base = base
        tc = config.train
        self.buffer = ReplayBuffer.from_config(config.buffer)
        if checkpoint is not None:
            self.buffer.load_state_dict(checkpoint.buffer_state)
        self.feed = make_feed(config, searchers, trainer, self.buffer, events)
        self.sample_log = None
        if task.export_samples:
            self.sample_log = SampleLog(run_dir / task.export_samples, tokenizer, task.annotate)
            self.feed.on_merge = lambda samples: self.sample_log.write(samples, trainer.step_count)
        self.rng = np.random.default_rng(config.seed)
        self.beta_at = BetaSchedule(tc.beta, tc.beta_end, tc.beta_start_frac, tc.beta_end_frac)
        self.max_seconds = tc.max_minutes * 60 if tc.max_minutes else float("inf")
        minutes = config.eval.snapshot_minutes
        self.snapshot_every = minutes * 60 if minutes else None
        self.next_snapshot = self.snapshot_every
        minutes = config.checkpoint.every_minutes
        self.checkpoint_every = minutes * 60 if minutes else None
        self.next_checkpoint = self.checkpoint_every
        self.staleness: Counter[int] = Counter()  # weight versions behind, per trained sample
        self.staleness_steps: Counter[int] = Counter()  # optimizer steps behind, per sample
        self.groups: Counter[str] = Counter()  # fresh, reused, repeated; identical batches
        self.waiting: Counter[str] = Counter()  # after warm-up: waited, synced, evaluated, total
        self.last_eval = base
        self.elapsed = 0.0  # training seconds of the earlier processes of this run
        self.warmup_seconds = 0.0
        self.nonfinite_in_a_row = 0
        self.checkpoint_failures = 0
        self.train_seconds = 0.0
        self.stopped_by_user = False
        if checkpoint is not None:
            self._restore(checkpoint.state)

    # ------------------------------------------------------------------------------ the loop

    def run(self, console: Console, stop: threading.Event) -> None:
        tc = self.config.train
        progress = Progress(
            TextColumn("[bold]train"), BarColumn(), TextColumn("step {task.completed:.0f}"),
            TimeElapsedColumn(), TextColumn("{task.fields[status]}"), console=console,
            transient=False,
        )  # fmt: skip
        first_step = self.trainer.step_count + 1
        board = tensorboard_dir(self.config, self.run_dir)
        with MetricsLog(self.run_dir / "metrics.jsonl", board) as metrics, progress:
            if first_step == 1:
                metrics.write({"step": 0, "time": 0.0, **self.base})
            bar = progress.add_task("train", total=tc.max_steps, completed=first_step - 1,
                                    status="filling the buffer")  # fmt: skip
            self.start = time.time() - self.elapsed
            self.warmup_seconds += self.feed.start(stop)
            for step in range(first_step, tc.max_steps + 1):
                if time.time() - self.start >= self.max_seconds or stop.is_set():
                    break
                record = self._step(step, stop)
                if record is None:  # interrupted while waiting for data
                    break
                if self.next_snapshot is not None and record["time"] >= self.next_snapshot:
                    record["snapshot"] = self._snapshot(step)
                    self.next_snapshot += self.snapshot_every
                metrics.write(record)
                self._after_step(step, record)
                progress.update(
                    bar, completed=step,
                    status=f"reward {record['reward_mean']:.2f}  " + "  ".join(
                        f"{name.removeprefix('eval_')} {self.last_eval[name]:.3f}"
                        for name in self.task.metrics if name in self.last_eval
                    ),
                )  # fmt: skip
            self.train_seconds = time.time() - self.start
            if self.snapshot_every is not None:  # the policy as the run ends, too
                snapshot = self._snapshot(self.trainer.step_count)
                metrics.write({"step": self.trainer.step_count, "time": self.train_seconds,
                               "snapshot": snapshot})  # fmt: skip
        self.save_checkpoint(self.trainer.step_count)
        if self.sample_log is not None:
            self.sample_log.close()
        self.stopped_by_user = stop.is_set()
        if self.stopped_by_user:
            self.events("interrupted", step=self.trainer.step_count)

    def _step(self, step: int, stop: threading.Event) -> dict | None:
        """Bring data in, sample a batch, take one optimizer step; the step's metrics."""
        tc, trainer = self.config.train, self.trainer
        step_start = time.time()
        elapsed = step_start - self.start
        record: dict = {"step": step, **self.feed.before_step(step, stop)}
        if len(self.buffer) == 0:
            return None
        batch = self.buffer.sample(tc.num_prompts, tc.group_size, self.rng)
        samples = [s for g in batch.groups for s in g]
        lags = [trainer.version - s.version for s in samples]
        lags_steps = [trainer.steps_behind(s.version) for s in samples]
        self.staleness.update(lags)
        self.staleness_steps.update(lags_steps)
        self.groups.update(trained=len(batch.groups), fresh=batch.fresh, reused=batch.reused,
                           repeated=batch.repeated,
                           identical_batches=batch.repeated == len(batch.groups))  # fmt: skip
        beta = self.beta_at(max((step - 1) / tc.max_steps, elapsed / self.max_seconds))
        record |= {
            "beta": beta,
            "reward_mean": float(np.mean([s.reward for s in samples])),
            **trainer.step(batch.groups, beta),
            "buffer_size": len(self.buffer),
            "staleness_mean": float(np.mean(lags)),
            "staleness_max": max(lags),
            "staleness_steps_mean": float(np.mean(lags_steps)),
            "staleness_steps_max": max(lags_steps),
            "fresh_groups": batch.fresh,
            "reused_groups": batch.reused,
            "repeated_groups": batch.repeated,
        }
        self.waiting["wait"] += record["wait_seconds"]
        self.waiting["sync"] += record["sync_seconds"]
        if step % self.config.eval.every == 0:
            eval_start = time.time()
            self.last_eval = evaluate(trainer.model, self.tokenizer, self.task, self.config,
                                      pass_k=False)  # fmt: skip
            record |= self.last_eval
            self.waiting["eval"] += time.time() - eval_start
        now = time.time()
        self.waiting["total"] += now - step_start
        wait_frac = (self.waiting["wait"] + self.waiting["sync"]) / self.waiting["total"]
        return record | {
            "time": now - self.start, "step_seconds": now - step_start,
            "trainer_wait_frac": wait_frac,
        }  # fmt: skip

    def _after_step(self, step: int, record: dict) -> None:
        """Non-finite steps and periodic checkpoints."""
        if record["skipped"]:
            self.nonfinite_in_a_row += 1
            self.events("nonfinite_step", step=step, loss=record["loss"],
                        grad_norm=record["grad_norm"])  # fmt: skip
            limit = self.config.train.max_nonfinite_steps
            if self.nonfinite_in_a_row >= limit:
                path = self.save_checkpoint(step)
                kept = f"; the last good state is in {path}" if path else ""
                raise TrainingError(
                    f"the loss or the gradient was not finite on {limit} steps in a row "
                    f"(train.max_nonfinite_steps){kept}"
                )
        else:
            self.nonfinite_in_a_row = 0
        every = self.config.checkpoint.every
        due = self.next_checkpoint is not None and record["time"] >= self.next_checkpoint
        if due or (every is not None and step % every == 0):
            self.save_checkpoint(step)
        if due:
            self.next_checkpoint += self.checkpoint_every

    def _snapshot(self, step: int) -> str:
        return save_snapshot(self.run_dir, snapshot_weights(self.trainer.model), step)

    # ---------------------------------------------------------------------------- checkpoints

    def save_checkpoint(self, step: int) -> Path | None:
        """A checkpoint of this moment; a failed write (a full disk) is logged and counted, and
        the run goes on with its earlier checkpoints intact."""
        model, optimizer, trainer_state = self.trainer.state_dict()
        state = {
            "config": self.config.model_dump(),
            "base": self.base,
            "trainer": trainer_state,
            "searchers": self.searchers.state(),
            "feed": self.feed.state_dict(),
            "rng": rng_states(self.rng),
            "loop": self.state(),
        }
        try:
            path = save_checkpoint(
                self.run_dir, step, model=model, optimizer=optimizer, buffer=self.buffer,
                state=state, keep=self.config.checkpoint.keep,
            )  # fmt: skip
        except OSError as error:
            self.checkpoint_failures += 1
            self.events("checkpoint_failed", step=step, error=str(error))
            return None
        self.events("checkpoint", step=step, path=str(path))
        return path

    def state(self) -> dict:
        return {
            "elapsed": time.time() - self.start,
            "warmup_seconds": self.warmup_seconds,
            "staleness": {str(lag): n for lag, n in self.staleness.items()},
            "staleness_steps": {str(lag): n for lag, n in self.staleness_steps.items()},
            "groups": dict(self.groups),
            "waiting": dict(self.waiting),
            "last_eval": self.last_eval,
            "next_snapshot": self.next_snapshot,
            "next_checkpoint": self.next_checkpoint,
            "nonfinite_in_a_row": self.nonfinite_in_a_row,
            "checkpoint_failures": self.checkpoint_failures,
        }

    def _restore(self, state: dict) -> None:
        loop = state["loop"]
        self.elapsed, self.warmup_seconds = loop["elapsed"], loop["warmup_seconds"]
        self.staleness = Counter({int(lag): n for lag, n in loop["staleness"].items()})
        self.staleness_steps = Counter(
            {int(lag): n for lag, n in loop["staleness_steps"].items()}
        )
        self.groups = Counter(loop["groups"])
        self.waiting = Counter(loop["waiting"])
        self.last_eval, self.next_snapshot = loop["last_eval"], loop["next_snapshot"]
        self.next_checkpoint = loop["next_checkpoint"]
        self.nonfinite_in_a_row = loop["nonfinite_in_a_row"]
        self.checkpoint_failures = loop["checkpoint_failures"]
        self.feed.load_state_dict(state["feed"])
        restore_rng_states(self.rng, state["rng"])

    # -------------------------------------------------------------------------------- summary

    def summary(self, searchers) -> dict:
        """What eval.json reports about the run (the searchers closed: their leftovers counted)."""
        total = max(self.waiting["total"], 1e-9)
        counts = self.feed.counts
        generated = searchers.total_generated()
        return {
            "mode": self.config.train.mode,
            "steps": self.trainer.step_count,
            "train_minutes": self.train_seconds / 60,
            "interrupted": self.stopped_by_user,
            "warmup_seconds": self.warmup_seconds,
            # Of the trainer's time after warm-up (evaluation included): waiting and syncing.
            "trainer_wait_frac": (self.waiting["wait"] + self.waiting["sync"]) / total,
            "trainer_sync_frac": self.waiting["sync"] / total,
            "eval_frac": self.waiting["eval"] / total,
            "staleness_histogram": {str(k): n for k, n in sorted(self.staleness.items())},
            "staleness_steps_histogram": {
                str(k): n for k, n in sorted(self.staleness_steps.items())
            },
            "staleness_steps_mean": _mean_of_histogram(self.staleness_steps),
            # Groups of fresh samples, groups whose every sample was trained on before, groups
            # identical to one of the step before, and whole batches trained twice in a row.
            "groups_trained": self.groups["trained"],
            "groups_fresh": self.groups["fresh"],
            "groups_reused": self.groups["reused"],
            "groups_repeated": self.groups["repeated"],
            "identical_batches": self.groups["identical_batches"],
            "samples_generated": generated if generated is not None else counts["merged"],
            "samples_merged": counts["merged"],
            "samples_per_s": counts["merged"] / max(self.train_seconds, 1e-9),
            "samples_discarded_in_flight": searchers.discarded_in_flight,
            "samples_duplicated": counts["duplicates"],
            "samples_lost": counts["lost"],
            "evicted_stale": counts["stale_evicted"],
            "evicted_capacity": counts["capacity_evicted"],
            "reward_dropped": counts["reward_dropped"],
            "reward_faults": dict(self.feed.reward_faults),
            "nonfinite_steps_skipped": self.trainer.skipped_steps,
            "checkpoint_failures": self.checkpoint_failures,
            "searcher_restarts": searchers.restarts,
        }


def _mean_of_histogram(histogram: Counter[int]) -> float:
    total = sum(histogram.values())
    return sum(k * n for k, n in histogram.items()) / total if total else 0.0


def save_results(
    run_dir: Path, summary: dict, model, tokenizer, metrics: tuple[str, ...] = ("eval_pass@1",)
) -> None:
    """eval.json, the trained policy in final/, and the curves plot."""
    (run_dir / "eval.json").write_text(json.dumps(summary, indent=2))
    save_policy(model, run_dir / "final")
    tokenizer.save_pretrained(run_dir / "final")
    plot_curves(read_metrics(run_dir / "metrics.jsonl"), run_dir / "curves.png", "tba train",
                metrics)  # fmt: skip
