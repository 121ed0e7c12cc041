"""Train the built-in tiny policy on the embedded math task with TRL's `GRPOTrainer`.

A reference point for the comparison benchmarks: the same base policy, prompts, reward and
generation budget as `tba train`, but every update made by TRL. Like the project's runs, this one
never pauses to evaluate; it saves the policy weights every `--snapshot-minutes` of training time,
and the caller scores the snapshots afterwards (step 0 holds the base weights).

    python -m benchmarks.trl_grpo --out runs/trl --minutes 8 --learning-rate 5e-5
    python -m benchmarks.trl_grpo --out runs/trl2 --minutes 2 --learning-rate 1e-4 train.beta=0.02

Trailing `key=value` arguments are `tba` config overrides; the flags win over them.

How the project's settings map onto TRL (one process, TRL 1.x):

    project                          TRL
    B prompts x K responses / step   num_generations=K, per_device_train_batch_size=B*K,
                                     gradient_accumulation_steps=1, steps_per_generation=1,
                                     num_iterations=1
    policy.max_new_tokens (EOS in)   max_completion_length (EOS counts there too)
    policy.temperature               temperature (sampling, and the log-probs of the loss)
    train.beta (KL to frozen base)   beta (TRL then loads a frozen copy of the base)
    train.truncation_penalty         a wrapper around the task's reward functions (below)
    train.learning_rate, Adam        learning_rate, AdamW with weight_decay=0 (the same update),
                                     constant schedule after train.warmup_steps
    train.max_grad_norm              max_grad_norm
    train.clip_eps                   epsilon (never binds: the data is on-policy)

One optimizer step per 128 completions, on-policy: TRL samples one "generation batch" of
per_device_train_batch_size x steps_per_generation completions (8 prompts, each repeated K=16
times by its sampler), splits it into steps_per_generation micro-batches, and steps the optimizer
every gradient_accumulation_steps micro-batches. With all three factors at 1, each step generates
B*K = 128 completions with the current weights and trains on exactly those once, so TRL's
importance ratio is exactly 1 (it skips the "old" log-prob pass) and clipping is inactive.

Loss: TRL's default `loss_type` ("dapo" in TRL 1.x: token losses summed over the batch and
divided by its number of completion tokens) with its default group-std advantage scaling. The KL
term is TRL's per-token "k3" estimator exp(ref - logp) - (ref - logp) - 1 (non-negative, unbiased
for KL(pi || pi_ref) on samples from pi), times the importance ratio (`use_bias_correction_kl`,
value 1 here, which makes its gradient the reverse-KL gradient), added to each token's loss with
weight beta. The project's GRPO baselines instead subtract beta * (log pi - log pi_ref) of the
whole sequence from the reward, so the same beta regularises with a different strength.

Truncation: as in the project, a completion that has not emitted EOS within max_new_tokens gets
reward `train.truncation_penalty` in place of the task's reward (`train.truncated=drop`: it gets
no reward, which TRL leaves out of the group baseline with advantage 0, and
`mask_truncated_completions` leaves it out of the loss). TRL passes each completion's token ids
to reward functions, ending with EOS when it finished, which is what the wrapper checks.

Outputs in --out (which must not exist yet): config.yaml (the resolved `tba` config, for the
evaluation code), metrics.jsonl (one line per snapshot: step, seconds of training, completions
so far, file), snapshots/step000000.safetensors and so on, trl_log.jsonl (TRL's per-step logs),
final/ (policy and tokenizer) and eval.json (steps, minutes, learning rate, completions generated
per second).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import trl
from datasets import Dataset
from transformers import (
    AutoTokenizer,
    PreTrainedModel,
    PrinterCallback,
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
)
from trl import GRPOConfig, GRPOTrainer

from tba.config import ConfigError, RunConfig, dump_config, load_config
from tba.core import RewardFn, Task
from tba.policy.model import get_weights, load_model, resolve_device
from tba.quiet import quiet_libraries
from tba.rewards.scorer import RewardScorer
from tba.run_dir import MetricsLog, save_snapshot
from tba.tasks import resolve_policy
from tba.tasks.math.task import math_task

# A step budget no run reaches: the wall clock ends training (TimeBudget below).
MAX_STEPS = 10**9


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="run directory (must not exist)")
    parser.add_argument("--minutes", type=float, required=True, help="wall-clock training time")
    parser.add_argument("--learning-rate", type=float, required=True)
    parser.add_argument("--snapshot-minutes", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="tba config overrides")
    args = parser.parse_args(argv)
    if args.out.exists():
        parser.error(f"--out {args.out} already exists; choose a new run directory")
    if args.minutes <= 0 or args.snapshot_minutes <= 0 or args.learning_rate <= 0:
        parser.error("--minutes, --snapshot-minutes and --learning-rate must be positive")
    return args


def build_config(args: argparse.Namespace) -> RunConfig:
    """The `tba` config this run corresponds to, so that config.yaml describes it truthfully."""
    flags = [
        f"seed={args.seed}",
        f"train.learning_rate={args.learning_rate}",
        f"train.max_minutes={args.minutes}",
        f"train.max_steps={MAX_STEPS}",
        f"eval.snapshot_minutes={args.snapshot_minutes}",
        f"output_dir={args.out}",
    ]
    config = load_config(None, [*args.overrides, *flags])
    unsupported = {
        "train.beta_end (beta annealing)": config.train.beta_end is not None,
        "train.samples_per_prompt != group_size": config.train.samples_per_prompt
        not in (None, config.train.group_size),
    }
    for name, present in unsupported.items():
        if present:
            raise ConfigError(f"{name} has no TRL GRPOTrainer counterpart in this benchmark")
    if config.task.name != "math":
        raise ConfigError(f"task.name={config.task.name}: this benchmark runs the math task only")
    return config


class CompletionCounter:
    """Completions scored so far: TRL scores every completion it generates, exactly once."""

    def __init__(self) -> None:
        self.count = 0


def make_reward(
    reward_fns: list[RewardFn],
    columns: list[str],
    eos_id: int,
    config: RunConfig,
    counter: CompletionCounter,
) -> RewardFn:
    """The project's reward as one TRL reward function: the sum of the task's reward functions,
    replaced for truncated completions as `train.truncated` says (see the module docstring)."""
    rule, penalty = config.train.truncated, config.train.truncation_penalty
    scorer = RewardScorer(reward_fns, weights=config.task.reward_weights,
                          timeout_s=config.searchers.reward_timeout_s,
                          max_failures=config.searchers.max_reward_failures)  # fmt: skip

    def task_reward(
        prompts: list[str], completions: list[str], completion_ids: list[list[int]], **kwargs: Any
    ) -> list[float | None]:
        # TRL adds its own kwargs (trainer_state, log_metric, ...); the task sees its columns only.
        data = {key: kwargs[key] for key in columns}
        totals = [None if math.isnan(t) else t
                  for t in scorer.score(prompts, completions, completion_ids, data).totals]
        for i, ids in enumerate(completion_ids):
            if rule != "score" and (not ids or ids[-1] != eos_id):  # no EOS: cut off
                totals[i] = penalty if rule == "penalize" else None
        counter.count += len(completions)
        return totals

    return task_reward


def grpo_args(config: RunConfig, run_dir: Path) -> GRPOConfig:
    tc = config.train
    return GRPOConfig(
        output_dir=str(run_dir / "trl"),
        seed=config.seed,
        data_seed=config.seed,
        # The project trains in fp32 and without recomputation; TRL defaults to bf16 and
        # gradient checkpointing, both slower on this tiny model and CPU.
        use_cpu=resolve_device(config.policy.device).type == "cpu",
        bf16=False,
        gradient_checkpointing=False,
        # One generation batch of B*K completions, one micro-batch, one optimizer step.
        num_generations=tc.group_size,
        per_device_train_batch_size=tc.num_prompts * tc.group_size,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_iterations=1,
        max_completion_length=config.policy.max_new_tokens,
        temperature=config.policy.temperature,
        beta=tc.beta,
        epsilon=tc.clip_eps,
        mask_truncated_completions=tc.truncated == "drop",
        learning_rate=tc.learning_rate,
        lr_scheduler_type="constant_with_warmup",
        warmup_steps=tc.warmup_steps,
        weight_decay=0.0,
        max_grad_norm=tc.max_grad_norm,
        max_steps=MAX_STEPS,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        logging_steps=1,
    )


class TimeBudget(TrainerCallback):
    """Ends training once `seconds` of it have passed; the clock starts as training begins."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.start: float | None = None
        self.end: float | None = None

    def elapsed(self) -> float:
        assert self.start is not None, "training has not started"
        return (self.end or time.time()) - self.start

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        self.start = time.time()

    def on_step_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        if self.elapsed() >= self.seconds:
            self.end = time.time()
            control.should_training_stop = True

    def on_train_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        if self.end is None:
            self.end = time.time()


