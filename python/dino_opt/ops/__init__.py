"""Native operators' Python side, their plain-torch forms; the DINO and iBOT losses, EMA,
schedules."""

from .ema import EMATeacher, unwrap, update_teacher
from .fallback import (
    FALLBACK_OPS,
    dino_loss_backward_torch,
    dino_loss_torch,
    ema_update_torch,
    fallback_warned,
    gram_clamp_allowance,
    gram_loss_backward_torch,
    gram_loss_torch,
    ibot_loss_backward_torch,
    ibot_loss_torch,
)
from .library import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    PHOTOMETRIC_PARAM_COLUMNS,
    build_info,
    dino_loss,
    ema_update_,
    gram_loss,
    ibot_loss,
    multicrop_photometric,
    release_cpu_buffers,
)
from .loss import DINOLoss, NonFiniteLossError
from .photometric_torch import photometric_torch
from .schedules import Schedules, cosine_scheduler, teacher_temp_schedule, warmup_cosine_constant

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
    "unwrap",
    "fallback_warned",
    "gram_clamp_allowance",
    "gram_loss",
    "gram_loss_backward_torch",
    "gram_loss_torch",
    "ibot_loss",
    "ibot_loss_backward_torch",
    "ibot_loss_torch",
    "multicrop_photometric",
    "photometric_torch",
    "release_cpu_buffers",
    "teacher_temp_schedule",
    "update_teacher",
    "warmup_cosine_constant",
]

# dinov2's losses (its class-token DINOLoss stays in dino_opt.ops.dinov2_loss:
# the name DINOLoss here is DINO's).
from .dinov2_loss import KoLeoLoss, iBOTPatchLoss, sinkhorn_knopp  # noqa: E402

__all__ += ["KoLeoLoss", "iBOTPatchLoss", "sinkhorn_knopp"]

# dinov3's Gram anchoring loss. Importing the module .gram_loss sets the
# package's attribute of that name to the module: the function is bound again.
from .gram_loss import GramLoss  # noqa: E402
from .library import gram_loss  # noqa: E402, F811

__all__ += ["GramLoss"]
