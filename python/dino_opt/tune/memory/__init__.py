"""The per-rank memory model of a training step: the ViT formulas (:mod:`.model`), the
distillation's traced networks (:mod:`.distill`) and each recipe's terms (:mod:`.recipes`)."""

from .model import (
    MEMORY_ARCHS,
    STRATEGIES,
    MemoryEstimate,
    activation_bytes,
    arch_config,
    block_bytes_per_token,
    count_model,
    estimate_memory,
    largest_batch,
    memory_table,
    selective_outputs,
    sequence_lengths,
)
from .recipes import MEMORY_TERMS, RecipeTerms, terms_of

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