class Snapshots(TrainerCallback):
    """Saves the policy weights every `every_seconds` of training time, in the project's format
    (safetensors of numpy arrays plus one metrics.jsonl line each, with the completions generated
    so far), to be scored afterwards."""

    def __init__(
        self,
        run_dir: Path,
        model: PreTrainedModel,
        clock: TimeBudget,
        every_seconds: float,
        counter: CompletionCounter,
    ) -> None:
        self.run_dir = run_dir
        self.model = model
        self.clock = clock
        self.counter = counter
        self.every = every_seconds
        self.next_due = every_seconds
        self.last_step: int | None = None
        self.metrics = MetricsLog(run_dir / "metrics.jsonl")

    def save(self, step: int, seconds: float) -> None:
        path = save_snapshot(self.run_dir, get_weights(self.model), step)
        record = {"step": step, "time": seconds, "samples": self.counter.count, "snapshot": path}
        self.metrics.write(record)
        self.last_step = step

    def on_step_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        seconds = self.clock.elapsed()
        if seconds >= self.next_due:
            self.save(state.global_step, seconds)
            # Skip missed slots rather than saving several snapshots of one step.
            while self.next_due <= seconds:
                self.next_due += self.every

    def on_train_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        # The policy as training ends, as `tba train` saves it too.
        if self.last_step != state.global_step:
            self.save(state.global_step, self.clock.elapsed())
        self.metrics.close()


