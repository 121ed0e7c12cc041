"""Typed run configuration: YAML files plus `key=value` overrides, validated by pydantic.

Every section is a plain model with unknown keys forbidden, so a typo is an error, not a silently
ignored setting. `load_config` raises `ConfigError` with one line naming the key and what is
allowed; the CLI prints that line and exits with status 2.

The modules, top to bottom (`lint-imports` keeps them layered):

- `loading` (YAML, `key=value` overrides, `load_config`, error lines) and `reference`
  (`dump_config`, docs/configuration.md);
- `run`: `RunConfig`, the whole tree, with `eval`, `checkpoint` and the rules across sections;
- the sections: `policy` (policy, pretrain, lora, quantization), `task` (task, task.redteam),
  `train` (train and its objectives' sections train.tb, train.ppo, train.vineppo), `runtime`
  (buffer, searchers, trainer, ray);
- `devices` (device names, the GPUs a searcher sees), `presets` (`TASK_PRESETS`), `aliases`
  (renamed keys), and the sections of several kinds, a `type` naming each kind: `engines`
  (searchers.engine, `ENGINE_SETTINGS`) and `transfer` (searchers.weight_transfer);
- `base` (`Section`, defined in `tba.section`) and `keys` (dotted keys in nested dicts).

An objective's own section of `train` is its registry entry's: its class (`TBSettings`,
`PPOSettings`, `VinePPOSettings`) lives with its loss in `tba.objectives`, re-exported here.

Each cross-setting rule is a named function in its section's module (`TRAIN_RULES`,
`TASK_RULES`, `RUN_RULES` list them in the order they are checked).
"""

from tba.config.aliases import ALIASES
from tba.config.base import Section
from tba.config.devices import (
    DEVICE_PATTERN,
    Device,
    _check_searcher_devices,
    check_searcher_devices,
    cuda_index,
)
from tba.config.engines import (
    ENGINE_SETTINGS,
    BuiltinEngineSettings,
    EngineSettings,
    VllmEngineSettings,
    register_engine_settings,
)
from tba.config.loading import apply_overrides, first_error_line, load_config, section_message
from tba.config.policy import LoraConfig, PolicyConfig, PretrainConfig, QuantizationConfig
from tba.config.presets import TASK_PRESETS
from tba.config.reference import dump_config, reference_page, reference_table
from tba.config.run import CheckpointConfig, EvalConfig, RunConfig
from tba.config.runtime import BufferConfig, RayConfig, SearchersConfig, TrainerConfig
from tba.config.task import DATASET_TASKS, EMBEDDED_TASKS, RedteamConfig, TaskConfig
from tba.config.train import TrainConfig
from tba.errors import ConfigError  # defined there; importable from here too
from tba.objectives import PPOSettings, TBSettings, VinePPOSettings

__all__ = [
    "ALIASES",
    "DATASET_TASKS",
    "DEVICE_PATTERN",
    "EMBEDDED_TASKS",
    "ENGINE_SETTINGS",
    "TASK_PRESETS",
    "BufferConfig",
    "BuiltinEngineSettings",
    "CheckpointConfig",
    "ConfigError",
    "Device",
    "EngineSettings",
    "EvalConfig",
    "LoraConfig",
    "PPOSettings",
    "PolicyConfig",
    "PretrainConfig",
    "QuantizationConfig",
    "RayConfig",
    "RedteamConfig",
    "RunConfig",
    "SearchersConfig",
    "Section",
    "TBSettings",
    "TaskConfig",
    "TrainConfig",
    "TrainerConfig",
    "VinePPOSettings",
    "VllmEngineSettings",
    "_check_searcher_devices",
    "apply_overrides",
    "check_searcher_devices",
    "cuda_index",
    "dump_config",
    "first_error_line",
    "load_config",
    "reference_page",
    "reference_table",
    "register_engine_settings",
    "section_message",
]
