"""Weights in and out: timm, Hugging Face, DINO, DINOv2, DINOv3 and ONNX, exported and loaded."""

from .hub import (
    RELEASED,
    Released,
    WeightsNameError,
    format_models,
    is_weights_name,
    model_rows,
    weights_location,
)
from .layouts import ViTArch
from .layouts_dinov3 import DinoV3Arch
from .onnx_export import ONNX_TOLERANCE, export_onnx
from .probes import (
    OpenedBackbone,
    embed_weights,
    embeddings_of,
    open_backbone,
    predict,
    probe_data,
    run_dense_probe,
    run_linear_probe,
    show_weights,
)
from .reading import ExternalWeights, read_state_dict, read_weights
from .students import load_student_start, start_students, student_starts
from .teacher import OpenedTeacher, open_teacher, weights_reader
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
    "DinoV3Arch",
    "ExportResult",
    "ExternalWeights",
    "FORMATS",
    "ONNX_TOLERANCE",
    "OpenedBackbone",
    "OpenedTeacher",
    "ViTArch",
    "RELEASED",
    "Released",
    "WeightsNameError",
    "embed_weights",
    "format_models",
    "embeddings_of",
    "is_weights_name",
    "model_rows",
    "weights_location",
    "evaluate_weights",
    "export_backbone",
    "export_onnx",
    "export_weights",
    "init_from",
    "load_backbone",
    "load_student_start",
    "open_backbone",
    "open_teacher",
    "predict",
    "probe_data",
    "run_dense_probe",
    "run_linear_probe",
    "show_weights",
    "read_state_dict",
    "read_weights",
    "start_students",
    "student_starts",
    "weights_reader",
]
