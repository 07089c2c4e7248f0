"""Fast on this machine: model speed-ups, the batch-size search, the hardware
preset, the per-rank memory model and the checkpointing it chooses."""

from .checkpointing import (
    CheckpointingChoice,
    checkpointing_ladder,
    resolve_checkpointing,
)
from .hardware import (
    PresetChoice,
    detect_device_memory,
    measure_batch_size,
    resolve_hardware,
    resolve_preset,
)
from .memory import (
    MEMORY_ARCHS,
    MEMORY_TERMS,
    STRATEGIES,
    MemoryEstimate,
    arch_config,
    block_bytes_per_token,
    count_model,
    estimate_memory,
    largest_batch,
    memory_table,
    selective_outputs,
    sequence_lengths,
    terms_of,
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
from .throughput import (
    USABLE_MEMORY_FRACTION,
    OptimizedDataLoader,
    ThroughputOptimizer,
    dynamic_batch_size,
)

__all__ = [
    "COMPILE_MODES",
    "CONFIG_KEYS",
    "MEMORY_ARCHS",
    "MEMORY_TERMS",
    "STRATEGIES",
    "USABLE_MEMORY_FRACTION",
    "MemoryEstimate",
    "ModelOptimizer",
    "OptimizedDataLoader",
    "PresetChoice",
    "SDPAForward",
    "ThroughputOptimizer",
    "CheckpointingChoice",
    "arch_config",
    "block_bytes_per_token",
    "checkpointing_ladder",
    "count_model",
    "detect_device_memory",
    "dynamic_batch_size",
    "estimate_memory",
    "explicit_attention",
    "largest_batch",
    "measure_batch_size",
    "memory_table",
    "optimize_attention",
    "optimize_model",
    "optimize_model_report",
    "resolve_checkpointing",
    "resolve_hardware",
    "resolve_preset",
    "restore_attention",
    "selective_outputs",
    "sequence_lengths",
    "terms_of",
]
