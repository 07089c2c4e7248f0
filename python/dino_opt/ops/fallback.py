"""The fused operators in plain PyTorch, registered as their kernels for every
device this build has no compiled kernel for (a CUDA torch built without nvcc,
Apple MPS, Intel XPU, a ROCm torch): the same results, slower, and a warning,
once per operator and device type, naming both.

The dispatcher picks a compiled kernel (CPU, and CUDA when built with nvcc)
before these: they are registered under ``CompositeExplicitAutograd``, which
serves only the devices without a kernel of their own, and autograd, the fake
kernels for ``torch.compile`` and the version counters stay the operators'.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

import torch

from .photometric_torch import photometric_torch

__all__ = [
    "FALLBACK_OPS",
    "dino_loss_backward_torch",
    "dino_loss_torch",
    "ema_update_torch",
    "fallback_warned",
    "gram_clamp_allowance",
    "gram_loss_backward_torch",
    "gram_loss_torch",
    "ibot_loss_backward_torch",
    "ibot_loss_torch",
]

_FLOATS = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
_warned: set[tuple[str, str]] = set()


def _warn_once(op: str, device: torch.device) -> None:
    key = (op, device.type)
    if key in _warned:
        return
    _warned.add(key)
    warnings.warn(  # stacklevel: the caller of the operator
        f"dino_opt::{op}: this build has no {device.type} kernel; running its plain-torch form "
        "(same results, slower). `dino-opt doctor` lists the kernels of this build.",
        RuntimeWarning,
        stacklevel=4,
    )


def fallback_warned() -> set[tuple[str, str]]:
    """The (operator, device type) pairs that have run their fallback."""
    return set(_warned)


# ------------------------------------------------------------------ DINO loss


def _views(ncrops: int, view_offset: int, total_views: int) -> tuple[int, int]:
    """(view_offset, total_views) checked as the kernels check them."""
    if total_views == -1:
        if ncrops < 2:
            raise RuntimeError(
                f"dino_loss: ncrops (student views) must be at least 2, got {ncrops}"
            )
        if view_offset != 0:
            raise RuntimeError(f"dino_loss: view_offset={view_offset} needs total_views")
        return 0, ncrops
    if total_views < 2 or ncrops < 1 or view_offset < 0 or view_offset + ncrops > total_views:
        raise RuntimeError(
            f"dino_loss: student views [{view_offset}, {view_offset + ncrops}) are not within "
            f"the {total_views} views of the step (total_views >= 2)"
        )
    return view_offset, total_views


def _shape(student, teacher, center, ncrops: int) -> tuple[int, int, int]:
    """(teacher views T, batch B, dim K), with the kernels' argument checks."""
    for name, t in (("student", student), ("teacher", teacher)):
        if t.dim() != 2 or t.dtype not in _FLOATS:
            raise RuntimeError(
                f"dino_loss: {name} must be a 2-D float tensor, got {tuple(t.shape)} {t.dtype}"
            )
    if student.dtype != teacher.dtype:
        raise RuntimeError(f"dino_loss: student is {student.dtype} but teacher is {teacher.dtype}")
    rows, dim = student.shape
    if ncrops < 1 or rows % ncrops or teacher.shape[1] != dim or center.numel() != dim:
        raise RuntimeError(
            f"dino_loss: student {tuple(student.shape)} with ncrops={ncrops}, teacher "
            f"{tuple(teacher.shape)} and center {tuple(center.shape)} do not fit together"
        )
    batch = rows // ncrops
    if batch == 0 or teacher.shape[0] % batch:
        raise RuntimeError(f"dino_loss: teacher rows {teacher.shape[0]} are not views of {batch}")
    return teacher.shape[0] // batch, batch, dim


def _pair_weights(views: int, teachers: int, offset: int, like: torch.Tensor) -> torch.Tensor:
    """[S, T]: 1 where this call's student view v is paired with teacher view t."""
    v = torch.arange(views, device=like.device)[:, None] + offset
    t = torch.arange(teachers, device=like.device)[None, :]
    return (v != t).to(like.dtype)


