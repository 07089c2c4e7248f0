"""The install's self-check behind ``dino-opt doctor`` (:mod:`dino_opt.cli.doctor`):
what this install is and whether its operators are right on this machine,
in a few seconds.

It prints the versions (dino_opt, torch running and built against, CUDA,
the driver), which kernels the build compiled for which devices, the device,
then runs every fused operator on the device against its plain-torch form on
fresh random inputs, values and gradients, one line per check. Where the
device has no compiled kernel (the operator runs its plain-torch form), the
check compares with the CPU kernel instead.
"""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
import sys
import time
from collections.abc import Callable

import torch

from .ops import (
    PHOTOMETRIC_PARAM_COLUMNS,
    build_info,
    dino_loss_backward_torch,
    dino_loss_torch,
    ema_update_torch,
    gram_clamp_allowance,
    gram_loss_backward_torch,
    gram_loss_torch,
    ibot_loss_backward_torch,
    ibot_loss_torch,
    photometric_torch,
)

__all__ = ["Check", "environment", "kernel_table", "run_checks"]


@dataclasses.dataclass
class Check:
    """One operator checked on one device: the largest difference from the
    reference against its tolerance."""

    name: str
    error: float
    tolerance: float
    seconds: float
    reference: str

    @property
    def ok(self) -> bool:
        return self.error <= self.tolerance  # False for NaN

    def line(self) -> str:
        verdict = "ok  " if self.ok else "FAIL"
        versus = f"(tolerance {self.tolerance:.0e}, vs {self.reference})"
        return f"{verdict} {self.name:<34} max|diff| {self.error:.2e} {versus} {self.ms:7.1f} ms"

    @property
    def ms(self) -> float:
        return 1000 * self.seconds


def _driver() -> str:
    """The NVIDIA driver's version from nvidia-smi, or why there is none."""
    if shutil.which("nvidia-smi") is None:
        return "none (no nvidia-smi)"
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        )
    except (OSError, subprocess.SubprocessError) as e:
        return f"unknown ({e})"
    return out.stdout.strip().splitlines()[0] if out.stdout.strip() else "unknown"


def _device_text(device: torch.device) -> str:
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"{device} ({torch.cuda.get_device_name(device)}, sm_{major}{minor})"
    return str(device)


def environment(device: torch.device) -> list[tuple[str, str]]:
    """(what, value) rows: versions, the build, the device."""
    info = build_info()
    return [
        ("dino_opt", info["version"]),
        (
            "torch",
            f"{info['torch_version']} (dino_opt built against {info['torch_version_built']})",
        ),
        ("python", sys.version.split()[0]),
        ("torch CUDA", torch.version.cuda or "none (a CPU build of torch)"),
        ("NVIDIA driver", _driver()),
        ("compilers", f"{info['cxx_compiler']}; CUDA: {info['cuda_compiler'] or 'none'}"),
        ("CPU kernels", f"{info['cpu_kernels']}, {torch.get_num_threads()} threads"),
        ("image formats", ", ".join(info["image_formats"])),
        ("device", _device_text(device)),
    ]


def kernel_table(device: torch.device) -> list[tuple[str, str]]:
    """(device type, what runs there) for CPU, CUDA and this device."""
    info = build_info()
    archs = ", ".join(f"sm_{a}" for a in info["cuda_archs"])
    rows = [("cpu", f"compiled ({info['cpu_kernels']})")]
    if info["cuda_compiled"]:
        rows.append(("cuda", f"compiled for {archs}"))
    else:
        rows.append(("cuda", "not compiled: plain-torch forms (install the CUDA toolkit, rebuild)"))
    if device.type not in ("cpu", "cuda"):
        rows.append((device.type, "not compiled: plain-torch forms"))
    return rows


def _compiled_for(device: torch.device) -> bool:
    return device.type == "cpu" or (device.type == "cuda" and build_info()["cuda_compiled"])


def _max_diff(
    a: torch.Tensor,
    b: torch.Tensor,
    scale: torch.Tensor | None = None,
    allowance: torch.Tensor | float = 0.0,
) -> float:
    """max|a - b| beyond `allowance` (elementwise, or one number) (over
    max|scale|), in float64 on a CPU or CUDA device (a GPU's inputs are too
    large to copy back), else on the CPU."""
    where = a.device if a.device.type in ("cpu", "cuda") else torch.device("cpu")
    diff = (a.detach().to(where, torch.float64) - b.detach().to(where, torch.float64)).abs()
    if isinstance(allowance, torch.Tensor):
        allowance = allowance.to(where, torch.float64)
    diff = (diff - allowance).clamp_min(0).max()
    if scale is not None:
        diff = diff / scale.detach().to(where, torch.float64).abs().max().clamp_min(1e-30)
    return float(diff)


