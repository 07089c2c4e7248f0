"""Weights in and out: timm, Hugging Face and DINO formats, exported and loaded."""

from .transfer import (
    FORMATS,
    ExportResult,
    ExternalWeights,
    evaluate_weights,
    export_weights,
    init_from,
    read_weights,
)

__all__ = [
    "ExportResult",
    "ExternalWeights",
    "FORMATS",
    "evaluate_weights",
    "export_weights",
    "init_from",
    "read_weights",
]
