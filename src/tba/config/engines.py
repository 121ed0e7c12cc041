"""What searchers generate with (`searchers.engine`): one section whose `type` names an engine
(`tba.policy.engines`) and whose other settings are that engine's alone.
`searchers.engine=vllm` is short for `searchers.engine.type=vllm`.

`ENGINE_SETTINGS` maps each `type` to its settings class; an engine added elsewhere registers its
own (`tba.policy.engines.register_engine`), and the section is validated against the class its
`type` names, as a union discriminated on `type` would be. What the rest of a run must know of an
engine is said by its settings class, never by its name: the GPUs one engine spans (`gpus`) and
whether it loads a quantized base (`quantized_base`)."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field

from tba.config.base import Section, kind_settings


class EngineSettings(Section):
    """An engine's settings: `type` names it; the rest are its own."""

    shorthand = "type"
    type: str = Field("builtin", description="the engine (`builtin`, `vllm`)")
    # Whether the engine generates with a quantized base (`quantization.bits`) as the searcher
    # loaded it; an engine that loads full weights of its own cannot.
    quantized_base: ClassVar[bool] = True
    # The setting that makes `gpus()` more than 1, named where those GPUs are not there.
    gpus_key: ClassVar[str | None] = None

    @classmethod
    def variants(cls) -> dict[str, type[Section]]:
        return dict(ENGINE_SETTINGS)

    def gpus(self) -> int:
        """The whole GPUs one engine spans, each searcher reserving that many: 1, the device of
        its searcher."""
        return 1

    def gpus_named(self) -> str:
        """The setting that makes the engine span `gpus()` GPUs, as an error line names it
        (`searchers.engine.tensor_parallel_size=2`)."""
        if self.gpus_key is None:
            return f"searchers.engine={self.type}"
        return f"searchers.engine.{self.gpus_key}={getattr(self, self.gpus_key)}"


class BuiltinEngineSettings(EngineSettings):
    """tba's KV-cache sampler over the searcher's own model (its path: `policy.sampler`)."""

    type: Literal["builtin"] = Field(
        "builtin", description="`builtin`: tba's KV-cache sampler over the searcher's own model, "
        "by the path policy.sampler chooses (the faster on a CPU)",
    )


class VllmEngineSettings(EngineSettings):
    """vLLM as the searchers' engine: one engine in each searcher process (docs/engines.md)."""

    type: Literal["vllm"] = Field(
        "vllm", description="`vllm`: a vLLM engine in each searcher, for GPUs (`pip install "
        "'tba[vllm]'`)",
    )
    gpu_memory_utilization: float = Field(
        0.3, gt=0, le=1, description="share of the device's memory the engine takes for weights "
        "and KV cache (on vLLM's CPU backend: the share of RAM for the KV cache)",
    )
    kv_cache_gb: float | None = Field(
        None, gt=0, description="the KV cache's size in GiB, instead of a share of memory "
        "(default: the share on a GPU; 1 GiB on vLLM's CPU backend, where the share is of RAM "
        "less what the process already holds)",
    )
    max_model_len: int | None = Field(
        None, ge=1, description="prompt + response tokens a sequence may hold (default: the "
        "model's own limit)",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="the engine's weights (`auto`: policy.dtype)"
    )
    tensor_parallel_size: int = Field(
        1, ge=1, description="GPUs one engine spans: whole GPUs, that many reserved by each "
        "searcher (searchers.num_gpus, which `auto` sets to it)",
    )
    enforce_eager: bool = Field(
        False, description="no CUDA graphs (less start-up time and memory, slower decoding)"
    )

    # It loads the policy's full weights from its directory, and takes full weights at a sync.
    quantized_base: ClassVar[bool] = False
    gpus_key: ClassVar[str | None] = "tensor_parallel_size"

    def gpus(self) -> int:
        return self.tensor_parallel_size


ENGINE_SETTINGS: dict[str, type[EngineSettings]] = {
    settings.model_fields["type"].default: settings
    for settings in (BuiltinEngineSettings, VllmEngineSettings)
}


def register_engine_settings(name: str, settings: type[EngineSettings]) -> None:
    """Let `searchers.engine.type=name` select an engine added elsewhere."""
    ENGINE_SETTINGS[name] = settings


def engine_settings(value: Any, key: str = "searchers.engine") -> Any:
    """A `searchers.engine` value as its engine's settings (`kind_settings`): a name alone stands
    for the section `{type: name}`; a mapping is validated against the class its `type` names.
    What is wrong is a `ValueError` of one line naming the setting under `key`."""
    return kind_settings(EngineSettings, value, key, "engine")
