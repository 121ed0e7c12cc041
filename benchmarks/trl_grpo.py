"""Train a policy on a tba task with TRL's `GRPOTrainer`: the built-in tiny policy on the embedded
math task, or a real model (a path, or `pypi:smollm2-135m-instruct` resolved as tba resolves it)
on the math task's word problems through its chat template or on a custom task (your rows and
`task.reward_funcs`, e.g. TRL's quickstart `reward_len`).

A reference point for the comparison benchmarks: the same base policy, prompts, reward and
generation budget as `tba train` with the same `key=value` settings, but every update made by
TRL. The prompts and the reward are tba's own: the task is built by `tba.tasks.load_task`, and its
reward functions are called through `tba.rewards.scorer`, as tba's searchers call them. Like the
project's runs, this one never pauses to evaluate; it saves the policy weights every
`--snapshot-minutes` of training time, and they are scored afterwards (`--score N` here, or the
caller), on the base policy first.

    python -m benchmarks.trl_grpo --out runs/trl --minutes 8 --learning-rate 5e-5
    python -m benchmarks.trl_grpo --out runs/trl2 --minutes 2 --learning-rate 1e-4 train.beta=0.02
    python -m benchmarks.trl_grpo --out runs/trl_math --minutes 30 --snapshot-minutes 5 \\
        --beta 0 --score 256 policy.model=pypi:smollm2-135m-instruct policy.chat_template=true \\
        task.name=math policy.max_new_tokens=64 policy.temperature=0.7 train.num_prompts=4 \\
        train.group_size=8 train.learning_rate=2e-5

Trailing `key=value` arguments are `tba` config overrides; the flags win over them.

How the project's settings map onto TRL (one process, TRL 1.x):

    project                          TRL
    B prompts x K responses / step   num_generations=K, per_device_train_batch_size=B*K,
                                     gradient_accumulation_steps=1, steps_per_generation=1,
                                     num_iterations=1
    policy.max_new_tokens (EOS in)   max_completion_length (EOS counts there too)
    policy.temperature               temperature (sampling, and the log-probs of the loss)
    policy.chat_template, or a       conversational prompts: TRL renders them with the model's
      conversational custom task     chat template, as tba does (a text prompt becomes one user
                                     turn, as tba sends it)
    train.beta (KL to frozen base)   beta (TRL then loads a frozen copy of the base); --beta
                                     sets TRL's alone (0, TRL's default: no reference model)
    train.truncated                  a wrapper around the task's reward functions (below)
    train.learning_rate, Adam        learning_rate, AdamW with weight_decay=0 (the same update),
                                     constant schedule after train.warmup_steps
    train.max_grad_norm              max_grad_norm
    train.clip_eps                   epsilon (never binds: the data is on-policy)

One optimizer step per B*K completions, on-policy: TRL samples one "generation batch" of
per_device_train_batch_size x steps_per_generation completions (B prompts, each repeated K
times by its sampler), splits it into steps_per_generation micro-batches, and steps the optimizer
every gradient_accumulation_steps micro-batches. With all three factors at 1, each step generates
B*K completions with the current weights and trains on exactly those once, so TRL's importance
ratio is exactly 1 (it skips the "old" log-prob pass) and clipping is inactive.

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
`mask_truncated_completions` leaves it out of the loss; `score`: the task's reward, as TRL's
default). TRL passes each completion's token ids to reward functions, ending with EOS when it
finished, which is what the wrapper checks.

On a CPU (TRL 1.16): `use_cpu=True`, `bf16=False`, `gradient_checkpointing=False` and the
tokenizer as `processing_class`; the model trains in fp32, as tba's policy does by default. LoRA
and quantization are refused: the snapshots hold the whole policy.

Where the time goes, per step, timed around TRL's own methods: `sampling_seconds` (its
`_generate`: the chat template, `model.generate`, decoding), `gen_seconds` (all of
`_prepare_inputs`: sampling, the rewards, the reference log-probs when beta > 0, the advantages;
what a tba searcher's generation also does), `train_seconds` (from there to the end of the step:
forward, backward, clipping, the optimizer) and `step_seconds` (since the end of the step before:
also TRL's logging and the snapshots).

Outputs in --out (which must not exist yet): config.yaml (the resolved `tba` config, for the
evaluation code), metrics.jsonl (a step 0 line, then one line per step as tba writes them: step,
seconds of training `time`, completions so far `samples`, this step's `samples_in`, `reward_in`
(their mean reward, truncation rule included) and `truncated_frac`, the timings above, and
`snapshot` on the steps that saved one), snapshots/stepNNNNNN.safetensors, trl_log.jsonl (TRL's
per-step logs), final/ (policy and tokenizer), eval.json (steps, minutes, learning rate,
completions generated per second, the timings' totals, the whole process's seconds) and, with
`--score N`, eval_snapshots.json (`benchmarks.heldout`).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
import warnings
from dataclasses import dataclass
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

from benchmarks.heldout import score_run
from tba.config import ConfigError, RunConfig, dump_config, load_config
from tba.core import Prompt, RewardFn, Task
from tba.policy.model import get_weights, load_model, resolve_device
from tba.quiet import quiet_libraries
from tba.rewards.scorer import RewardScorer
from tba.run_dir import MetricsLog, save_snapshot
from tba.tasks import load_task, resolve_policy

# A step budget no run reaches: the wall clock ends training (TimeBudget below).
MAX_STEPS = 10**9
TASKS = ("math", "custom")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="run directory (must not exist)")
    parser.add_argument("--minutes", type=float, required=True, help="wall-clock training time")
    parser.add_argument("--learning-rate", type=float, default=None,
                        help="(default: train.learning_rate)")  # fmt: skip
    parser.add_argument("--beta", type=float, default=None,
                        help="TRL's KL coefficient (default: train.beta); 0, TRL's own default, "
                        "loads no reference model")  # fmt: skip
    parser.add_argument("--max-steps", type=int, default=None,
                        help="also stop after this many optimizer steps")  # fmt: skip
    parser.add_argument("--snapshot-minutes", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--score", type=int, default=0, metavar="N",
                        help="after the run, score the snapshots on N held-out items "
                        "(benchmarks.heldout) into eval_snapshots.json")  # fmt: skip
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="tba config overrides")
    args = parser.parse_args(argv)
    if args.out.exists():
        parser.error(f"--out {args.out} already exists; choose a new run directory")
    if args.minutes <= 0 or args.snapshot_minutes <= 0:
        parser.error("--minutes and --snapshot-minutes must be positive")
    if args.learning_rate is not None and args.learning_rate <= 0:
        parser.error("--learning-rate must be positive")
    if args.beta is not None and args.beta < 0:
        parser.error("--beta must be 0 or more")
    if (args.max_steps is not None and args.max_steps < 1) or args.score < 0:
        parser.error("--max-steps must be positive and --score 0 or more")
    return args


def build_config(args: argparse.Namespace) -> RunConfig:
    """The `tba` config this run corresponds to, so that config.yaml describes it truthfully."""
    flags = [
        f"seed={args.seed}",
        f"train.max_minutes={args.minutes}",
        f"train.max_steps={args.max_steps or MAX_STEPS}",
        f"eval.snapshot_minutes={args.snapshot_minutes}",
        f"output_dir={args.out}",
    ]
    if args.learning_rate is not None:
        flags.append(f"train.learning_rate={args.learning_rate}")
    # float32 as the TRL runs train (`auto` could pick bfloat16); an override may say otherwise.
    config = load_config(None, ["policy.dtype=float32", *args.overrides, *flags])
    unsupported = {
        "train.beta_end (beta annealing)": config.train.beta_end is not None,
        "train.samples_per_prompt != group_size": config.train.samples_per_prompt
        not in (None, config.train.group_size),
        "lora.r > 0 (the snapshots hold the whole policy)": config.lora.r > 0,
        "quantization.bits > 0": config.quantization.bits > 0,
        f"policy.dtype={config.policy.dtype} (the TRL runs train in float32)":
            config.policy.dtype != "float32",
    }  # fmt: skip
    for name, present in unsupported.items():
        if present:
            raise ConfigError(f"{name} has no TRL GRPOTrainer counterpart in this benchmark")
    if config.task.name not in TASKS:
        raise ConfigError(f"task.name={config.task.name}: this benchmark runs the math task and "
                          "custom tasks (task.reward_funcs) only")  # fmt: skip
    return config


def beta_of(args: argparse.Namespace, config: RunConfig) -> float:
    return config.train.beta if args.beta is None else args.beta


class Completions:
    """What TRL generated: every completion is scored exactly once, by the reward below, which
    counts them and keeps each step's rewards and cut completions for its metrics line."""

    def __init__(self) -> None:
        self.count = 0
        self.rewards: list[float] = []  # this step's, of the completions that got one
        self.scored = 0  # this step's completions
        self.cut = 0  # of them, cut at the length limit

    def add(self, totals: list[float | None], cut: list[bool]) -> None:
        self.count += len(totals)
        self.scored += len(totals)
        self.rewards += [total for total in totals if total is not None]
        self.cut += sum(cut)

    def take_step(self) -> dict[str, float]:
        """This step's `samples_in`, `reward_in` (their mean reward) and `truncated_frac`, as tba
        names them; the next step starts from nothing."""
        record: dict[str, float] = {"samples_in": self.scored}
        if self.rewards:
            record["reward_in"] = math.fsum(self.rewards) / len(self.rewards)
        if self.scored:
            record["truncated_frac"] = self.cut / self.scored
        self.rewards, self.scored, self.cut = [], 0, 0
        return record


