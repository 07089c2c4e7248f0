"""Python side of the native operators: fake (meta) kernels for torch.compile
and thin, documented wrappers. The schemas and real kernels live in csrc/ops/."""

import importlib.metadata
from collections.abc import Sequence

import torch

from .native import _C

__all__ = [
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "PHOTOMETRIC_PARAM_COLUMNS",
    "build_info",
    "dino_loss",
    "ema_update_",
    "gram_loss",
    "ibot_loss",
    "multicrop_photometric",
    "release_cpu_buffers",
]


@torch.library.register_fake("dino_opt::ema_update_")
def _ema_update_fake(teacher, student, momentum):
    # In-place on `teacher`, no outputs: nothing to allocate while tracing.
    return None


def ema_update_(
    teacher: Sequence[torch.Tensor], student: Sequence[torch.Tensor], momentum: float
) -> None:
    """In place, for every pair: ``t <- momentum * t + (1 - momentum) * s``.

    One fused kernel over all tensors (one CUDA launch for up to 1024 tensors
    per dtype pair). Teacher dtypes float64/float32/bfloat16/float16, any
    student dtype of those; arithmetic in float32 (float64 for a float64
    teacher). Tensors must match in shape and device; the teacher must not
    require grad. Raises ``RuntimeError`` naming the offending tensor otherwise.
    """
    torch.ops.dino_opt.ema_update_(list(teacher), list(student), float(momentum))


def _loss_acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


@torch.library.register_fake("dino_opt::dino_loss")
def _dino_loss_fake(
    student, teacher, center, student_temp, teacher_temp, ncrops, view_offset=0, total_views=-1
):
    acc = _loss_acc_dtype(student.dtype)
    return (
        student.new_empty((), dtype=acc),
        student.new_empty((student.shape[0],), dtype=acc),
        teacher.new_empty((teacher.shape[0],), dtype=acc),
    )


@torch.library.register_fake("dino_opt::dino_loss_backward")
def _dino_loss_backward_fake(grad, student, *args):
    return student.new_empty(student.shape)


def _dino_loss_setup_context(ctx, inputs, output):
    student, teacher, center, *scalars = inputs  # temperatures and view arguments
    _, student_lse, teacher_lse = output
    ctx.save_for_backward(student, teacher, center, student_lse, teacher_lse)
    ctx.scalars = tuple(scalars)
    ctx.mark_non_differentiable(student_lse, teacher_lse)


def _dino_loss_backward(ctx, grad_loss, _grad_student_lse, _grad_teacher_lse):
    # Only the student gets a gradient: the teacher's targets are constants.
    grad_student = None
    if ctx.needs_input_grad[0]:
        grad_student = torch.ops.dino_opt.dino_loss_backward(
            grad_loss, *ctx.saved_tensors, *ctx.scalars
        )
    return grad_student, *[None] * (2 + len(ctx.scalars))


torch.library.register_autograd(
    "dino_opt::dino_loss", _dino_loss_backward, setup_context=_dino_loss_setup_context
)


def dino_loss(
    student: torch.Tensor,
    teacher: torch.Tensor,
    center: torch.Tensor,
    student_temp: float,
    teacher_temp: float,
    ncrops: int,
    *,
    view_offset: int = 0,
    total_views: int | None = None,
) -> torch.Tensor:
    """The DINO loss of one step, fused: cross-entropy between
    ``softmax((teacher - center) / teacher_temp)`` of every teacher view and
    ``log_softmax(student / student_temp)`` of every other student view,
    averaged over samples and over the ``T * (ncrops - 1)`` view pairs.

    ``student``: [ncrops * B, K], view-major (the original code's layout);
    ``teacher``: [T * B, K] with teacher view t paired with every student view
    but view t; ``center``: [K] or [1, K]. Inputs float64, float32, bfloat16
    or float16 (student and teacher alike); arithmetic in float32 (float64 for
    float64). Differentiable in ``student`` only (the teacher is detached).
    Returns a 0-dim float32 (float64) tensor.

    Part of a step: with ``total_views``, ``student`` holds the ``ncrops``
    views ``view_offset .. view_offset + ncrops - 1`` of the step's
    ``total_views`` student views, and the result is their share of the
    step's loss (same pairs, same normalisation by ``T * (total_views - 1)``),
    so the parts of a step add up to its loss and their gradients are the
    step's. Crop batching runs the student one group of views at a time on it.
    """
    loss, _, _ = torch.ops.dino_opt.dino_loss(
        student,
        teacher.detach(),
        center,
        float(student_temp),
        float(teacher_temp),
        int(ncrops),
        int(view_offset),
        -1 if total_views is None else int(total_views),
    )
    return loss


def release_cpu_buffers() -> tuple[int, int]:
    """Frees the CPU loss gradients' buffers kept for the next step.

    The CPU backward of :func:`dino_loss` and :func:`ibot_loss` keeps the
    storage of its last gradients ([rows, K], over 1 MiB) and writes the next
    step's gradient into it once nothing refers to it any more, instead of
    asking the system for fresh pages each step (see docs/loss.md). Returns
    (bytes freed, bytes still held: buffers in use).
    """
    released, held = torch.ops.dino_opt.release_cpu_buffers()
    return int(released), int(held)


