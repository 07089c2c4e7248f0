"""``dino_opt::multicrop_photometric`` in plain PyTorch, for devices without a compiled kernel."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

__all__ = ["photometric_torch"]

_OP = "multicrop_photometric"
_COLUMNS = 13  # len(PHOTOMETRIC_PARAM_COLUMNS)
_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# torchvision's solarize compares with 128/255 rounded to float32 (the comparison
# with a Python float runs in the tensor's float32), so 128/255 itself is inverted.
_SOLARIZE_THRESHOLD = 128 / 255

# An op of the pipeline: (crops [G, 3, H, W] float32, their params [G, 13]) -> crops.
_Op = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# A stage: the op and the crops it runs on (a LongTensor of crop indices, None for all).
_Stage = tuple[torch.Tensor | None, _Op]


@torch.no_grad()
def photometric_torch(
    images: torch.Tensor,
    params: torch.Tensor,
    mean: Sequence[float],
    std: Sequence[float],
    dtype: torch.dtype | None = torch.float32,
    channels_last: bool = False,
) -> torch.Tensor:
    """The portable form of ``dino_opt::multicrop_photometric``: the same
    arguments, semantics and result, in plain torch ops on any device.

    ``images``: uint8 ``[N, H, W, 3]`` RGB crops; ``params``: float32 ``[N, 13]``
    on the same device, one row per crop (``PHOTOMETRIC_PARAM_COLUMNS``); see
    ``dino_opt.ops.multicrop_photometric`` for the meaning of every column.
    Returns ``[N, 3, H, W]`` of ``dtype`` (float32, bfloat16 or float16; None
    is float32), in channels_last memory format when asked, on ``images``'s
    device. Per crop, on ``x = u8 / 255`` in float32 (never rounded to uint8
    between ops): colour jitter in the row's order (identity factors skipped,
    nothing at all when ``jitter`` is 0), grayscale, separable Gaussian blur
    (``2 ceil(3 sigma) + 1`` taps per axis, clamped to ``2 (side - 1) + 1``,
    reflect padding, vertical then horizontal, taps added in ascending order),
    solarize, normalise, horizontal flip; one rounding to ``dtype`` at the end.

    The arithmetic is the kernels' (csrc/loader/photometric_math.h) op for op,
    batched over the crops: each op runs once per position of the order on the
    crops that have it there, the blur once per distinct kernel size. On the
    CPU it gives the CPU kernel's bits in every test so far; only the float64
    sums behind the blur taps and the contrast mean run in another order, which
    could move a result by a float32 ulp. Other devices round their exp and
    reductions their own way (~1e-7); MPS, which has no float64, computes the
    contrast mean and the blur taps in float32 (a further ~1e-7).

    Synchronisation: ``params`` is read back to the host once (one small copy,
    which waits for the device), to check the rows, to group the crops by
    blur kernel size and to skip ops no crop uses; the crop indices of the
    groups go back in one small copy before any work is queued. Everything
    else runs asynchronously on the device.

    Errors: ``RuntimeError`` with the kernels' messages, invalid parameter
    rows included (named ``params[i]``, as the CPU kernel does; the CUDA
    kernel, which does not read params back, applies them "safely" instead).
    Dtypes are named as torch prints them (``torch.float64``, not ``Double``).
    Not differentiable.
    """
    norm_mean, norm_std, out_dtype = _check_args(images, params, mean, std, dtype)
    n, h, w, _ = images.shape
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    out = torch.empty((n, 3, h, w), dtype=out_dtype, device=images.device, memory_format=fmt)
    if n == 0:
        return out
    params = params.detach()
    host = params.to("cpu")  # the one read back
    _check_rows(host)
    if h == 0 or w == 0:
        return out
    stages = _ship(_plan(host, h, w, _normalizer(norm_mean, norm_std)), images.device)
    x = _to_unit(images)
    for rows, op in stages:
        x = _apply(x, params, rows, op)
    return out.copy_(x)


# ------------------------------------------------------------------ checks


def _fmt(v: float) -> str:
    """A number as C++'s ``ostream <<`` prints it (``%g``)."""
    return format(v, "g")


