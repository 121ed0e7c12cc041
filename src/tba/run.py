"""`tba train`: wire task, searcher, buffer and trainer, and record everything in a run directory.

Data flows one way: prompts -> searcher -> buffer -> trainer -> weights -> searcher. In the
synchronous on-policy mode each step generates a batch with the latest weights, adds it to the
buffer, trains on a batch sampled from the buffer (by default exactly the samples just made: the
most-on-policy branch with probability 1), and publishes the new weights.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from transformers import AutoTokenizer

from tba.base_policy import resolve_policy
from tba.buffer import ReplayBuffer, batch_staleness
from tba.config import RunConfig, dump_config
from tba.evaluation import greedy_pass_at_1, sampled_pass_at_k
from tba.objectives import BetaSchedule
from tba.policy.model import load_model, resolve_device
from tba.rundir import MetricsLog, create_run_dir, plot_curves, read_metrics
from tba.searcher import Searcher, SearchSettings
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


def build_searcher(config: RunConfig, policy_dir: Path, tokenizer, task: Task, device) -> Searcher:
    tc = config.train
    settings = SearchSettings(
        samples_per_prompt=tc.samples_per_prompt or tc.group_size,
        temperature=config.policy.temperature,
        max_new_tokens=config.policy.max_new_tokens,
        truncated=tc.truncated,
        truncation_penalty=tc.truncation_penalty,
    )
    model = load_model(str(policy_dir), device)
    return Searcher(model, tokenizer, task.train_rows, task.reward_fns, settings, seed=config.seed)


def build_trainer(config: RunConfig, policy_dir: Path, tokenizer, device) -> Trainer:
    return Trainer(
        load_model(str(policy_dir), device),
        pad_id=tokenizer.pad_token_id,
        temperature=config.policy.temperature,
        learning_rate=config.train.learning_rate,
        warmup_steps=config.train.warmup_steps,
        max_grad_norm=config.train.max_grad_norm,
    )


def train(config: RunConfig, console: Console | None = None) -> Path:
    console = console or Console(stderr=True)
    if config.policy.num_threads:
        torch.set_num_threads(config.policy.num_threads)
    policy_dir = resolve_policy(config.policy.model, config.pretrain, config.seed, console.log)
    run_dir = create_run_dir(config.output_dir)
    (run_dir / "config.yaml").write_text(dump_config(config))
    seed_everything(config.seed)
    device = resolve_device(config.policy.device)

    tokenizer = AutoTokenizer.from_pretrained(policy_dir)
    task = build_task(
        config.task.name, num_train=config.task.num_train, num_eval=config.task.num_eval,
        seed=config.seed,
    )  # fmt: skip
    searcher = build_searcher(config, policy_dir, tokenizer, task, device)
    trainer = build_trainer(config, policy_dir, tokenizer, device)
    tc = config.train
    buffer = ReplayBuffer(config.buffer.capacity, config.buffer.per_prompt_capacity)
    rng = np.random.default_rng(config.seed)
    beta_at = BetaSchedule(tc.beta, tc.beta_end, tc.beta_start_frac, tc.beta_end_frac)

    console.log(f"run directory: {run_dir}")
    base = evaluate(trainer.model, tokenizer, task, config, pass_k=True)
    console.log("base policy: " + ", ".join(f"{k} {v:.3f}" for k, v in base.items()))
    metrics = MetricsLog(run_dir / "metrics.jsonl")
    metrics.write({"step": 0, "time": 0.0, **base})

    max_seconds = tc.max_minutes * 60 if tc.max_minutes else float("inf")
    start = time.time()
    last_eval = base
    progress = Progress(
        TextColumn("[bold]train"), BarColumn(), TextColumn("step {task.completed:.0f}"),
        TimeElapsedColumn(), TextColumn("{task.fields[status]}"), console=console,
        transient=False,
    )  # fmt: skip
    with progress:
        bar = progress.add_task("train", total=tc.max_steps, status="")
        for step in range(1, tc.max_steps + 1):
            elapsed = time.time() - start
            if elapsed >= max_seconds:
                break
            run_fraction = max((step - 1) / tc.max_steps, elapsed / max_seconds)
            if (step - 1) % tc.sync_every == 0:
                searcher.set_weights(*trainer.publish())
            samples, gen_stats = searcher.generate(tc.num_prompts)
            buffer.add(samples)
            # With recent_prob=1, sync_every=1 and S=K this is exactly the batch just generated.
            groups = buffer.sample(
                tc.num_prompts, tc.group_size, rng, recent_prob=config.buffer.recent_prob,
                reward_weight=config.buffer.reward_weight,
                reward_temperature=config.buffer.reward_temperature,
            )  # fmt: skip
            beta = beta_at(run_fraction)
            record = {
                "step": step,
                "beta": beta,
                "reward_mean": float(np.mean([s.reward for g in groups for s in g])),
                **trainer.step(groups, beta),
                **gen_stats,
                "buffer_size": len(buffer),
                **{
                    f"staleness_{k}": v for k, v in batch_staleness(groups, trainer.version).items()
                },
            }
            if step % config.eval.every == 0:
                last_eval = evaluate(trainer.model, tokenizer, task, config, pass_k=False)
                record |= last_eval
            record["time"] = time.time() - start
            metrics.write(record)
            progress.update(
                bar, completed=step,
                status=f"reward {record['reward_mean']:.2f}  pass@1 {last_eval['eval_pass@1']:.3f}",
            )  # fmt: skip

    final = evaluate(trainer.model, tokenizer, task, config, pass_k=True)
    metrics.write({"step": trainer.step_count, "time": time.time() - start, **final})
    metrics.close()
    summary = {"base": base, "final": final, "steps": trainer.step_count,
               "train_minutes": (time.time() - start) / 60}  # fmt: skip
    save_results(run_dir, summary, trainer.model, tokenizer)
    console.log("final policy: " + ", ".join(f"{k} {v:.3f}" for k, v in final.items()))
    return run_dir


def save_results(run_dir: Path, summary: dict, model, tokenizer) -> None:
    """eval.json, the trained policy in final/, and the curves plot."""
    (run_dir / "eval.json").write_text(json.dumps(summary, indent=2))
    model.save_pretrained(run_dir / "final")
    tokenizer.save_pretrained(run_dir / "final")
    plot_curves(read_metrics(run_dir / "metrics.jsonl"), run_dir / "curves.png", "tba train")
