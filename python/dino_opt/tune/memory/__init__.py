"""The per-rank memory model of a training step: the parameters counted from
the built modules (:mod:`.counts`), the ViT formulas (:mod:`.model`), the
distillation's traced networks (:mod:`.distill`), each recipe's terms
(:mod:`.recipes`) and the released architectures' table (:mod:`.table`)."""

from .counts import count_model
from .model import (
    STRATEGIES,
    MemoryEstimate,
    activation_bytes,
    block_bytes_per_token,
    estimate_memory,
    selective_outputs,
    sequence_lengths,
)
from .recipes import MEMORY_TERMS, RecipeTerms, terms_of
from .table import MEMORY_ARCHS, arch_config, largest_batch, memory_table

__all__ = [
    "MEMORY_ARCHS",
    "MEMORY_TERMS",
    "STRATEGIES",
    "MemoryEstimate",
    "RecipeTerms",
    "activation_bytes",
    "arch_config",
    "block_bytes_per_token",
    "count_model",
    "estimate_memory",
    "largest_batch",
    "memory_table",
    "selective_outputs",
    "sequence_lengths",
    "terms_of",
]
