"""Weights in: any format read and detected from its content, the released networks by
name, loaded into a backbone or a run's networks, a distillation's teacher and students."""

from .backbone import OpenedBackbone, init_from, load_backbone, open_backbone
from .hub import (
    RELEASED,
    Released,
    WeightsNameError,
    format_models,
    is_weights_name,
    model_rows,
    weights_location,
)
from .reading import ExternalWeights, read_state_dict, read_weights
from .students import load_student_start, start_students, student_starts
from .teacher import OpenedTeacher, open_teacher, weights_reader

__all__ = [
    "ExternalWeights",
    "OpenedBackbone",
    "OpenedTeacher",
    "RELEASED",
    "Released",
    "WeightsNameError",
    "format_models",
    "init_from",
    "is_weights_name",
    "load_backbone",
    "load_student_start",
    "model_rows",
    "open_backbone",
    "open_teacher",
    "read_state_dict",
    "read_weights",
    "start_students",
    "student_starts",
    "weights_location",
    "weights_reader",
]
