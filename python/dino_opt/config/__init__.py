"""The configuration: fields, the checked Config, YAML and overrides, the presets table."""

from .fields import (
    AugmentationConfig,
    CheckpointConfig,
    ConfigError,
    DataConfig,
    DebugConfig,
    DistributedConfig,
    EvalConfig,
    HardwareConfig,
    HealthConfig,
    LoggingConfig,
    ModelConfig,
    OptimConfig,
    ScheduleConfig,
)
from .load import apply_overrides, config_to_yaml, effective_lr, load_config, save_config
from .presets import PRESET_KEYS, PRESET_NAMES, PRESETS, HardwarePreset, preset_for_memory
from .schema import Config, default_config, validate

__all__ = [
    "AugmentationConfig",
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "DebugConfig",
    "DistributedConfig",
    "EvalConfig",
    "HardwareConfig",
    "HardwarePreset",
    "HealthConfig",
    "LoggingConfig",
    "ModelConfig",
    "OptimConfig",
    "PRESETS",
    "PRESET_KEYS",
    "PRESET_NAMES",
    "ScheduleConfig",
    "apply_overrides",
    "config_to_yaml",
    "default_config",
    "effective_lr",
    "load_config",
    "preset_for_memory",
    "save_config",
    "validate",
]
