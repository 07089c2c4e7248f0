"""Weights out: a run's network or a backbone module written for timm, Hugging Face, DINO,
DINOv2, DINOv3, torchvision, or as an ONNX graph checked against PyTorch."""

from .formats import FORMATS, ExportResult, export_backbone, export_weights
from .onnx import ONNX_TOLERANCE, export_onnx

__all__ = [
    "FORMATS",
    "ExportResult",
    "ONNX_TOLERANCE",
    "export_backbone",
    "export_onnx",
    "export_weights",
]