def make_reward(
    reward_fns: list[RewardFn],
    columns: list[str],
    eos_id: int,
    config: RunConfig,
    completions_made: Completions,
    wrapped: bool,
) -> RewardFn:
    """The project's reward as one TRL reward function: the sum of the task's reward functions,
    called on what tba's searchers give them (the task's own prompts; the completion's text,
    which tba's scorer shapes as TRL does for conversations), replaced for truncated completions
    as `train.truncated` says (see the module docstring). `wrapped`: the task's prompts are
    text that went to TRL as one user turn."""
    rule, penalty = config.train.truncated, config.train.truncation_penalty
    scorer = RewardScorer(reward_fns, weights=config.task.reward_weights,
                          timeout_s=config.searchers.reward_timeout_s,
                          max_failures=config.searchers.max_reward_failures)  # fmt: skip

    def task_reward(
        prompts: list[Prompt], completions: list, completion_ids: list[list[int]], **kwargs: Any
    ) -> list[float | None]:
        # TRL adds its own kwargs (trainer_state, log_metric, ...); the task sees its columns only.
        data = {key: kwargs[key] for key in columns}
        originals = [prompt[-1]["content"] if wrapped else prompt for prompt in prompts]
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        totals = [None if math.isnan(t) else t
                  for t in scorer.score(originals, texts, completion_ids, data).totals]
        cut = [not ids or ids[-1] != eos_id for ids in completion_ids]
        if rule != "score":
            totals = [(penalty if rule == "penalize" else None) if was_cut else total
                      for total, was_cut in zip(totals, cut)]  # fmt: skip
        completions_made.add(totals, cut)
        return totals

    return task_reward


