"""Fast on this machine: model speed-ups, the batch-size search, the hardware preset."""

from .hardware import (
    PresetChoice,
    detect_device_memory,
    measure_batch_size,
    resolve_hardware,
    resolve_preset,
)
from .optimize import (
    COMPILE_MODES,
    CONFIG_KEYS,
    ModelOptimizer,
    SDPAForward,
    explicit_attention,
    optimize_attention,
    optimize_model,
    optimize_model_report,
    restore_attention,
)
from .throughput import OptimizedDataLoader, ThroughputOptimizer, dynamic_batch_size

__all__ = [
    "COMPILE_MODES",
    "CONFIG_KEYS",
    "ModelOptimizer",
    "OptimizedDataLoader",
    "PresetChoice",
    "SDPAForward",
    "ThroughputOptimizer",
    "detect_device_memory",
    "dynamic_batch_size",
    "explicit_attention",
    "measure_batch_size",
    "optimize_attention",
    "optimize_model",
    "optimize_model_report",
    "resolve_hardware",
    "resolve_preset",
    "restore_attention",
]