def _error(message: str) -> RuntimeError:
    return RuntimeError(f"{_OP}: {message}")


def _check_args(images, params, mean, std, dtype) -> tuple[list[float], list[float], torch.dtype]:
    """The kernels' argument checks (csrc/ops/photometric.cpp), in their order."""
    if not isinstance(images, torch.Tensor) or not isinstance(params, torch.Tensor):
        raise _error("images and params must be tensors")
    layout = "[N, H, W, 3] (RGB crops, channels last)"
    if images.dtype != torch.uint8:
        raise _error(f"images must be uint8 {layout}, got dtype {images.dtype}")
    if images.dim() != 4 or images.shape[3] != 3:
        raise _error(f"images must have shape {layout}, got {list(images.shape)}")
    if params.device != images.device:
        raise _error(
            f"params is on {params.device} but images is on {images.device}; "
            "both must be on one device"
        )
    if params.dtype != torch.float32:
        raise _error(f"params must be float32 [N, {_COLUMNS}], got dtype {params.dtype}")
    if params.dim() != 2 or params.shape[1] != _COLUMNS:
        raise _error(
            f"params must have shape [N, {_COLUMNS}] (one row of flip, jitter, brightness, "
            "contrast, saturation, hue, order[4], grayscale, blur_sigma, solarize per crop), "
            f"got {list(params.shape)}"
        )
    if params.shape[0] != images.shape[0]:
        raise _error(
            f"params has {params.shape[0]} rows but images has N={images.shape[0]} crops; "
            "one row per crop"
        )
    mean, std = [float(m) for m in mean], [float(s) for s in std]
    for name, values in (("mean", mean), ("std", std)):
        if len(values) != 3:
            raise _error(f"{name} must have 3 values (R, G, B), got {len(values)}")
    for c in range(3):
        if not math.isfinite(mean[c]):
            raise _error(f"mean[{c}] must be finite, got {_fmt(mean[c])}")
        if not math.isfinite(std[c]) or std[c] == 0.0:
            raise _error(f"std[{c}] must be finite and nonzero, got {_fmt(std[c])}")
        if torch.tensor(std[c], dtype=torch.float32).item() == 0.0:
            raise _error(f"std[{c}] = {_fmt(std[c])} rounds to 0 in float32")
    out_dtype = torch.float32 if dtype is None else dtype
    if out_dtype not in _OUT_DTYPES:
        raise _error(f"dtype must be float32, bfloat16 or float16, got {out_dtype}")
    return mean, std, out_dtype


def _valid_rows(rows: torch.Tensor) -> torch.Tensor:
    """[N] bool: which parameter rows are valid (the conditions of _row_error)."""
    flags = rows[:, [0, 1, 10, 12]]
    factors, hue, order, sigma = rows[:, 2:5], rows[:, 5], rows[:, 6:10], rows[:, 11]
    is_permutation = (order.sort(dim=1).values == torch.arange(4, dtype=rows.dtype)).all(1)
    return (
        ((flags == 0) | (flags == 1)).all(1)
        & (factors.isfinite() & (factors >= 0)).all(1)
        & (hue >= -0.5)
        & (hue <= 0.5)
        & is_permutation
        & sigma.isfinite()
        & (sigma >= 0)
    )