def _loss_tolerance(dtype: torch.dtype, max_logit: float) -> float:
    """Relative tolerance of a fused loss against its plain form. In float32
    each softmax carries a relative error of about eps x max|logit| (the
    rounding of the logits and of their log-sum-exp), in both forms."""
    if dtype in (torch.float32, torch.float64):
        return 1e-5 + 4 * torch.finfo(dtype).eps * max_logit
    return 2e-2


def _timed(fn: Callable[[], object], device: torch.device) -> tuple[object, float]:
    start = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out, time.perf_counter() - start


def _loss_inputs(device, dtype, gen, batch, dim, views):
    student = torch.randn(views * batch, dim, generator=gen, device=gen.device) * 3
    teacher = torch.randn(2 * batch, dim, generator=gen, device=gen.device) * 3
    center = torch.randn(dim, generator=gen, device=gen.device) * 0.1
    return [x.to(device=device, dtype=dtype) for x in (student, teacher)] + [center.to(device)]


def _check_loss(device, dtype, gen, size) -> Check:
    """The loss and its gradient, the operator with autograd vs the plain form."""
    student, teacher, center = _loss_inputs(device, dtype, gen, *size)
    args = (0.1, 0.04, size[2])
    x = student.clone().requires_grad_(True)

    def fused():
        loss = torch.ops.dino_opt.dino_loss(x, teacher, center, *args)[0]
        loss.backward()
        return loss

    loss, seconds = _timed(fused, device)
    ref_device = device if _compiled_for(device) else torch.device("cpu")
    s, t, c = (v.to(ref_device) for v in (student, teacher, center))
    ref_loss, s_lse, t_lse = dino_loss_torch(s, t, c, *args)
    one = torch.ones((), device=ref_device)
    ref_grad = dino_loss_backward_torch(one, s, t, c, s_lse, t_lse, *args)
    error = max(_max_diff(loss, ref_loss, ref_loss), _max_diff(x.grad, ref_grad, ref_grad))
    max_logit = max(student.abs().max().item() / args[0], teacher.abs().max().item() / args[1])
    tol = _loss_tolerance(dtype, max_logit)
    name = f"dino_loss fwd+bwd {str(dtype)[6:]} {size[0]}x{size[1]}x{size[2]}"
    return Check(name, error, tol, seconds, _reference(device))


def _check_ibot(device, dtype, gen, size) -> Check:
    """The iBOT loss and its gradient, the operator with autograd vs the plain
    form; a bfloat16 student takes float32 targets, as under autocast."""
    rows, dim = size
    where = gen.device
    student = (torch.randn(rows, dim, generator=gen, device=where) * 3).to(device, dtype)
    targets = torch.softmax(torch.randn(rows, dim, generator=gen, device=where) / 0.3, -1)
    targets = targets.to(device=device, dtype=torch.float32 if dtype == torch.bfloat16 else dtype)
    weights = (torch.rand(rows, generator=gen, device=where) + 0.5).to(device) / rows
    x = student.clone().requires_grad_(True)

    def fused():
        loss = torch.ops.dino_opt.ibot_loss(x, targets, weights, 0.1)[0]
        loss.backward()
        return loss

    loss, seconds = _timed(fused, device)
    ref_device = device if _compiled_for(device) else torch.device("cpu")
    s, t, w = (v.to(ref_device) for v in (student, targets, weights))
    ref_loss, lse = ibot_loss_torch(s, t, w, 0.1)
    one = torch.ones((), device=ref_device)
    ref_grad = ibot_loss_backward_torch(one, s, t, w, lse, 0.1)
    error = max(_max_diff(loss, ref_loss, ref_loss), _max_diff(x.grad, ref_grad, ref_grad))
    tol = _loss_tolerance(dtype, student.abs().max().item() / 0.1)
    name = f"ibot_loss fwd+bwd {str(dtype)[6:]} {rows}x{dim}"
    return Check(name, error, tol, seconds, _reference(device))


def _check_gram(device, dtype, gen, size) -> Check:
    """The Gram loss (over the batch, clamped as dinov3's default) and its
    gradient, the operator with autograd vs the plain form in float64."""
    rows, dim = size
    student = torch.randn(rows, dim, generator=gen, device=gen.device) + 0.2
    teacher = student + 0.5 * torch.randn(rows, dim, generator=gen, device=gen.device)
    student, teacher = student.to(device, dtype), teacher.to(device, dtype)
    options = (True, True, False, 0)  # apply_norm, remove_neg, remove_only_teacher_neg, form
    x = student.clone().requires_grad_(True)

    def fused():
        loss = torch.ops.dino_opt.gram_loss(x, teacher, *options)
        loss.backward()
        return loss

    loss, seconds = _timed(fused, device)
    ref_device = device if _compiled_for(device) else torch.device("cpu")
    # In float64 on the same rounded inputs: the operator's own error, not
    # the plain form's float32 rounding as well.
    s, t = student.to(ref_device, torch.float64), teacher.to(ref_device, torch.float64)
    ref_loss = gram_loss_torch(s, t, *options)
    one = torch.ones((), device=ref_device, dtype=torch.float64)
    ref_grad = gram_loss_backward_torch(one, s, t, *options)
    # Pairs within rounding of 0 may be clamped on the other side of it.
    loss_allow, grad_allow, _ = gram_clamp_allowance(1.0, student, teacher, *options[:3])
    error = max(
        _max_diff(loss, ref_loss, ref_loss, loss_allow),
        _max_diff(x.grad, ref_grad, ref_grad, grad_allow),
    )
    # similarities are at most 1: the "logits" of this loss
    tol = _loss_tolerance(dtype, 1.0)
    name = f"gram_loss fwd+bwd {str(dtype)[6:]} {rows}x{dim}"
    return Check(name, error, tol, seconds, "plain torch, float64")