def _log_probs(student, teacher, center, student_temp, teacher_temp):
    acc = torch.float64 if student.dtype == torch.float64 else torch.float32
    s = student.to(acc) * (1.0 / student_temp)
    t = (teacher.to(acc) - center.to(acc).reshape(1, -1)) * (1.0 / teacher_temp)
    return s, t, torch.logsumexp(s, -1), torch.logsumexp(t, -1)


def _targets(t, teacher_lse, weights, batch):
    """[S, B, K]: the sum of the teacher probabilities paired with each student view."""
    p = torch.exp(t - teacher_lse[:, None]).view(weights.shape[1], batch, -1)
    return torch.einsum("st,tbk->sbk", weights, p)


@torch.no_grad()
def dino_loss_torch(
    student, teacher, center, student_temp, teacher_temp, ncrops, view_offset=0, total_views=-1
):
    """``dino_opt::dino_loss`` in plain torch: (loss, student_lse, teacher_lse),
    in float32 (float64 for float64 inputs)."""
    offset, total = _views(ncrops, view_offset, total_views)
    teachers, batch, _ = _shape(student, teacher, center, ncrops)
    s, t, student_lse, teacher_lse = _log_probs(
        student, teacher, center, student_temp, teacher_temp
    )
    weights = _pair_weights(ncrops, teachers, offset, s)
    target = _targets(t, teacher_lse, weights, batch)
    log_q = (s - student_lse[:, None]).view(ncrops, batch, -1)
    terms = target * torch.where(target == 0, torch.zeros_like(log_q), log_q)  # 0 log 0 = 0
    loss = -terms.sum() / (teachers * (total - 1) * batch)
    return loss, student_lse, teacher_lse


@torch.no_grad()
def dino_loss_backward_torch(
    grad,
    student,
    teacher,
    center,
    student_lse,
    teacher_lse,
    student_temp,
    teacher_temp,
    ncrops,
    view_offset=0,
    total_views=-1,
):
    """``dino_opt::dino_loss_backward`` in plain torch: the student's gradient,
    ``scale * (w_v softmax(s_v) - P_v) / student_temp`` with ``P_v`` the
    paired teachers' probabilities and ``w_v`` their count."""
    offset, total = _views(ncrops, view_offset, total_views)
    teachers, batch, _ = _shape(student, teacher, center, ncrops)
    s, t, _, _ = _log_probs(student, teacher, center, student_temp, teacher_temp)
    weights = _pair_weights(ncrops, teachers, offset, s)
    target = _targets(t, teacher_lse.to(s.dtype), weights, batch)
    q = torch.exp(s - student_lse.to(s.dtype)[:, None]).view(ncrops, batch, -1)
    scale = grad.to(s.dtype) / (teachers * (total - 1) * batch * student_temp)
    g = (weights.sum(1)[:, None, None] * q - target) * scale
    return g.reshape(student.shape).to(student.dtype)


# ------------------------------------------------------------------ iBOT loss


def _ibot_check(op, student, targets, weights, student_temp) -> tuple[int, int]:
    """(N, M), with the kernels' argument checks."""
    if student.dim() != 2 or targets.dim() != 2:
        raise RuntimeError(
            f"{op}: student and targets must be 2-D, got shapes "
            f"{tuple(student.shape)} and {tuple(targets.shape)}"
        )
    (n, k), m = student.shape, targets.shape[0]
    if targets.shape[1] != k or k < 1 or (n % m if m else n):
        raise RuntimeError(
            f"{op}: student {tuple(student.shape)} and targets {tuple(targets.shape)} do not "
            "fit together (K must match and M divide N)"
        )
    if tuple(weights.shape) != (n,):
        raise RuntimeError(f"{op}: weights must have shape [{n}], got {tuple(weights.shape)}")
    if student.dtype not in _FLOATS or targets.dtype not in (student.dtype, torch.float32):
        raise RuntimeError(
            f"{op}: student is {student.dtype} and targets {targets.dtype}; "
            "targets must be the student's dtype or float32"
        )
    if weights.dtype not in (torch.float32, _acc(student)):
        raise RuntimeError(f"{op}: weights has dtype {weights.dtype}; expected float32")
    if not (math.isfinite(student_temp) and student_temp > 0):
        raise RuntimeError(f"{op}: student_temp must be positive and finite, got {student_temp}")
    return n, m


