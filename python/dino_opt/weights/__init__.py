"""Weights in and out: timm, Hugging Face, DINO and DINOv2 formats, exported and loaded."""

from .layouts import ViTArch
from .reading import ExternalWeights, read_weights
from .transfer import (
    FORMATS,
    ExportResult,
    evaluate_weights,
    export_backbone,
    export_weights,
    init_from,
    load_backbone,
)

__all__ = [
    "ExportResult",
    "ExternalWeights",
    "FORMATS",
    "ViTArch",
    "evaluate_weights",
    "export_backbone",
    "export_weights",
    "init_from",
    "load_backbone",
    "read_weights",
]