def _row_error(row: list[float]) -> str:
    """Why a parameter row is invalid, as loader::photometric_params_error says it, or ""."""
    for name, c in (("flip", 0), ("jitter", 1), ("grayscale", 10), ("solarize", 12)):
        if row[c] not in (0.0, 1.0):
            return f"{name} (column {c}) must be 0 or 1, got {_fmt(row[c])}"
    for c, name in enumerate(("brightness", "contrast", "saturation"), start=2):
        if not (math.isfinite(row[c]) and row[c] >= 0.0):
            return f"{name} (column {c}) must be finite and >= 0, got {_fmt(row[c])}"
    if not (-0.5 <= row[5] <= 0.5):
        return f"hue (column 5) must be in [-0.5, 0.5], got {_fmt(row[5])}"
    if sorted(row[6:10]) != [0.0, 1.0, 2.0, 3.0]:  # False with a NaN, as it should be
        got = ", ".join(_fmt(v) for v in row[6:10])
        return f"order (columns 6-9) must be a permutation of 0, 1, 2, 3, got {got}"
    if not (math.isfinite(row[11]) and row[11] >= 0.0):
        return f"blur_sigma (column 11) must be finite and >= 0, got {_fmt(row[11])}"
    return ""


def _check_rows(host: torch.Tensor) -> None:
    """Raises for the first invalid row, as the CPU kernel does."""
    for i in (~_valid_rows(host)).nonzero().flatten().tolist():
        error = _row_error(host[i].tolist())
        if error:
            raise _error(f"params[{i}]: {error}")


# ------------------------------------------------------------------ plan


def _decode_ops(host: torch.Tensor) -> torch.Tensor:
    """[N, 5] op codes per slot, as photometric_math.h's decode_crop_ops: slots
    0-3 the jitter order (0 brightness, 1 contrast, 2 saturation, 3 hue), slot 4
    grayscale (4); -1 where the slot does nothing (jitter off, an identity
    factor, an order entry that is not 0..3). Rows are valid here, so the order
    is a permutation (the kernels also skip repeated entries)."""
    order = host[:, 6:10]
    valid = (order == 0) | (order == 1) | (order == 2) | (order == 3)
    code = torch.where(valid, order, -1.0).long()
    factor = host[:, 2:6].gather(1, code.clamp(min=0))
    identity = torch.where(code == 3, factor == 0, factor == 1)
    jitter = (host[:, 1] != 0).unsqueeze(1)
    code = torch.where(identity | ~jitter, -1, code)
    gray = torch.where(host[:, 10] != 0, 4, -1).unsqueeze(1)
    return torch.cat([code, gray], dim=1)


def _blur_radius(sigma: torch.Tensor, side: int) -> torch.Tensor:
    """[N] blur radius along a side: ceil(3 sigma) in double, clamped to side - 1
    (reflect padding needs a pad smaller than the side); 0 for no blur."""
    radius = torch.where(sigma > 0, torch.ceil(3.0 * sigma.double()), 0.0)
    return radius.clamp(max=max(side - 1, 0)).long()


def _stage(mask: torch.Tensor, op: _Op) -> list[_Stage]:
    """The stage running `op` on the crops of `mask` (none: no stage)."""
    if not mask.any():
        return []
    return [(None if mask.all() else mask.nonzero().flatten(), op)]


def _plan(host: torch.Tensor, h: int, w: int, normalize: _Op) -> list[_Stage]:
    """The stages of the pipeline, in order, from the parameters on the host."""
    codes = _decode_ops(host)
    stages: list[_Stage] = []
    for slot in range(5):
        for code in codes[:, slot].unique().tolist():
            if code >= 0:
                stages += _stage(codes[:, slot] == code, _COLOUR_OPS[code])
    radii = torch.stack([_blur_radius(host[:, 11], h), _blur_radius(host[:, 11], w)], dim=1)
    for ry, rx in sorted(set(map(tuple, radii.tolist()))):
        if ry > 0 or rx > 0:
            stages += _stage((radii == torch.tensor([ry, rx])).all(1), _blur_op(ry, rx))
    stages += _stage(host[:, 12] != 0, _solarize)
    stages.append((None, normalize))
    stages += _stage(host[:, 0] != 0, _flip)
    return stages