def _acc(student: torch.Tensor) -> torch.dtype:
    return torch.float64 if student.dtype == torch.float64 else torch.float32


def _ibot_rows(student, targets, student_temp):
    """x = student / temp as [N/M, M, K], and the targets as [1, M, K], in the
    accumulation dtype: student row n meets target row n % M."""
    acc, m = _acc(student), targets.shape[0]
    x = (student.to(acc) * (1.0 / student_temp)).view(-1, m, student.shape[1])
    return x, targets.to(acc)[None]


@torch.no_grad()
def ibot_loss_torch(student, targets, weights, student_temp):
    """``dino_opt::ibot_loss`` in plain torch: (loss, student_lse), in float32
    (float64 for float64 students)."""
    n, m = _ibot_check("ibot_loss", student, targets, weights, student_temp)
    acc = _acc(student)
    if n == 0:
        return student.new_zeros((), dtype=acc), student.new_zeros((0,), dtype=acc)
    x, t = _ibot_rows(student, targets, student_temp)
    lse = torch.logsumexp(x, -1)
    log_q = x - lse[..., None]
    terms = t * torch.where(t == 0, torch.zeros_like(log_q), log_q)  # 0 log 0 = 0
    loss = -(terms.sum(-1).reshape(n) * weights.to(acc)).sum()
    return loss, lse.reshape(n)


@torch.no_grad()
def ibot_loss_backward_torch(grad, student, targets, weights, student_lse, student_temp):
    """``dino_opt::ibot_loss_backward`` in plain torch: the student's gradient,
    ``grad * w_n * (rowsum(t) softmax(s_n / temp) - t) / temp``."""
    n, m = _ibot_check("ibot_loss_backward", student, targets, weights, student_temp)
    if n == 0:
        return torch.empty_like(student)
    x, t = _ibot_rows(student, targets, student_temp)
    q = torch.exp(x - student_lse.to(x.dtype).view(-1, m, 1))
    scale = (grad.to(x.dtype) * weights.to(x.dtype) / student_temp).view(-1, m, 1)
    g = (t.sum(-1, keepdim=True) * q - t) * scale
    return g.reshape(student.shape).to(student.dtype)


# ------------------------------------------------------------------ Gram loss


def _gram_check(op, student, teacher, remove_neg, remove_only_teacher_neg, form) -> None:
    """The kernels' argument checks."""
    if student.dim() not in (2, 3) or teacher.shape != student.shape:
        shapes = f"{tuple(student.shape)} and {tuple(teacher.shape)}"
        raise RuntimeError(
            f"{op}: student and teacher must be of one shape, [B, N, D] or [M, D]; got {shapes}"
        )
    if student.dtype not in _FLOATS or teacher.dtype not in _FLOATS:
        raise RuntimeError(
            f"{op}: student is {student.dtype} and teacher {teacher.dtype}; "
            "expected float64, float32, bfloat16 or float16"
        )
    if student.device != teacher.device:
        raise RuntimeError(
            f"{op}: student and teacher must be on one device, got "
            f"{student.device} and {teacher.device}"
        )
    if remove_neg and remove_only_teacher_neg:
        raise RuntimeError(f"{op}: remove_neg and remove_only_teacher_neg exclude each other")
    if form not in (0, 1, 2) or (form == 1 and (remove_neg or remove_only_teacher_neg)):
        raise RuntimeError(f"{op}: form must be 0, 1 (no clamping only) or 2, got {form}")


def _gram_rows(x, apply_norm):
    """x in the accumulation dtype as [B, N, D] (B = 1 for [M, D]), its rows
    normalised when asked, and their norms (None without apply_norm)."""
    x = x.to(_acc(x))
    x = x if x.dim() == 3 else x[None]
    if not apply_norm:
        return x, None
    norm = x.norm(dim=-1, keepdim=True)
    return x / norm.clamp_min(1e-12), norm