class JsonlLog(TrainerCallback):
    """TRL's per-step logs (reward, KL, completion lengths, ...) to a file instead of stdout."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        with self.path.open("a") as file:
            file.write(json.dumps({"step": state.global_step, **(logs or {})}) + "\n")


def make_trainer(
    config: RunConfig, task: Task, policy_dir: Path, run_dir: Path, counter: CompletionCounter
) -> GRPOTrainer:
    tokenizer = AutoTokenizer.from_pretrained(policy_dir)
    model = load_model(str(policy_dir), torch.device("cpu"))  # fp32; the Trainer places it
    columns = [key for key in task.train_rows[0] if key != "prompt"]
    reward = make_reward(task.reward_fns, columns, tokenizer.eos_token_id, config, counter)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[reward],
        args=grpo_args(config, run_dir),
        train_dataset=Dataset.from_list(task.train_rows),
        processing_class=tokenizer,
    )
    trainer.remove_callback(PrinterCallback)  # disable_tqdm=True prints every log dict instead
    trainer.add_callback(JsonlLog(run_dir / "trl_log.jsonl"))
    return trainer


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        config = build_config(args)
    except ConfigError as error:  # one line and status 2, as `tba` reports bad input
        print(f"error: {error}", file=sys.stderr)
        return 2
    quiet_libraries()
    # transformers 5 flags TRL's use of `gradient_checkpointing` as deprecated: noise here.
    warnings.filterwarnings("ignore", category=FutureWarning)
    # TRL warns on every batch holding a completion without reward, which `train.truncated=drop`
    # produces on purpose; its errors still show.
    logging.getLogger("trl").setLevel(logging.ERROR)
    if config.policy.num_threads:
        torch.set_num_threads(config.policy.num_threads)
    run_dir: Path = args.out
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(dump_config(config))
    policy_dir = resolve_policy(config.policy.model, config.pretrain, config.seed, print)
    task = math_task(
        num_train=config.task.num_train, num_eval=config.task.num_eval, seed=config.seed
    )

    counter = CompletionCounter()
    trainer = make_trainer(config, task, policy_dir, run_dir, counter)
    clock = TimeBudget(args.minutes * 60)
    snapshots = Snapshots(run_dir, trainer.model, clock, args.snapshot_minutes * 60, counter)
    snapshots.save(0, 0.0)  # the base policy, scored like every later snapshot
    # The clock's callbacks run first, so snapshots read the time at which it stopped training.
    trainer.add_callback(clock)
    trainer.add_callback(snapshots)
    trainer.train()

    seconds = clock.elapsed()
    trainer.model.save_pretrained(run_dir / "final")
    trainer.processing_class.save_pretrained(run_dir / "final")
    summary = {
        "steps": trainer.state.global_step,
        "train_minutes": seconds / 60,
        "learning_rate": args.learning_rate,
        "samples_per_s": counter.count / seconds,
        "completions": counter.count,
        "loss_type": trainer.args.loss_type,
        "trl_version": trl.__version__,
    }
    (run_dir / "eval.json").write_text(json.dumps(summary, indent=2))
    print(
        f"trl grpo: {summary['steps']} steps in {summary['train_minutes']:.2f} min, "
        f"{summary['samples_per_s']:.1f} samples/s"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
