"""Generation engines: what a searcher samples its responses with. Each is one module with an
`Engine` (`base.py`: the interface, and what every engine returns) and a settings class of its
own (`tba.config.engines`), registered here under its name:

- `builtin` (`builtin.py`): tba's KV-cache sampler over the searcher's own model;
- `vllm` (`vllm.py`): a vLLM engine in the searcher's process.

`searchers.engine` names one (`searchers.engine.type`), with that engine's own settings. What the
rest of a run asks of an engine goes through this registry and the engine's settings class, never
its name: the searcher starts `ENGINES[type]` (`Engine.start`), the run checks before it starts
that the software it needs is there (`Engine.check_available`), and the settings class says how
many GPUs it spans and whether it loads a quantized base. Adding an engine: a module with the
engine and its settings class, and one `register_engine` call (docs/engines.md).
"""

from __future__ import annotations

from tba.config import (
    BuiltinEngineSettings,
    EngineSettings,
    VllmEngineSettings,
    register_engine_settings,
)
from tba.policy.engines.base import Engine
from tba.policy.engines.builtin import BuiltinEngine
from tba.policy.engines.vllm import VllmEngine, require_vllm

__all__ = ["ENGINES", "BuiltinEngine", "Engine", "VllmEngine", "register_engine", "require_vllm"]

ENGINES: dict[str, type[Engine]] = {}  # `searchers.engine.type` -> the engine's class


def register_engine(engine: type[Engine], settings: type[EngineSettings]) -> None:
    """Make an engine available as `searchers.engine.type=<engine.name>`: its class and its
    settings (a subclass of `EngineSettings` whose `type` is that name)."""
    ENGINES[engine.name] = engine
    register_engine_settings(engine.name, settings)


register_engine(BuiltinEngine, BuiltinEngineSettings)
register_engine(VllmEngine, VllmEngineSettings)