def _gram_diff(student, teacher, apply_norm, remove_neg, remove_only_teacher_neg):
    """(d, dd/ds, normalised student, its norms): the difference of the Gram
    matrices, clamped as dinov3 clamps them, and its slope in the student's."""
    s, norm = _gram_rows(student, apply_norm)
    t, _ = _gram_rows(teacher.to(s.dtype), apply_norm)
    sim_s, sim_t = s @ s.transpose(1, 2), t @ t.transpose(1, 2)
    # remove_only_teacher_neg keeps every student similarity: dinov3 clamps the
    # teacher's first, so its mask of pairs where both are negative is empty
    keep = sim_s >= 0 if remove_neg else torch.ones_like(sim_s, dtype=torch.bool)
    if remove_neg or remove_only_teacher_neg:
        sim_t = sim_t.clamp_min(0)
    d = torch.where(keep, sim_s, 0) - sim_t
    return d, keep.to(d.dtype), s, norm


@torch.no_grad()
def gram_loss_torch(
    student, teacher, apply_norm=True, remove_neg=False, remove_only_teacher_neg=False, form=0
):
    """``dino_opt::gram_loss`` in plain torch: the Gram matrices made whole
    (dinov3's form), in float32 (float64 for float64 students)."""
    _gram_check("gram_loss", student, teacher, remove_neg, remove_only_teacher_neg, form)
    d, _, _, _ = _gram_diff(student, teacher, apply_norm, remove_neg, remove_only_teacher_neg)
    return d.square().mean()


@torch.no_grad()
def gram_loss_backward_torch(
    grad, student, teacher, apply_norm, remove_neg, remove_only_teacher_neg, form
):
    """``dino_opt::gram_loss_backward`` in plain torch: ``4 grad / count * (d
    dd/ds) S`` w.r.t. the normalised rows S, then through the normalisation."""
    _gram_check("gram_loss_backward", student, teacher, remove_neg, remove_only_teacher_neg, form)
    d, slope, s, norm = _gram_diff(
        student, teacher, apply_norm, remove_neg, remove_only_teacher_neg
    )
    g = (d * slope) @ s * (grad.to(s.dtype) * 4 / max(d.numel(), 1))
    if norm is not None:
        along = torch.where(norm > 1e-12, (s * g).sum(-1, keepdim=True), 0)
        g = (g - s * along) / norm.clamp_min(1e-12)
    return g.reshape(student.shape).to(student.dtype)


@torch.no_grad()
def gram_clamp_allowance(grad, student, teacher, apply_norm, remove_neg, remove_only_teacher_neg):
    """What rounding alone may change in the clamped Gram loss and its gradient,
    in float64: (a bound on the loss, an elementwise bound on the gradient,
    the share of pairs it covers).

    Clamping makes the loss's slope jump where a similarity crosses 0. A
    similarity computed in the accumulation dtype lies within
    (D + 8) u ||y_i|| ||y_j|| of the exact one (u the unit roundoff), so any
    two computations may clamp a pair within that band of 0 differently; each
    such pair moves the coefficient of y_j in row i's gradient by at most
    |s| + |t| + both bands. Pairs outside the bands add nothing: comparing
    with this allowance stays exact everywhere else. Without clamping it is
    zero."""
    s, norm = _gram_rows(student.to(torch.float64), apply_norm)
    t, _ = _gram_rows(teacher.to(torch.float64), apply_norm)
    u = torch.finfo(_acc(student)).eps / 2
    gamma = (s.shape[-1] + 8) * u
    sim_s, sim_t = s @ s.transpose(1, 2), t @ t.transpose(1, 2)
    n_s, n_t = s.norm(dim=-1, keepdim=True), t.norm(dim=-1, keepdim=True)
    band_s, band_t = gamma * n_s * n_s.transpose(1, 2), gamma * n_t * n_t.transpose(1, 2)
    near = torch.zeros_like(sim_s, dtype=torch.bool)
    if remove_neg:  # only a clamped student makes the slope jump; a clamped teacher is continuous
        near = sim_s.abs() <= band_s
    jump = torch.where(near, sim_s.abs() + sim_t.abs() + band_s + band_t, 0)
    count = max(sim_s.numel(), 1)
    loss_bound = float(2 * jump.square().sum() / count)
    g = jump @ s.abs() * (4 * abs(float(grad)) / count)
    if norm is not None:
        g = (g + s.abs() * (s.abs() * g).sum(-1, keepdim=True)) / norm.clamp_min(1e-12)
    share = float(near.sum()) / count
    return loss_bound, g.reshape(student.shape), share


