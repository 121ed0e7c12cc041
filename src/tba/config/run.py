"""The whole configuration of a run (`RunConfig`): its sections, the top-level settings, held-out
evaluation (`eval`), checkpoints (`checkpoint`), and the rules across sections."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from tba.config.base import Section
from tba.config.devices import _check_searcher_devices
from tba.config.policy import LoraConfig, PolicyConfig, PretrainConfig, QuantizationConfig
from tba.config.runtime import BufferConfig, RayConfig, SearchersConfig, TrainerConfig
from tba.config.task import TaskConfig
from tba.config.train import TrainConfig
from tba.objectives import OBJECTIVES


class CheckpointConfig(Section):
    """Checkpoints in <run_dir>/checkpoints/: policy, optimizer, schedule, replay buffer, RNG
    states and searcher positions, enough for `tba train --resume RUN_DIR`."""

    every: int | None = Field(None, ge=1, description="save every N optimizer steps")
    every_minutes: float | None = Field(
        5.0, gt=0, description="save every N minutes of training (a checkpoint is also saved "
        "at exit, whatever these two say)",
    )
    keep: int = Field(2, ge=1, description="newest checkpoints kept; older ones are deleted")


class EvalConfig(Section):
    """Held-out evaluation: at the start and the end of a run, and on the way every
    `every_minutes` of training, or every `every` optimizer steps when that is set."""

    every: int | None = Field(
        None, ge=1, description="evaluate held-out greedy pass@1 every N optimizer steps "
        "(instead of every_minutes)",
    )
    every_minutes: Annotated[float, Field(gt=0)] | Literal["auto"] | None = Field(
        "auto", description="evaluate held-out greedy pass@1 every N minutes of training, "
        "when eval.every is null (a run of a given length is evaluated as often on a CPU as on "
        "a GPU; null: only at the start and the end); `auto`: every 0.5 minutes, but never "
        "before 9 times as long as the last evaluation took has passed since it (the first: "
        "from the base policy's), so that held-out evaluation takes at most about a tenth of "
        "the run whatever the model",
    )
    pass_k: int = Field(16, ge=1, description="k of the pass@k reported at start and end")
    batch_size: int = Field(
        256, ge=1, description="prompts generated at once in greedy pass@1 (pass@k: twice as "
        "many sequences)",
    )
    snapshot_minutes: float | None = Field(
        None, gt=0, description="also save the policy every N minutes of training to "
        "snapshots/, to evaluate after the run without pausing it",
    )


class RunConfig(Section):
    seed: int = Field(0, description="seeds data order, sampling and the base policy")
    output_dir: str | None = Field(None, description="run directory (default: runs/<timestamp>)")
    policy: PolicyConfig = PolicyConfig()
    pretrain: PretrainConfig = PretrainConfig()
    task: TaskConfig = TaskConfig()
    train: TrainConfig = TrainConfig()
    lora: LoraConfig = LoraConfig()
    quantization: QuantizationConfig = QuantizationConfig()
    buffer: BufferConfig = BufferConfig()
    searchers: SearchersConfig = SearchersConfig()
    trainer: TrainerConfig = TrainerConfig()
    ray: RayConfig = RayConfig()
    eval: EvalConfig = EvalConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    log_completions: bool = Field(
        False, description="write every new sample's prompt, completion, reward and reward "
        "parts to RUN_DIR/completions.jsonl",
    )
    report_to: list[Literal["tensorboard", "wandb", "trackio"]] = Field(
        [], description="also log metrics to these (`tensorboard`: event files in "
        "RUN_DIR/tensorboard, needs `pip install tensorboard`; `wandb`: a Weights & Biases run "
        "named after the run directory, files in RUN_DIR/wandb, project `WANDB_PROJECT` or "
        "`tba`, needs `pip install wandb`; `trackio`: a Trackio run named after the run "
        "directory, in Trackio's local store, project `TRACKIO_PROJECT` or `tba`, needs "
        "`pip install trackio`)",
    )

    @model_validator(mode="after")
    def _check_runtime(self) -> RunConfig:
        for rule in RUN_RULES:
            rule(self)
        return self


def _in_process_searcher_needs_sync(config: RunConfig) -> None:
    """An in-process searcher (searchers.count=0) generates between steps: the sync mode (which
    `train.mode=auto` then is)."""
    if config.train.mode == "async" and config.searchers.count == 0:
        raise ValueError("searchers.count=0 (in-process searcher) needs train.mode=sync")


def _lora_needs_one_rank(config: RunConfig) -> None:
    """Sharded trainer ranks train every weight; LoRA trains on one."""
    if config.trainer.world_size > 1 and config.lora.r > 0:
        raise ValueError("trainer.world_size > 1 shards full fine-tuning; LoRA (lora.r > 0) "
                         "trains on one rank: set trainer.world_size=1")  # fmt: skip


def _every_rank_needs_whole_groups(config: RunConfig) -> None:
    """Each trainer rank trains on whole groups: at least one prompt per rank."""
    ranks = config.trainer.world_size
    if ranks > config.train.num_prompts:
        raise ValueError(f"trainer.world_size={ranks} needs train.num_prompts >= {ranks}: "
                         "every rank trains on whole groups")  # fmt: skip


def _generation_baseline_needs_one_rank(config: RunConfig) -> None:
    """train.group_baseline=generation's extra forward passes run on one trainer process."""
    if config.train.group_baseline == "generation" and config.trainer.world_size > 1:
        raise ValueError("train.group_baseline=generation runs its extra forward passes on "
                         "one trainer process: set trainer.world_size=1, or "
                         "train.group_baseline=trained")  # fmt: skip