def grpo_args(config: RunConfig, run_dir: Path, beta: float) -> GRPOConfig:
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
        beta=beta,
        epsilon=tc.clip_eps,
        mask_truncated_completions=tc.truncated == "drop",
        learning_rate=tc.learning_rate,
        lr_scheduler_type="constant_with_warmup",
        warmup_steps=tc.warmup_steps,
        weight_decay=0.0,
        max_grad_norm=tc.max_grad_norm,
        max_steps=tc.max_steps or MAX_STEPS,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        logging_steps=1,
    )


@dataclass
class StepTimes:
    """Seconds of the current step, by part (see the module docstring)."""

    sampling: float = 0.0
    batch: float = 0.0  # all of `_prepare_inputs`, sampling included
    batch_end: float | None = None  # perf_counter when the batch was ready

    def take(self, now: float) -> dict[str, float]:
        """This step's `sampling_seconds`, `gen_seconds` and `train_seconds` (from the batch to
        `now`, the step's end); the next step starts from nothing."""
        record = {"sampling_seconds": self.sampling, "gen_seconds": self.batch,
                  "train_seconds": now - self.batch_end if self.batch_end is not None else 0.0}
        self.sampling, self.batch, self.batch_end = 0.0, 0.0, None
        return record


class TimedGRPOTrainer(GRPOTrainer):
    """TRL's `GRPOTrainer`, timing its sampling and the making of each batch (`StepTimes`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.times = StepTimes()

    def _generate(self, prompts: list):
        start = time.perf_counter()
        try:
            return super()._generate(prompts)
        finally:
            self.times.sampling += time.perf_counter() - start

    def _prepare_inputs(self, generation_batch: dict[str, Any]) -> dict[str, Any]:
        start = time.perf_counter()
        inputs = super()._prepare_inputs(generation_batch)
        self.times.batch_end = time.perf_counter()
        self.times.batch += self.times.batch_end - start
        return inputs


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


class StepRecords(TrainerCallback):
    """One metrics.jsonl line per step, as tba writes them (see the module docstring), and the
    policy weights every `every_seconds` of training time in the project's format (safetensors
    of numpy arrays, named in that step's line), to be scored afterwards."""

    def __init__(
        self,
        run_dir: Path,
        model: PreTrainedModel,
        clock: TimeBudget,
        every_seconds: float,
        completions: Completions,
        times: StepTimes,
    ) -> None:
        self.run_dir = run_dir
        self.model = model
        self.clock = clock
        self.completions = completions
        self.times = times
        self.every = every_seconds
        self.next_due = every_seconds
        self.last_saved: int | None = None
        self.last_end: float | None = None
        self.metrics = MetricsLog(run_dir / "metrics.jsonl")
        self.metrics.write({"step": 0, "time": 0.0, "samples": 0})

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        self.last_end = time.perf_counter()

    def on_step_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        now = time.perf_counter()
        seconds = self.clock.elapsed()
        record = {"step": state.global_step, "time": seconds, "samples": self.completions.count,
                  **self.completions.take_step(), **self.times.take(now),
                  "step_seconds": now - self.last_end}  # fmt: skip
        if seconds >= self.next_due:
            record["snapshot"] = self.save(state.global_step)
            # Skip missed slots rather than saving several snapshots of one step.
            while self.next_due <= seconds:
                self.next_due += self.every
        self.metrics.write(record)
        self.last_end = time.perf_counter()

    def save(self, step: int) -> str:
        self.last_saved = step
        return save_snapshot(self.run_dir, get_weights(self.model), step)

    def on_train_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        # The policy as training ends, as `tba train` saves it too.
        if self.last_saved != state.global_step and state.global_step > 0:
            self.metrics.write({"step": state.global_step, "time": self.clock.elapsed(),
                                "samples": self.completions.count,
                                "snapshot": self.save(state.global_step)})  # fmt: skip
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