# ------------------------------------------------------------------ EMA


def _check_ema(teacher: Sequence[torch.Tensor], student: Sequence[torch.Tensor], momentum: float):
    if len(teacher) != len(student):
        raise RuntimeError(
            f"ema_update_: teacher has {len(teacher)} tensors but student has {len(student)}"
        )
    if not (math.isfinite(momentum) and 0.0 <= momentum <= 1.0):
        raise RuntimeError(f"ema_update_: momentum must be in [0, 1], got {momentum}")
    for i, (t, s) in enumerate(zip(teacher, student, strict=True)):
        where = f"ema_update_: teacher[{i}]"
        if s.device != t.device or t.device != teacher[0].device:
            devices = f"student[{i}] on {s.device}, teacher[0] on {teacher[0].device}"
            raise RuntimeError(f"{where} is on {t.device}, {devices}: one device for all")
        if t.dtype not in _FLOATS or s.dtype not in _FLOATS:
            raise RuntimeError(f"{where} is {t.dtype} and student[{i}] {s.dtype}: floats only")
        if t.shape != s.shape:
            raise RuntimeError(
                f"{where} has shape {tuple(t.shape)} but student[{i}] has shape {tuple(s.shape)}"
            )
        if t.requires_grad:
            raise RuntimeError(
                f"{where} requires grad; the teacher is updated in place and must not "
                "require grad (call teacher.requires_grad_(False))"
            )


@torch.no_grad()
def ema_update_torch(teacher, student, momentum):
    """``dino_opt::ema_update_`` in plain torch: ``torch._foreach_lerp_`` for
    pairs of one dtype, float32 (float64) arithmetic for mixed pairs."""
    _check_ema(teacher, student, momentum)
    if not teacher:
        return
    weight = 1.0 - momentum
    same = [i for i, (t, s) in enumerate(zip(teacher, student, strict=True)) if t.dtype == s.dtype]
    if same:
        torch._foreach_lerp_([teacher[i] for i in same], [student[i] for i in same], weight)
    for i in sorted(set(range(len(teacher))) - set(same)):
        t, s = teacher[i], student[i]
        acc = torch.float64 if t.dtype == torch.float64 else torch.float32
        t.copy_(torch.lerp(t.to(acc), s.to(acc), weight))


@torch.no_grad()
def _photometric(images, params, mean, std, dtype=None, channels_last=False):
    out_dtype = dtype if dtype is not None else torch.float32
    return photometric_torch(images, params, mean, std, out_dtype, channels_last)


#: Operator -> its plain-torch form, and the argument whose device it runs on.
FALLBACK_OPS = {
    "dino_opt::dino_loss": (dino_loss_torch, lambda args: args[0].device),
    "dino_opt::dino_loss_backward": (dino_loss_backward_torch, lambda args: args[1].device),
    "dino_opt::ibot_loss": (ibot_loss_torch, lambda args: args[0].device),
    "dino_opt::ibot_loss_backward": (ibot_loss_backward_torch, lambda args: args[1].device),
    "dino_opt::gram_loss": (gram_loss_torch, lambda args: args[0].device),
    "dino_opt::gram_loss_backward": (gram_loss_backward_torch, lambda args: args[1].device),
    "dino_opt::ema_update_": (
        ema_update_torch,
        lambda args: args[0][0].device if args[0] else None,
    ),
    "dino_opt::multicrop_photometric": (_photometric, lambda args: args[0].device),
}


def _kernel(op: str, form, device_of):
    """The registered kernel: warns once per device type, then the plain form."""
    name = op.split("::")[1]

    def kernel(*args):
        device = device_of(args)
        if device is not None:  # None: empty lists, nothing runs
            _warn_once(name, device)
        return form(*args)

    return kernel


for _op, (_form, _device_of) in FALLBACK_OPS.items():
    torch.library.register_kernel(_op, None, _kernel(_op, _form, _device_of))
