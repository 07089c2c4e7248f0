"""Native operators' Python side; the DINO loss, the EMA teacher and their schedules."""

from .ema import EMATeacher, update_teacher
from .library import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    PHOTOMETRIC_PARAM_COLUMNS,
    dino_loss,
    ema_update_,
    multicrop_photometric,
)
from .loss import DINOLoss, NonFiniteLossError
from .schedules import Schedules, cosine_scheduler, teacher_temp_schedule

__all__ = [
    "DINOLoss",
    "EMATeacher",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "NonFiniteLossError",
    "PHOTOMETRIC_PARAM_COLUMNS",
    "Schedules",
    "cosine_scheduler",
    "dino_loss",
    "ema_update_",
    "multicrop_photometric",
    "teacher_temp_schedule",
    "update_teacher",
]