def _quantized_base_needs_an_engine_that_loads_it(config: RunConfig) -> None:
    """An engine that loads full weights of its own (vLLM's: its settings'
    `quantized_base` is false) cannot generate with a quantized base."""
    engine = config.searchers.engine
    if config.quantization.bits and not engine.quantized_base:
        raise ValueError(f"quantization.bits={config.quantization.bits}: the searchers' "
                         f"{engine.type} engine takes full weights; use searchers.engine=builtin, "
                         "or quantization.bits=0")  # fmt: skip


def _ppo_needs_one_rank(config: RunConfig) -> None:
    """A critic (PPO's: the objective's `Needs.critic`) is not sharded: it trains on one rank."""
    loss = config.train.loss
    if OBJECTIVES[loss].needs.critic and config.trainer.world_size > 1:
        raise ValueError(f"train.loss={loss} trains on one rank (its critic is not sharded): "
                         "set trainer.world_size=1")  # fmt: skip


def _critic_copy_needs_full_weights(config: RunConfig) -> None:
    """A separate critic LM is a copy of the whole policy: not with LoRA."""
    if (OBJECTIVES[config.train.loss].needs.critic and config.train.ppo.value_model == "critic"
            and config.lora.r > 0):  # fmt: skip
        raise ValueError("train.ppo.value_model=critic copies the whole policy; with LoRA "
                         "(lora.r > 0) use train.ppo.value_model=head")  # fmt: skip


def _eight_bit_adam_needs_one_rank(config: RunConfig) -> None:
    """bitsandbytes' 8-bit AdamW steps whole tensors: the sharded trainer's are shards."""
    if config.train.optimizer != "adamw" and config.trainer.world_size > 1:
        raise ValueError(f"train.optimizer={config.train.optimizer} trains on one rank (its "
                         "8-bit state is not sharded): set trainer.world_size=1, or "
                         "train.optimizer=adamw")  # fmt: skip


def _fresh_uses_need_generations_that_serve_several_steps(config: RunConfig) -> None:
    """buffer.fresh_uses > 1 (TRL's num_iterations) lets a generation serve several steps. The
    synchronous mode's `every_step` generates at every step, and the batch takes the newest fresh
    samples first: each step trains on its own new generation, and an older sample is drawn as
    fresh again only to fill a batch that its generation left short (rewards that failed), which
    replay does as well (`tba.runtime.feed.SyncFeed`, `tba.buffer`). `train.mode=auto` then
    decides async (`tba.run.with_concrete_mode`)."""
    uses, train = config.buffer.fresh_uses, config.train
    if uses > 1 and train.mode == "sync" and train.sync_generate == "every_step":
        raise ValueError(f"buffer.fresh_uses={uses} has no effect with train.mode=sync and "
                         "train.sync_generate=every_step: every step trains on the new "
                         "generation it makes, never a second pass over the last one; set "
                         f"train.sync_generate=when_needed (a generation then serves {uses} "
                         "passes), or leave buffer.fresh_uses at 1")  # fmt: skip


def _transport_needs_searcher_processes(config: RunConfig) -> None:
    """A weight transport carries weights to searcher processes: the in-process searcher
    (searchers.count=0) takes them from the trainer directly."""
    transport = config.searchers.weight_transfer.type
    if config.searchers.count == 0 and transport != "auto":
        raise ValueError(f"searchers.weight_transfer={transport} carries weights to searcher "
                         "processes, and searchers.count=0 runs the searcher in the trainer's "
                         "process: remove the setting, or set searchers.count >= 1")  # fmt: skip


# RunConfig's cross-section rules, checked in this order (the searchers' devices last:
# `devices._check_searcher_devices`).
RUN_RULES = (
    _in_process_searcher_needs_sync,
    _lora_needs_one_rank,
    _every_rank_needs_whole_groups,
    _generation_baseline_needs_one_rank,
    _quantized_base_needs_an_engine_that_loads_it,
    _ppo_needs_one_rank,
    _critic_copy_needs_full_weights,
    _eight_bit_adam_needs_one_rank,
    _fresh_uses_need_generations_that_serve_several_steps,
    _transport_needs_searcher_processes,
    _check_searcher_devices,
)
