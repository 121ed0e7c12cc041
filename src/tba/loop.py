"""The training loop (`TrainLoop`): the steps of a run, from its first step to its limit.

Data flows one way: prompts -> searchers -> buffer -> trainer -> weights -> searchers. Every step
brings new samples in (`tba.runtime.feed`, the one place the synchronous and asynchronous modes
differ, and where both are described), samples a batch from the buffer, sets beta by its
schedule, takes one optimizer step and records it: the step's metrics, how stale the batch was
and what it was made of (`tba.tally`). On the way the loop evaluates the policy on held-out
prompts, saves snapshots of it, and writes checkpoints (`tba.checkpoint`) of its `state_dict()`,
every component's state in one dict. `tba.run.train` wires what the loop steps and runs it.
"""

from __future__ import annotations

import itertools
import signal
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from tba import evaluation
from tba.buffer import ReplayBuffer
from tba.checkpoint import Checkpoint, list_checkpoints, save_checkpoint
from tba.config import RunConfig, TrainConfig
from tba.core import Task
from tba.errors import CheckpointError, RunError, TrainingError, first_line
from tba.eval_schedule import EvalSchedule
from tba.evaluation import EvalFaults, EvalSettings
from tba.limits import step_limit
from tba.objectives import ROW_MEAN_GROUP_OBJECTIVES, BetaSchedule
from tba.peak_memory import PeakMemory
from tba.policy.model import snapshot_weights
from tba.rng import RandomState
from tba.run_dir import EventLog, MetricsLog, Replacement, SampleLog, save_snapshot
from tba.runtime.feed import make_feed
from tba.runtime.ray_trainer import RankedTrainer
from tba.runtime.searchers import Searchers
from tba.tally import Tally
from tba.tracking import Trackers
from tba.trainer import Trainer


def evaluate(
    trainer: Trainer | RankedTrainer, tokenizer, task: Task, config: RunConfig,
    faults: EvalFaults, *, pass_k: bool,
) -> dict[str, float]:  # fmt: skip
    """The task's held-out metrics of the trainer's policy (`pass_k`: the costly ones too)."""
    settings = EvalSettings.from_config(config, pass_k, step=trainer.step_count, on_fault=faults)
    metrics = evaluation.evaluate(trainer.model, tokenizer, task, settings)
    faults.evaluation_done()
    return metrics