def _ship(stages: list[_Stage], device: torch.device) -> list[_Stage]:
    """The stages with their crop indices on `device`, in one copy."""
    index = [rows for rows, _ in stages if rows is not None]
    if not index:
        return stages
    shipped = iter(torch.cat(index).to(device).split([len(rows) for rows in index]))
    return [(None if rows is None else next(shipped), op) for rows, op in stages]


def _apply(
    x: torch.Tensor, params: torch.Tensor, rows: torch.Tensor | None, op: _Op
) -> torch.Tensor:
    """`op` on the crops `rows` of `x` (all for None); `x` may be updated in place."""
    if rows is None:
        return op(x, params)
    return x.index_copy_(0, rows, op(x.index_select(0, rows), params.index_select(0, rows)))


# ------------------------------------------------------------------ colour ops


def _scalar(value: float, device: torch.device) -> torch.Tensor:
    """A float32 0-dim tensor on `device`, made there (no host-to-device copy).
    Dividing by it is a true division on every device, where CUDA multiplies
    by the reciprocal of a Python scalar divisor (an ulp off)."""
    return torch.full((), value, dtype=torch.float32, device=device)


def _wide(device: torch.device) -> torch.dtype:
    """The dtype of the kernels' double sums: float64, float32 on MPS (no float64)."""
    return torch.float32 if device.type == "mps" else torch.float64


def _to_unit(images: torch.Tensor) -> torch.Tensor:
    """uint8 [N, H, W, 3] -> float32 [N, 3, H, W] in [0, 1], correctly rounded."""
    return images.permute(0, 3, 1, 2).to(torch.float32) / _scalar(255.0, images.device)


def _factor(p: torch.Tensor, column: int) -> torch.Tensor:
    return p[:, column].view(-1, 1, 1, 1)


def _gray(x: torch.Tensor) -> torch.Tensor:
    """[G, 1, H, W] ITU-R 601-2 luma, summed as the kernels (and torchvision) sum it."""
    return (x[:, 0:1] * 0.2989 + x[:, 1:2] * 0.587) + x[:, 2:3] * 0.114


