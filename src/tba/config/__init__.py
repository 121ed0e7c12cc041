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
  (buffer, searchers, searchers.vllm, trainer, ray);
- `devices` (device names, the GPUs a searcher sees), `presets` (`TASK_PRESETS`), `aliases`
  (renamed keys);
- `base` (`Section`) and `keys` (dotted keys in nested dicts).

Each cross-setting rule is a named function in its section's module (`TRAIN_RULES`,
`TASK_RULES`, `RUN_RULES` list them in the order they are checked).
"""

from tba.config.aliases import ALIASES, OBJECTIVE_SECTIONS
from tba.config.base import Section
from tba.config.devices import (
    DEVICE_PATTERN,
    Device,
    _check_searcher_devices,
    check_searcher_devices,
    cuda_index,
)
from tba.config.loading import apply_overrides, first_error_line, load_config, section_message
from tba.config.policy import LoraConfig, PolicyConfig, PretrainConfig, QuantizationConfig
from tba.config.presets import TASK_PRESETS
from tba.config.reference import dump_config, reference_page, reference_table
from tba.config.run import CheckpointConfig, EvalConfig, RunConfig
from tba.config.runtime import (
    BufferConfig,
    RayConfig,
    SearchersConfig,
    TrainerConfig,
    VllmConfig,
)
from tba.config.task import DATASET_TASKS, EMBEDDED_TASKS, RedteamConfig, TaskConfig
from tba.config.train import PPOSettings, TBSettings, TrainConfig, VinePPOSettings
from tba.errors import ConfigError  # defined there; importable from here too

__all__ = [
    "ALIASES",
    "DATASET_TASKS",
    "DEVICE_PATTERN",
    "EMBEDDED_TASKS",
    "OBJECTIVE_SECTIONS",
    "TASK_PRESETS",
    "BufferConfig",
    "CheckpointConfig",
    "ConfigError",
    "Device",
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
    "VllmConfig",
    "_check_searcher_devices",
    "apply_overrides",
    "check_searcher_devices",
    "cuda_index",
    "dump_config",
    "first_error_line",
    "load_config",
    "reference_page",
    "reference_table",
    "section_message",
]
