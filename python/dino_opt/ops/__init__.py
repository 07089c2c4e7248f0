"""Native operators' Python side, their plain-torch forms; the DINO loss, EMA, schedules."""

from .ema import EMATeacher, update_teacher
from .fallback import (
    FALLBACK_OPS,
    dino_loss_backward_torch,
    dino_loss_torch,
    ema_update_torch,
    fallback_warned,
)
from .library import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    PHOTOMETRIC_PARAM_COLUMNS,
    build_info,
    dino_loss,
    ema_update_,
    multicrop_photometric,
)
from .loss import DINOLoss, NonFiniteLossError
from .photometric_torch import photometric_torch
from .schedules import Schedules, cosine_scheduler, teacher_temp_schedule

__all__ = [
    "DINOLoss",
    "EMATeacher",
    "FALLBACK_OPS",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "NonFiniteLossError",
    "PHOTOMETRIC_PARAM_COLUMNS",
    "Schedules",
    "build_info",
    "cosine_scheduler",
    "dino_loss",
    "dino_loss_backward_torch",
    "dino_loss_torch",
    "ema_update_",
    "ema_update_torch",
    "fallback_warned",
    "multicrop_photometric",
    "photometric_torch",
    "teacher_temp_schedule",
    "update_teacher",
]