def _brightness(x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    return (x * _factor(p, 2)).clamp_(0.0, 1.0)


def _contrast(x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Blend with the crop's mean gray value, summed in float64 like the kernels."""
    f = _factor(p, 3)
    total = _gray(x).sum(dim=(1, 2, 3), keepdim=True, dtype=_wide(x.device))
    mean = (total / (x.shape[2] * x.shape[3])).to(torch.float32)
    # 1 - f in float32 is float(1 - double(f)), torchvision's: that double rounding is innocuous.
    return (x * f + mean * (1.0 - f)).clamp_(0.0, 1.0)


def _saturation(x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    f = _factor(p, 4)
    return (x * f + _gray(x) * (1.0 - f)).clamp_(0.0, 1.0)


def _hue(x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """torchvision's rgb -> hsv, h <- (h + f) mod 1, hsv -> rgb, as
    photometric_math.h's hue writes it (one reciprocal of max - min)."""
    r, g, b = x[:, 0:1], x[:, 1:2], x[:, 2:3]
    maxc = torch.maximum(torch.maximum(r, g), b)
    minc = torch.minimum(torch.minimum(r, g), b)
    flat = maxc == minc  # grey: s = 0 and h = 0, no division by zero
    span = maxc - minc
    s = span / torch.where(flat, 1.0, maxc)
    inv_span = torch.reciprocal(torch.where(flat, 1.0, span))
    rc, gc, bc = (maxc - r) * inv_span, (maxc - g) * inv_span, (maxc - b) * inv_span
    # The sector of the maximum decides the formula; r wins ties, then g.
    h6 = torch.where(maxc == r, bc - gc, torch.where(maxc == g, (rc + 2.0) - bc, (gc + 4.0) - rc))
    h = h6 * (1.0 / 6.0) + 1.0
    h = torch.where(h >= 1.0, h - 1.0, h)
    h = h + _factor(p, 5)
    h = torch.where(h >= 1.0, h - 1.0, h)
    h = torch.where(h < 0.0, h + 1.0, h)
    return _hsv_to_rgb(h, s, maxc)


def _hsv_to_rgb(h: torch.Tensor, s: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """torchvision's _hsv2rgb for h in [0, 1]: [G, 3, H, W]."""
    hh = h * 6.0
    sector = torch.floor(hh)  # in 0..6: h may round to 1
    frac = hh - sector
    sector = torch.where(sector >= 6.0, sector - 6.0, sector)
    sxf = s * frac
    one_minus_s = 1.0 - s
    q = ((1.0 - sxf) * v).clamp_(0.0, 1.0)
    t = ((sxf + one_minus_s) * v).clamp_(0.0, 1.0)
    p = (one_minus_s * v).clamp_(0.0, 1.0)

    def pick(k: torch.Tensor) -> torch.Tensor:
        # r over sectors 0..5 is [v q p p t v]; g at sector k is r at k + 4, b r at k + 2.
        inner = torch.where(k == 1, q, torch.where(k == 4, t, p))
        return torch.where((k == 0) | (k == 5), v, inner)

    return torch.cat([pick(sector), pick((sector + 4.0) % 6.0), pick((sector + 2.0) % 6.0)], 1)


def _grayscale(x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    gray = _gray(x)
    return torch.cat([gray, gray, gray], dim=1)


_COLOUR_OPS: tuple[_Op, ...] = (_brightness, _contrast, _saturation, _hue, _grayscale)


# ------------------------------------------------------------------ blur, solarize, normalise


def _gaussian_taps(sigma: torch.Tensor, radius: int) -> torch.Tensor:
    """[G, 2 radius + 1] float32: exp(-k^2 / (2 sigma^2)) / sum for k = -radius..radius,
    computed in float64 and rounded once, as photometric_math.h's gaussian_weights."""
    wide = _wide(sigma.device)
    k = torch.arange(-radius, radius + 1, dtype=wide, device=sigma.device)
    z = k / sigma.to(wide).unsqueeze(1)
    e = torch.exp(-0.5 * z * z)
    return (e / e.sum(dim=1, keepdim=True)).to(torch.float32)


def _convolve(x: torch.Tensor, taps: torch.Tensor, dim: int) -> torch.Tensor:
    """1-D convolution of each crop along `dim` (2: vertical, 3: horizontal) with
    its own taps [G, K], reflect padding, the terms added in ascending tap order."""
    radius = (taps.shape[1] - 1) // 2
    pad = (0, 0, radius, radius) if dim == 2 else (radius, radius, 0, 0)
    padded = torch.nn.functional.pad(x, pad, mode="reflect")
    size = x.shape[dim]
    acc = taps[:, 0].view(-1, 1, 1, 1) * padded.narrow(dim, 0, size)
    for k in range(1, taps.shape[1]):
        acc += taps[:, k].view(-1, 1, 1, 1) * padded.narrow(dim, k, size)
    return acc


def _blur_op(ry: int, rx: int) -> _Op:
    """The separable Gaussian blur of the crops whose radii are (ry, rx)."""

    def blur(x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        sigma = p[:, 11]
        if ry > 0:
            x = _convolve(x, _gaussian_taps(sigma, ry), dim=2)
        if rx > 0:
            x = _convolve(x, _gaussian_taps(sigma, rx), dim=3)
        return x

    return blur


def _solarize(x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    return torch.where(x >= _SOLARIZE_THRESHOLD, 1.0 - x, x)


def _normalizer(mean: list[float], std: list[float]) -> _Op:
    """(x - mean) / std per channel, with float32 statistics made on x's device."""

    def normalize(x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        m = torch.stack([_scalar(v, x.device) for v in mean]).view(1, 3, 1, 1)
        s = torch.stack([_scalar(v, x.device) for v in std]).view(1, 3, 1, 1)
        return (x - m) / s

    return normalize


def _flip(x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    return x.flip(3)