class TrainLoop:
    """Steps until `max_steps` (or `num_epochs`), `max_minutes` or Ctrl-C, whichever comes first
    (the default job: `max_minutes` alone), evaluating and checkpointing on the way.

    Everything the run carries from step to step is in `state_dict()`, so that a run resumed from
    a checkpoint continues with the same weights, buffer, sampler, counters and clock.
    `base_seconds`: how long the base policy's evaluation took (`eval.every_minutes=auto` times
    the first evaluation on the way by it); None for a resumed run, whose checkpoint says when
    the next one is due."""

    def __init__(
        self,
        config: RunConfig,
        trainer: Trainer | RankedTrainer,
        searchers: Searchers,
        random_state: RandomState,
        tokenizer,
        task: Task,
        run_dir: Path,
        events: EventLog,
        trackers: Trackers | None,
        base: dict[str, float],
        faults: EvalFaults,
        checkpoint: Checkpoint | None = None,
        *,
        base_seconds: float | None = None,
    ) -> None:
        self.config, self.trainer, self.searchers = config, trainer, searchers
        self.random = random_state
        self.tokenizer, self.task, self.run_dir, self.events = tokenizer, task, run_dir, events
        self.trackers, self.base, self.faults = trackers, base, faults
        tc = config.train
        self.buffer = ReplayBuffer.from_config(config.buffer)
        self.feed = make_feed(config, searchers, trainer, self.buffer, events)
        self.sample_logs = []
        if task.export_samples:
            self.sample_logs.append(SampleLog(run_dir / task.export_samples, tokenizer,
                                              annotate=task.annotate))  # fmt: skip
        if config.log_completions:
            prompts = [row["prompt"] for row in task.train_rows]
            self.sample_logs.append(SampleLog(run_dir / "completions.jsonl", tokenizer,
                                              distinct=False, prompts=prompts))  # fmt: skip
        for log in self.sample_logs:
            self.feed.on_merge.append(lambda samples, log=log: log.write(samples,
                                                                         trainer.step_count))
        self.beta_at = BetaSchedule(tc.beta, tc.beta_end, tc.beta_start_frac, tc.beta_end_frac)
        self.max_seconds = tc.max_minutes * 60 if tc.max_minutes else float("inf")
        self.max_steps = step_limit(tc, len(task.train_rows))
        minutes = config.eval.snapshot_minutes
        self.snapshot_every = minutes * 60 if minutes else None
        self.next_snapshot = self.snapshot_every
        self.evals = EvalSchedule(config, task, base_seconds)
        minutes = config.checkpoint.every_minutes
        self.checkpoint_every = minutes * 60 if minutes else None
        self.next_checkpoint = self.checkpoint_every
        self.tally = Tally()
        # This process's memory: the trainer's, and the in-process searcher's when there is one.
        # A sharded trainer's ranks are other processes.
        self.memory = (PeakMemory(next(trainer.model.parameters()).device)
                       if trainer.trains_here else None)  # fmt: skip
        self.peak_memory_mib = 0.0
        self.last_eval = base
        self.elapsed = 0.0  # training seconds of the earlier processes of this run
        self.warmup_seconds = 0.0
        self.nonfinite_in_a_row = 0
        self.checkpoint_failures = 0
        self.train_seconds = 0.0
        self.stopped_by_user = False
        self.stopped_by: str | None = None  # the signal that stopped the run (SIGINT, SIGTERM)
        self.checkpointing_note: str | None = None  # the trainer's, as last said
        # The run this one replaces, set aside until this one has its first checkpoint.
        self.replacement: Replacement | None = None
        if checkpoint is not None:
            try:
                self.load_state_dict(checkpoint.state)
            except (RuntimeError, KeyError, ValueError) as error:
                raise CheckpointError(
                    f"checkpoint {checkpoint.path} does not fit this run: {first_line(error)}"
                ) from None

    # ------------------------------------------------------------------------------ the loop

    def run(self, console: Console, stop: threading.Event) -> None:
        progress = Progress(
            TextColumn("train", style="bold", markup=False), BarColumn(),
            TextColumn("step {task.completed:.0f}", markup=False), TimeElapsedColumn(),
            # Metric names come from the task (a custom task names its own): text, not markup.
            TextColumn("{task.fields[status]}", markup=False), console=console, transient=False,
        )  # fmt: skip
        first_step = self.trainer.step_count + 1
        with MetricsLog(self.run_dir / "metrics.jsonl", self.trackers) as metrics, progress:
            if first_step == 1:
                metrics.write({"step": 0, "time": 0.0, **self.base})
            bar = progress.add_task("train", total=self.max_steps, completed=first_step - 1,
                                    status="filling the buffer")  # fmt: skip
            self.start = time.time() - self.elapsed
            if not self.at_limit(self.elapsed):  # else resumed only to be evaluated and saved
                self.warmup_seconds += self.feed.start(stop)
            last = self.max_steps  # None: no step limit, the clock ends the run
            steps = itertools.count(first_step) if last is None else range(first_step, last + 1)
            for step in steps:
                if time.time() - self.start >= self.max_seconds or stop.is_set():
                    break
                record = self._step(step, stop)
                if record is None:  # interrupted while waiting for data
                    break
                if note := self._checkpointing_changed():
                    console.log(note)
                if self.next_snapshot is not None and record["time"] >= self.next_snapshot:
                    if snapshot := self._snapshot(step):
                        record["snapshot"] = snapshot
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
            # The policy as the run ends, too.
            if self.snapshot_every is not None and (snapshot := self._snapshot(
                    self.trainer.step_count)):  # fmt: skip
                metrics.write({"step": self.trainer.step_count, "time": self.train_seconds,
                               "snapshot": snapshot})  # fmt: skip
        self.save_checkpoint(self.trainer.step_count)
        for log in self.sample_logs:
            log.close()
        self.stopped_by_user = stop.is_set()
        if self.stopped_by_user:
            number = getattr(stop, "signal", None)
            self.stopped_by = signal.Signals(number).name if number else None
            self.events("interrupted", step=self.trainer.step_count, signal=self.stopped_by)

    def _step(self, step: int, stop: threading.Event) -> dict | None:
        """Bring data in, sample a batch, set beta, take one optimizer step; the step's metrics."""
        tc, trainer = self.config.train, self.trainer
        step_start = time.time()
        elapsed = step_start - self.start
        if self.memory is not None:
            self.memory.reset()
        arrived = self.feed.before_step(step, stop)
        if arrived is None:
            return None
        record: dict = {"step": step, **arrived}
        batch = self.buffer.sample(tc.num_prompts, tc.group_size, self.random.sampler,
                                   context=whole_generation_groups(tc))  # fmt: skip
        made_of = self.tally.batch(batch, trainer)  # before the step moves the trainer's clock
        done = (step - 1) / self.max_steps if self.max_steps else 0.0
        beta = self.beta_at(max(done, elapsed / self.max_seconds))
        record |= {
            "beta": beta,
            "reward_mean": float(np.mean([s.reward for group in batch.groups for s in group])),
            **trainer.step(batch.groups, beta, batch.context),
            "buffer_size": len(self.buffer),
            **made_of,
        }
        eval_seconds = 0.0
        if self.evals.due(step, time.time() - self.start):
            eval_start = time.time()
            self.last_eval = evaluate(trainer, self.tokenizer, self.task, self.config, self.faults,
                                      pass_k=False)  # fmt: skip
            record |= self.last_eval
            eval_seconds = time.time() - eval_start
            self.evals.evaluated(time.time() - self.start, eval_seconds)
        now = time.time()
        wait_frac = self.tally.time(wait=record["wait_seconds"], sync=record["sync_seconds"],
                                    eval=eval_seconds, total=now - step_start)  # fmt: skip
        if self.memory is not None:
            record["peak_memory_mib"] = self.memory.peak_mib()
            self.peak_memory_mib = max(self.peak_memory_mib, record["peak_memory_mib"])
        return record | {
            "time": now - self.start, "step_seconds": now - step_start,
            "trainer_wait_frac": wait_frac,
        }  # fmt: skip

    def _checkpointing_changed(self) -> str | None:
        """The trainer's gradient-checkpointing decision, when it is new since the last step
        (`Trainer.checkpointing_note`: made at the first step, made again when a later step
        turns checkpointing on). A sharded trainer's ranks decide in their own processes."""
        note = getattr(self.trainer, "checkpointing_note", None)
        if note == self.checkpointing_note:
            return None
        self.checkpointing_note = note
        return note

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

    def _snapshot(self, step: int) -> str | None:
        """The policy now, to evaluate after the run; a failed write is logged, not fatal."""
        try:
            return save_snapshot(self.run_dir, snapshot_weights(self.trainer.model), step)
        except OSError as error:
            self.events("snapshot_failed", step=step, error=str(error))
            return None

    # ---------------------------------------------------------------------------- checkpoints

    def save_checkpoint(self, step: int) -> Path | None:
        """A checkpoint of this moment. A failed write (a full disk) is logged and counted, and
        the run goes on with its earlier checkpoints intact; without any, it stops at once: a run
        that cannot save anything would train for nothing."""
        try:
            path = save_checkpoint(self.run_dir, step, self.state_dict(),
                                   keep=self.config.checkpoint.keep)  # fmt: skip
        except OSError as error:
            self.checkpoint_failures += 1
            self.events("checkpoint_failed", step=step, error=str(error))
            if not list_checkpoints(self.run_dir):
                raise RunError(f"cannot write a checkpoint ({error}), and the run has none: "
                               "free space, or choose another output_dir, and start it "
                               "again") from None  # fmt: skip
            return None
        self.events("checkpoint", step=step, path=str(path))
        if self.replacement is not None:  # this run has something to lose now: the old one goes
            self.replacement.discard()
        return path

    def at_limit(self, seconds: float) -> bool:
        """Whether the run has reached its step limit, or its time limit after `seconds` of
        training."""
        return seconds >= self.max_seconds or (self.max_steps is not None
                                               and self.trainer.step_count >= self.max_steps)

    def state_dict(self) -> dict[str, Any]:
        """The run at this step: every component's `state_dict()` under its name, the loop's own
        clock and counters, and the config and base metrics it started from."""
        return {
            "config": self.config.model_dump(),
            "base": self.base,
            "trainer": self.trainer.state_dict(),
            "buffer": self.buffer.state_dict(),
            "searchers": self.searchers.state_dict(),
            "feed": self.feed.state_dict(),
            "rng": self.random.state_dict(),
            "tally": self.tally.state_dict(),
            "loop": {
                "elapsed": time.time() - self.start,
                "warmup_seconds": self.warmup_seconds,
                "last_eval": self.last_eval,
                "next_snapshot": self.next_snapshot,
                "next_checkpoint": self.next_checkpoint,
                "next_eval": self.evals.next,
                "peak_memory_mib": self.peak_memory_mib,
                "nonfinite_in_a_row": self.nonfinite_in_a_row,
                "checkpoint_failures": self.checkpoint_failures,
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a `state_dict()`. The searchers took theirs as they started
        (`open_searchers`); `train` reads the config and base metrics before the loop exists."""
        self.trainer.load_state_dict(state["trainer"])
        self.buffer.load_state_dict(state["buffer"])
        self.feed.load_state_dict(state["feed"])
        self.random.load_state_dict(state["rng"])
        self.tally.load_state_dict(state["tally"])
        loop = state["loop"]
        self.elapsed, self.warmup_seconds = loop["elapsed"], loop["warmup_seconds"]
        self.last_eval, self.next_snapshot = loop["last_eval"], loop["next_snapshot"]
        self.next_checkpoint = loop["next_checkpoint"]
        self.evals.next = loop.get("next_eval", self.evals.next)  # older checkpoints have none
        self.peak_memory_mib = loop.get("peak_memory_mib", 0.0)
        self.nonfinite_in_a_row = loop["nonfinite_in_a_row"]
        self.checkpoint_failures = loop["checkpoint_failures"]

    # -------------------------------------------------------------------------------- summary

    def summary(self) -> dict[str, Any]:
        """What eval.json reports about the run (the searchers closed: their leftovers counted)."""
        counts, searchers = self.feed.counts, self.searchers
        generated = searchers.total_generated()
        return {
            "mode": self.config.train.mode,
            "steps": self.trainer.step_count,
            "train_minutes": self.train_seconds / 60,
            "interrupted": self.stopped_by_user,
            "stopped_by": self.stopped_by,
            "warmup_seconds": self.warmup_seconds,
            **self.tally.summary(),
            "samples_generated": generated if generated is not None else counts["merged"],
            "samples_merged": counts["merged"],
            "rollouts_generated": counts["rollouts"],  # VinePPO's, for its values
            "samples_per_s": counts["merged"] / max(self.train_seconds, 1e-9),
            "samples_discarded_in_flight": searchers.discarded_in_flight,
            "samples_duplicated": counts["duplicates"],
            "samples_lost": counts["lost"],
            "evicted_stale": counts["stale_evicted"],
            "evicted_capacity": counts["capacity_evicted"],
            "reward_dropped": counts["reward_dropped"],
            "reward_unscored": counts["reward_unscored"],
            "reward_faults": dict(self.feed.reward_faults),
            "nonfinite_steps_skipped": self.trainer.skipped_steps,
            "checkpoint_failures": self.checkpoint_failures,
            "searcher_restarts": searchers.restarts,
            # The most one step held at once in this process (device memory on CUDA, RSS on a
            # CPU); None with a sharded trainer.
            "peak_memory_mib": self.peak_memory_mib if self.memory is not None else None,
        }


def whole_generation_groups(train: TrainConfig) -> bool:
    """Whether a fresh group's statistics take in the samples of its generation that the step
    does not train on (`train.group_baseline=generation`, with S > K, for an objective with
    group statistics)."""
    return (train.group_baseline == "generation" and train.loss in ROW_MEAN_GROUP_OBJECTIVES
            and (train.samples_per_prompt or train.group_size) > train.group_size)  # fmt: skip