@torch.library.register_fake("dino_opt::ibot_loss")
def _ibot_loss_fake(student, targets, weights, student_temp):
    acc = _loss_acc_dtype(student.dtype)
    return student.new_empty((), dtype=acc), student.new_empty((student.shape[0],), dtype=acc)


@torch.library.register_fake("dino_opt::ibot_loss_backward")
def _ibot_loss_backward_fake(grad, student, *args):
    return student.new_empty(student.shape)


def _ibot_loss_setup_context(ctx, inputs, output):
    student, targets, weights, student_temp = inputs
    _, student_lse = output
    ctx.save_for_backward(student, targets, weights, student_lse)
    ctx.student_temp = student_temp
    ctx.mark_non_differentiable(student_lse)


def _ibot_loss_backward(ctx, grad_loss, _grad_student_lse):
    # Only the student gets a gradient: targets and weights are constants.
    grad_student = None
    if ctx.needs_input_grad[0]:
        grad_student = torch.ops.dino_opt.ibot_loss_backward(
            grad_loss, *ctx.saved_tensors, ctx.student_temp
        )
    return grad_student, None, None, None


torch.library.register_autograd(
    "dino_opt::ibot_loss", _ibot_loss_backward, setup_context=_ibot_loss_setup_context
)


def ibot_loss(
    student: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor, student_temp: float
) -> torch.Tensor:
    """iBOT's masked-patch cross-entropy, fused:
    ``-sum_n weights[n] * sum_k targets[n % M, k] * log_softmax(student[n] / student_temp)_k``
    (the caller divides by the number of images, as dinov2 does).

    ``student``: [N, K] head outputs of the masked patch tokens, float64,
    float32, bfloat16 or float16; ``targets``: [M, K] target probabilities
    (centred softmax or Sinkhorn-Knopp, computed by the caller) of the
    student's dtype or float32, with M dividing N: student row n takes target
    row ``n % M`` (M = N for iBOT; M = B with the student's views stacked
    view-major shares one target per image across the views); ``weights``:
    [N] float32 (or float64 for a float64 student), e.g. 1 / the number of
    masked tokens of the token's image. A target of exactly 0 adds nothing
    (0 log 0 = 0). Arithmetic in float32 (float64 for float64); no [N, K]
    tensor of log-probabilities is made. Differentiable in ``student`` only.
    Returns a 0-dim float32 (float64) tensor; N = 0 gives 0.
    """
    loss, _ = torch.ops.dino_opt.ibot_loss(
        student, targets.detach(), weights.detach(), float(student_temp)
    )
    return loss


@torch.library.register_fake("dino_opt::gram_loss")
def _gram_loss_fake(
    student, teacher, apply_norm=True, remove_neg=False, remove_only_teacher_neg=False, form=0
):
    torch._check(student.dim() in (2, 3), lambda: "student must be [B, N, D] or [M, D]")
    return student.new_empty((), dtype=_loss_acc_dtype(student.dtype))


@torch.library.register_fake("dino_opt::gram_loss_backward")
def _gram_loss_backward_fake(grad, student, *args):
    return student.new_empty(student.shape)


def _gram_loss_setup_context(ctx, inputs, output):
    student, teacher, *options = inputs  # apply_norm, the clamping, the form
    ctx.save_for_backward(student, teacher)
    ctx.options = tuple(options)


def _gram_loss_backward(ctx, grad_loss):
    # Only the student gets a gradient: the Gram teacher is a constant.
    grad_student = None
    if ctx.needs_input_grad[0]:
        grad_student = torch.ops.dino_opt.gram_loss_backward(
            grad_loss, *ctx.saved_tensors, *ctx.options
        )
    return grad_student, *[None] * (1 + len(ctx.options))


torch.library.register_autograd(
    "dino_opt::gram_loss", _gram_loss_backward, setup_context=_gram_loss_setup_context
)


def gram_loss(
    student: torch.Tensor,
    teacher: torch.Tensor,
    *,
    apply_norm: bool = True,
    remove_neg: bool = False,
    remove_only_teacher_neg: bool = False,
) -> torch.Tensor:
    """DINOv3's Gram anchoring loss, fused: the mean over the entries of
    ``(S S^T - T T^T)^2``, S and T the student's and the Gram teacher's patch
    features, each row divided by its L2 norm when ``apply_norm``.

    ``student`` and ``teacher`` of one shape: ``[B, N, D]`` gives a Gram matrix
    per image (the mean over B x N x N entries), ``[M, D]`` one Gram matrix of
    all M rows (the mean over M x M). ``remove_neg`` clamps both similarities
    at 0; ``remove_only_teacher_neg`` clamps the teacher's only, as dinov3
    runs it (the two exclude each other). Inputs float64,
    float32, bfloat16 or float16; arithmetic in float32 (float64 for a float64
    student). No N x N matrix is made: without clamping and with D < N the
    loss goes through D x D matrices, otherwise through tiles of rows.
    Differentiable in ``student`` only. Returns a 0-dim float32 (float64)
    tensor; no rows give NaN, as the mean of nothing.
    """
    return torch.ops.dino_opt.gram_loss(
        student,
        teacher.detach(),
        bool(apply_norm),
        bool(remove_neg),
        bool(remove_only_teacher_neg),
        0,
    )