def trl_rows(task: Task, chat: bool) -> list[dict]:
    """The task's training rows as TRL reads them: with the chat template, a text prompt becomes
    one user turn (what tba renders for it), which TRL renders with the same template."""
    if not chat:
        return task.train_rows
    return [{**row, "prompt": [{"role": "user", "content": row["prompt"]}]}
            if isinstance(row["prompt"], str) else row for row in task.train_rows]  # fmt: skip


def make_trainer(
    config: RunConfig, task: Task, policy_dir: Path, run_dir: Path, completions: Completions,
    beta: float,
) -> TimedGRPOTrainer:  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(policy_dir)
    if tokenizer.pad_token is None:  # as tba pads: with EOS (every mask comes from lengths)
        tokenizer.pad_token = tokenizer.eos_token
    model = load_model(str(policy_dir), torch.device("cpu"))  # fp32; the Trainer places it
    chat = config.policy.chat_template or task.conversational
    wrapped = chat and isinstance(task.train_rows[0]["prompt"], str)
    columns = [key for key in task.train_rows[0] if key != "prompt"]
    reward = make_reward(task.reward_fns, columns, tokenizer.eos_token_id, config, completions,
                         wrapped)  # fmt: skip
    trainer = TimedGRPOTrainer(
        model=model,
        reward_funcs=[reward],
        args=grpo_args(config, run_dir, beta),
        train_dataset=Dataset.from_list(trl_rows(task, chat)),
        processing_class=tokenizer,
    )
    trainer.remove_callback(PrinterCallback)  # disable_tqdm=True prints every log dict instead
    trainer.add_callback(JsonlLog(run_dir / "trl_log.jsonl"))
    return trainer


def main(argv: list[str] | None = None) -> int:
    started = time.time()
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
    task = load_task(config.task, seed=config.seed, policy_model=config.policy.model,
                     cache_dir=config.pretrain.cache_dir)  # fmt: skip

    completions = Completions()
    trainer = make_trainer(config, task, policy_dir, run_dir, completions, beta_of(args, config))
    clock = TimeBudget(args.minutes * 60)
    # The base policy is scored from config.yaml's policy.model, like every later snapshot.
    records = StepRecords(run_dir, trainer.model, clock, args.snapshot_minutes * 60, completions,
                          trainer.times)  # fmt: skip
    # The clock's callbacks run first, so the records read the time at which it stopped training.
    trainer.add_callback(clock)
    trainer.add_callback(records)
    trainer.train()

    seconds = clock.elapsed()
    trainer.model.save_pretrained(run_dir / "final")
    trainer.processing_class.save_pretrained(run_dir / "final")
    summary = {
        "steps": trainer.state.global_step,
        "train_minutes": seconds / 60,
        "learning_rate": config.train.learning_rate,
        "beta": beta_of(args, config),
        "samples_per_s": completions.count / seconds,
        "completions": completions.count,
        "loss_type": trainer.args.loss_type,
        "trl_version": trl.__version__,
        "process_seconds": time.time() - started,
    }
    (run_dir / "eval.json").write_text(json.dumps(summary, indent=2))
    print(
        f"trl grpo: {summary['steps']} steps in {summary['train_minutes']:.2f} min, "
        f"{summary['samples_per_s']:.1f} samples/s"
    )
    if args.score:
        score_run(run_dir, args.score)
        print(f"trl grpo: snapshots scored on {args.score} held-out items: "
              f"{run_dir / 'eval_snapshots.json'}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