def _reference(device: torch.device) -> str:
    return "plain torch" if _compiled_for(device) else "the CPU kernel"


def _check_ema(device, dtype, gen, numel) -> Check:
    shapes = [(numel,), (37, 5), (3, 64, 7), (1,)]
    teacher = [torch.randn(s, generator=gen).to(device, dtype) for s in shapes]
    student = [torch.randn(s, generator=gen).to(device) for s in shapes]  # float32: mixed pairs
    expected = [t.clone() for t in teacher]
    _, seconds = _timed(lambda: torch.ops.dino_opt.ema_update_(teacher, student, 0.996), device)
    if _compiled_for(device):
        ema_update_torch(expected, student, 0.996)
    else:
        cpu = [t.cpu() for t in expected]
        torch.ops.dino_opt.ema_update_(cpu, [s.cpu() for s in student], 0.996)
        expected = cpu
    error = max(_max_diff(a, b, b) for a, b in zip(teacher, expected, strict=True))
    tol = 1e-6 if dtype in (torch.float32, torch.float64) else 1e-2
    return Check(f"ema_update_ {str(dtype)[6:]} teacher", error, tol, seconds, _reference(device))


def _photometric_params(n: int, gen: torch.Generator) -> torch.Tensor:
    rows = torch.zeros(n, len(PHOTOMETRIC_PARAM_COLUMNS))
    rand = torch.rand(n, 6, generator=gen)
    rows[:, 0] = rand[:, 0] < 0.5  # flip
    rows[:, 1] = rand[:, 1] < 0.8  # jitter
    rows[:, 2:5] = 0.6 + 0.8 * torch.rand(n, 3, generator=gen)  # brightness, contrast, saturation
    rows[:, 5] = 0.2 * torch.rand(n, generator=gen) - 0.1  # hue
    rows[:, 6:10] = torch.stack([torch.randperm(4, generator=gen) for _ in range(n)])
    rows[:, 10] = rand[:, 2] < 0.2  # grayscale
    rows[:, 11] = torch.where(rand[:, 3] < 0.5, 0.1 + 1.9 * rand[:, 4], 0.0)  # blur sigma
    rows[:, 12] = rand[:, 5] < 0.2  # solarize
    return rows


def _check_photometric(device, gen, size) -> Check:
    images = torch.randint(0, 256, (8, size, size, 3), generator=gen, dtype=torch.uint8)
    params = _photometric_params(8, gen)
    images, params = images.to(device), params.to(device)
    mean, std = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
    op = torch.ops.dino_opt.multicrop_photometric
    out, seconds = _timed(lambda: op(images, params, mean, std, torch.float32, False), device)
    if _compiled_for(device):
        ref = photometric_torch(images, params, mean, std, torch.float32, False)
    else:
        ref = op(images.cpu(), params.cpu(), mean, std, torch.float32, False)
    name = f"multicrop_photometric 8x{size}x{size}"
    return Check(name, _max_diff(out, ref), 1e-4, seconds, _reference(device))


def run_checks(device: torch.device, seed: int = 0) -> list[Check]:
    """Every fused operator on ``device`` against its reference; sizes a GPU
    trains with on a GPU, small ones on the CPU."""
    gen = torch.Generator().manual_seed(seed)
    # the losses' large inputs are drawn on the GPU itself
    big = torch.Generator(device).manual_seed(seed) if device.type == "cuda" else gen
    loss_size = (64, 65536, 10) if device.type == "cuda" else (8, 2048, 4)
    checks = []
    ibot_size = (4096, 65536) if device.type == "cuda" else (64, 2048)
    for dtype in (torch.float32, torch.bfloat16):
        checks.append(_check_loss(device, dtype, big, loss_size))
    for dtype in (torch.float32, torch.bfloat16):
        checks.append(_check_ibot(device, dtype, big, ibot_size))
    # its float64 reference and allowance hold about ten N x N float64 matrices (1.3 GB)
    gram_size = (4096, 1024) if device.type == "cuda" else (512, 64)
    checks.append(_check_gram(device, torch.float32, big, gram_size))
    for dtype in (torch.float32, torch.bfloat16):
        checks.append(_check_ema(device, dtype, gen, 1 << 16))
    checks.append(_check_photometric(device, gen, 96 if device.type != "cpu" else 32))
    return checks