# ImageNet statistics, the normalisation of DINO's augmentation.
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

# The columns of a row of ``multicrop_photometric``'s params, in order.
PHOTOMETRIC_PARAM_COLUMNS = (
    "flip",
    "jitter",
    "brightness",
    "contrast",
    "saturation",
    "hue",
    "order0",
    "order1",
    "order2",
    "order3",
    "grayscale",
    "blur_sigma",
    "solarize",
)


@torch.library.register_fake("dino_opt::multicrop_photometric")
def _multicrop_photometric_fake(images, params, mean, std, dtype=None, channels_last=False):
    torch._check(images.dim() == 4 and images.shape[3] == 3, lambda: "images must be [N, H, W, 3]")
    n, h, w, _ = images.shape
    return torch.empty(
        (n, 3, h, w),
        dtype=dtype if dtype is not None else torch.float32,
        device=images.device,
        memory_format=torch.channels_last if channels_last else torch.contiguous_format,
    )


def multicrop_photometric(
    images: torch.Tensor,
    params: torch.Tensor,
    mean: Sequence[float] = IMAGENET_MEAN,
    std: Sequence[float] = IMAGENET_STD,
    dtype: torch.dtype = torch.float32,
    channels_last: bool = False,
) -> torch.Tensor:
    """DINO's photometric augmentation and normalisation of a batch of crops,
    each with its own parameters; the same arithmetic as the native loader.

    ``images``: uint8 ``[N, H, W, 3]`` RGB crops. ``params``: float32
    ``[N, 13]`` on the same device, one row per crop with the columns of
    :data:`PHOTOMETRIC_PARAM_COLUMNS`: ``flip`` (0/1, horizontal), ``jitter``
    (0/1: apply the next five), ``brightness``, ``contrast``, ``saturation``
    (factors >= 0, 1 is the identity), ``hue`` (in [-0.5, 0.5]), ``order0..3``
    (a permutation of 0 brightness, 1 contrast, 2 saturation, 3 hue: ColorJitter's
    random order), ``grayscale`` (0/1), ``blur_sigma`` (0: no blur; kernel
    ``2 * ceil(3 sigma) + 1`` taps, clamped to ``2 * (side - 1) + 1`` so that the
    reflect padding stays inside the crop), ``solarize`` (0/1, threshold 128/255).

    Semantics are torchvision's tensor ops on the float image ``x = u8 / 255``
    (``adjust_brightness/contrast/saturation/hue``, ``rgb_to_grayscale``,
    ``gaussian_blur`` with reflect padding, ``solarize``, then ``normalize``), in
    float32 without rounding to uint8 between ops (more exact than the PIL
    pipeline of the original DINO code). Returns ``[N, 3, H, W]`` of ``dtype``
    (float32, bfloat16 or float16), in channels_last memory format when asked.
    The CPU and CUDA kernels give the same values. The CPU kernel rejects invalid
    parameter rows naming the row; the CUDA kernel does not read them back (no
    synchronisation) and applies an invalid row safely, skipping bad order
    entries. Not differentiable (the input is uint8).
    """
    return torch.ops.dino_opt.multicrop_photometric(
        images,
        params,
        [float(m) for m in mean],
        [float(s) for s in std],
        dtype,
        bool(channels_last),
    )


def build_info() -> dict:
    """How the native core was built, and what this process sees at run time.

    Keys: ``version``, ``torch_version`` (running), ``torch_version_built``,
    ``cuda_compiled`` (bool), ``cuda_archs`` (list of ints), ``cxx_compiler``,
    ``cuda_compiler``, ``openmp`` (the OpenMP spec date, empty if none),
    ``parallel_info`` (ATen's threading report), ``cpu_kernels`` (the
    instruction set of the CPU kernels chosen at run time), ``image_formats``
    (the formats the native loader decodes: all five, or only JPEG in a build
    configured with ``DINO_OPT_WITH_OPENCV=OFF``), ``cuda_available``,
    ``device_name``.
    """
    native = _C.build_info()
    archs = [int(a) for a in native["cuda_archs"].split(";") if a]
    return {
        "version": importlib.metadata.version("dino_opt"),
        "torch_version": torch.__version__,
        "torch_version_built": native["torch_version_built"],
        "cuda_compiled": native["cuda_compiled"] == "yes",
        "cuda_archs": archs,
        "cxx_compiler": native["cxx_compiler"],
        "cuda_compiler": native["cuda_compiler"],
        "openmp": native["openmp"],
        "parallel_info": native["parallel_info"],
        "cpu_kernels": native["cpu_kernels"],
        "image_formats": native["image_formats"].split(", "),
        "cuda_available": torch.cuda.is_available(),
        "device_name": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }
