"""Where samples wait and who makes them: the replay buffer (`buffer`), the searchers
(`searchers`, with their engine `searchers.engine` and their weight transport
`searchers.weight_transfer`), the trainer's processes (`trainer`) and Ray (`ray`)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, SerializeAsAny, field_validator, model_validator

from tba.config.aliases import rename_engine_keys
from tba.config.base import Section, expand_shorthand
from tba.config.devices import Device
from tba.config.engines import BuiltinEngineSettings, EngineSettings, engine_settings
from tba.config.transfer import AutoTransfer, TransferSettings, transfer_settings


class BufferConfig(Section):
    capacity: int = Field(20000, ge=1, description="samples kept; oldest weight version evicted")
    per_prompt_capacity: int | None = Field(None, ge=1, description="samples kept per prompt")
    recent_prob: float = Field(
        1.0, ge=0, le=1, description="m: probability a group is made of fresh samples (never "
        "trained on, newest weights first); otherwise, or when none is left, a replay group",
    )
    reward_weight: float = Field(
        0.0, ge=0, le=1, description="replay: weight of softmax(r/T) against uniform"
    )
    reward_temperature: float = Field(1.0, gt=0, description="replay: T in softmax(r/T)")
    dedup: Literal["none", "exact", "near"] = Field(
        "none", description="a response that duplicates one of its prompt's (`exact`: same "
        "tokens; `near`: same set of tokens) replaces it if its reward is higher, else is dropped",
    )
    max_staleness: int | None = Field(
        None, ge=0, description="drop samples of weights published more than this many optimizer "
        "steps ago (the newest published weights are always kept)",
    )
    fresh_uses: int = Field(
        1, ge=1, description="times a sample is drawn as fresh before it is only replayed "
        "(TRL's num_iterations: each generation serves that many passes, the least-used "
        "samples first; in the synchronous mode with train.sync_generate=when_needed, a "
        "generation comes once they are used up)",
    )


class SearchersConfig(Section):
    """The processes that generate and score samples (Ray actors)."""

    engine: SerializeAsAny[EngineSettings] = Field(
        BuiltinEngineSettings(), description="what searchers generate with: an engine's name "
        "(`searchers.engine=vllm`), or its section with its own settings "
        "(`searchers.engine.type=vllm searchers.engine.gpu_memory_utilization=0.5`); each `type` "
        "and its settings are listed below (docs/engines.md)",
    )

    count: int = Field(
        1, ge=0, description="searcher processes; 0 runs one searcher inside the trainer "
        "process, without Ray (sync mode only; train.mode=auto may make the default 0, see "
        "there)",
    )
    prompts_per_batch: int | None = Field(
        None, ge=1, description="prompts per generation batch of each searcher (async), or "
        "per generation in all (sync: one a step, or as train.sync_generate says) (default: B)",
    )
    temperature: float | None = Field(
        None, gt=0, description="sampling temperature of the searchers, for exploration "
        "(default: policy.temperature); the losses still take log-probs at policy.temperature",
    )
    max_unsent_samples: int = Field(
        4096, ge=1, description="async: a searcher pauses while this many of its samples "
        "wait for the trainer",
    )
    num_cpus: float = Field(1.0, gt=0, description="Ray CPUs reserved per searcher")
    num_gpus: Annotated[float, Field(ge=0)] | Literal["auto"] = Field(
        "auto", description="Ray GPUs reserved per searcher; `auto`: of this machine's GPUs "
        "less the trainer's (its policy.device, or its ranks'), one each (or as many as the "
        "engine spans: a vLLM engine's tensor_parallel_size), or 1 / ceil(count / free GPUs) of "
        "one when the searchers outnumber them; with one GPU, 1 / (count + 1) of it each beside "
        "the trainer; else (no GPU, a cluster's ray.address, searchers.device=cpu) 0 "
        "(docs/cluster.md)",
    )
    num_threads: int | None = Field(
        None, ge=1, description="torch CPU threads per searcher (default: num_cpus, at least 1)"
    )
    device: Device = Field("auto", description="searcher device, as policy.device")
    weight_transfer: SerializeAsAny[TransferSettings] = Field(
        AutoTransfer(), description="how published weights reach the searcher processes: a "
        "transport's name (`searchers.weight_transfer=broadcast`), or its section with its own "
        "settings (`searchers.weight_transfer.type=shared searchers.weight_transfer.sets=1`); "
        "each `type` and its settings are listed below",
    )
    max_restarts: int = Field(
        5, ge=0, description="restarts allowed per searcher before the run fails"
    )
    reward_timeout_s: float = Field(
        60.0, gt=0, description="a reward function call that takes longer fails: its "
        "completions are dropped and counted",
    )
    max_reward_failures: int = Field(
        5, ge=1, description="a reward function that fails on this many calls in a row stops "
        "the run",
    )

    @model_validator(mode="before")
    @classmethod
    def _old_names(cls, data: Any) -> Any:
        """The vLLM engine's settings by their old names (`searchers.vllm.*`) go to the engine's
        section, with a notice; with another engine they are dropped (they never had an effect
        there): config files and run directories written before the rename load as they did."""
        if not isinstance(data, dict) or "vllm" not in data:
            return data
        data = dict(data)
        engine = data.get("engine", cls.model_fields["engine"].default)
        if isinstance(engine, EngineSettings):  # a copy, to move settings into
            engine = {"type": engine.type, **engine.model_dump(exclude_unset=True)}
        data["engine"] = dict(expand_shorthand(EngineSettings, engine))
        default = EngineSettings.model_fields["type"].default
        rename_engine_keys(data, data["engine"].get("type", default))
        return data

    @field_validator("engine", mode="before")
    @classmethod
    def _engine(cls, value: Any) -> Any:
        return engine_settings(value)

    @field_validator("weight_transfer", mode="before")
    @classmethod
    def _transport(cls, value: Any) -> Any:
        return transfer_settings(value)


class TrainerConfig(Section):
    """Where the trainer runs: in this process (`world_size` 1), or as `world_size` processes
    that shard the policy, its gradients and Adam's state with FSDP2, placed by Ray on this
    machine or across a cluster (docs/sharding.md)."""

    world_size: int = Field(
        1, ge=1, description="trainer processes (ranks) sharding the policy; 1: this process "
        "holds all of it",
    )
    num_cpus: float = Field(1.0, gt=0, description="Ray CPUs reserved per rank")
    num_gpus: float = Field(
        0.0, ge=0, description="Ray GPUs reserved per rank: ranks with a GPU train on it "
        "(NCCL), the others on their CPU (gloo)",
    )
    num_threads: int | None = Field(
        None, ge=1, description="torch threads per rank (default: its num_cpus)"
    )


class RayConfig(Section):
    address: str | None = Field(
        None, description="an existing Ray cluster to join (default: start a local instance "
        "on loopback and stop it at exit)",
    )
    num_cpus: int | None = Field(
        None, ge=1, description="CPUs of the local instance (default: this machine's, and at "
        "least what the searchers reserve)",
    )
    sync_timeout_s: float = Field(
        120.0, gt=0, description="a searcher that does not answer a weight sync or a "
        "collection, or a trainer rank a step or a publish, within this many seconds fails "
        "the run",
    )
    start_timeout_s: float = Field(
        600.0, gt=0, description="a searcher process or trainer rank that is not up (its "
        "model loaded) within this many seconds fails the run",
    )
