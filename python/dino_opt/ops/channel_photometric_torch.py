"""The per-channel photometric stage in plain PyTorch, for images that are not
8-bit RGB, on the device the crops were sent to (``photometric="gpu"``).

The loader's threads compute the same stage on the CPU
(csrc/loader/channel_photometric.h); this is its device form, the same
arithmetic op for op in float32, with the noise drawn from the same
counter-based field, so both give the same crops up to the rounding of
``exp``, ``log`` and ``cos`` and the order of the blur's and the mean's sums.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

__all__ = ["CHANNEL_PARAM_FIXED", "channel_noise_torch", "channel_photometric_torch"]

#: The columns before the per-channel factors: flip, blur_sigma, noise_std,
#: noise key (high 16 bits), noise key (low 16 bits).
CHANNEL_PARAM_FIXED = 5
_SCALES = {torch.uint8: 255.0, torch.uint16: 65535.0, torch.float32: 1.0}
_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_M32 = 0xFFFFFFFF
_NOISE_CHUNK = 16  # crops whose noise field is drawn at once (bounds the int64 scratch)


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``(x * c) mod 2^32`` for ``x`` in [0, 2^32) without int64 overflow."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + ((x * hi) & 0xFFFF) * 65536) & _M32


def _lowbias32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def channel_noise_torch(keys: torch.Tensor, count: int) -> torch.Tensor:
    """Standard normal samples ``0 .. count - 1`` of the noise fields ``keys``
    (int64, one per row), float64 ``[len(keys), count]``: Box-Muller on
    lowbias32 hashes of ``(2 i) ^ key`` and ``(2 i + 1) ^ key`` (indices mod
    2^32), as the loader's ``channel_noise``."""
    i2 = (torch.arange(count, device=keys.device, dtype=torch.int64) * 2) & _M32
    k = keys.reshape(-1, 1) & _M32
    a = _lowbias32(i2 ^ k).to(torch.float64)
    b = _lowbias32(((i2 + 1) & _M32) ^ k).to(torch.float64)
    u1 = (a + 0.5) / 4294967296.0
    u2 = b / 4294967296.0
    return torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(6.283185307179586 * u2)


def _gaussian_taps(sigma: float, radius: int) -> list[float]:
    """The kernels' taps: exp(-k^2 / 2 sigma^2) / sum in float64, rounded once."""
    k = [i / sigma for i in range(-radius, radius + 1)]
    e = [math.exp(-0.5 * x * x) for x in k]
    total = sum(e)
    return [v / total for v in e]


def _blur_radius(sigma: float, extent: int) -> int:
    return int(min(math.ceil(3.0 * sigma), max(extent - 1, 0))) if sigma > 0 else 0


def _blur(x: torch.Tensor, sigma: float) -> torch.Tensor:
    """One crop ``[C, H, W]`` blurred separably (reflect padding, vertical then horizontal)."""
    c, h, w = x.shape
    ry, rx = _blur_radius(sigma, h), _blur_radius(sigma, w)
    y = x.unsqueeze(0)
    if ry > 0:
        taps = torch.tensor(_gaussian_taps(sigma, ry), dtype=torch.float64).to(x)
        y = F.conv2d(
            F.pad(y, (0, 0, ry, ry), mode="reflect"),
            taps.view(1, 1, -1, 1).repeat(c, 1, 1, 1),
            groups=c,
        )
    if rx > 0:
        taps = torch.tensor(_gaussian_taps(sigma, rx), dtype=torch.float64).to(x)
        y = F.conv2d(
            F.pad(y, (rx, rx, 0, 0), mode="reflect"),
            taps.view(1, 1, 1, -1).repeat(c, 1, 1, 1),
            groups=c,
        )
    return y[0]


@torch.no_grad()
def channel_photometric_torch(
    images: torch.Tensor,
    params: torch.Tensor,
    mean: Sequence[float],
    std: Sequence[float],
    dtype: torch.dtype | None = torch.float32,
    channels_last: bool = False,
) -> torch.Tensor:
    """Augments and normalises crops that are not 8-bit RGB.

    ``images``: ``[N, H, W, C]`` uint8, uint16 or float32 crops (the loader's
    deferred output with ``image_mode="native"``); ``params``: float32
    ``[N, 5 + 2 C]`` on the same device, a row per crop (flip, blur sigma,
    noise std, the noise key's two 16-bit halves, C brightness factors, C
    contrast factors); ``mean``, ``std``: C values in units of
    ``value / 255``, ``value / 65535`` or the float as stored. Returns
    ``[N, C, H, W]`` of ``dtype``. Per crop: brightness, then contrast about
    the channel's mean (clamped to [0, 1] for integer samples), blur,
    normalisation, noise, flip. Raises ``ValueError`` naming a wrong shape,
    dtype or length. ``params`` is read back to the host once (the blur's
    sigmas)."""
    if images.dim() != 4 or images.dtype not in _SCALES:
        raise ValueError(
            f"images must be [N, H, W, C] uint8, uint16 or float32, got {list(images.shape)} "
            f"{images.dtype}"
        )
    n, h, w, c = images.shape
    cols = CHANNEL_PARAM_FIXED + 2 * c
    if params.dtype != torch.float32 or params.shape != (n, cols):
        raise ValueError(
            f"params must be float32 [{n}, {cols}] for {c}-channel crops, got "
            f"{list(params.shape)} {params.dtype}"
        )
    if params.device != images.device:
        raise ValueError(f"params is on {params.device} but images is on {images.device}")
    if len(mean) != c or len(std) != c:
        raise ValueError(f"mean and std need {c} values, got {len(mean)} and {len(std)}")
    out_dtype = torch.float32 if dtype is None else dtype
    if out_dtype not in _OUT_DTYPES:
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {out_dtype}")
    integer = images.dtype != torch.float32
    x = images.permute(0, 3, 1, 2).to(torch.float32) / _SCALES[images.dtype]

    def bound(v: torch.Tensor) -> torch.Tensor:
        return v.clamp(0.0, 1.0) if integer else v

    bright = params[:, CHANNEL_PARAM_FIXED : CHANNEL_PARAM_FIXED + c].reshape(n, c, 1, 1)
    contrast = params[:, CHANNEL_PARAM_FIXED + c :].reshape(n, c, 1, 1)
    x = torch.where(bright != 1.0, bound(x * bright), x)
    channel_mean = (x.sum(dim=(2, 3), dtype=torch.float64) / (h * w)).to(torch.float32)
    one_minus = (1.0 - contrast.to(torch.float64)).to(torch.float32)
    term = channel_mean.reshape(n, c, 1, 1) * one_minus
    x = torch.where(contrast != 1.0, bound(x * contrast + term), x)
    host = params[:, :3].to("cpu")
    sigmas = host[:, 1].tolist()
    if any(s > 0 for s in sigmas):
        x = torch.stack([_blur(x[i], s) if s > 0 else x[i] for i, s in enumerate(sigmas)])
    m = torch.tensor(mean, dtype=torch.float32, device=x.device).reshape(1, c, 1, 1)
    sd = torch.tensor(std, dtype=torch.float32, device=x.device).reshape(1, c, 1, 1)
    x = (x - m) / sd
    noisy = torch.nonzero(host[:, 2] > 0).flatten().tolist()
    for start in range(0, len(noisy), _NOISE_CHUNK):
        rows = torch.tensor(noisy[start : start + _NOISE_CHUNK], device=x.device)
        p = params[rows]
        keys = p[:, 3].to(torch.int64) * 65536 + p[:, 4].to(torch.int64)
        z = channel_noise_torch(keys, c * h * w).to(torch.float32).reshape(-1, c, h, w)
        x[rows] = x[rows] + p[:, 2].reshape(-1, 1, 1, 1) * z
    flip = (params[:, 0] != 0).reshape(n, 1, 1, 1)
    x = torch.where(flip, x.flip(-1), x)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    return x.to(out_dtype).contiguous(memory_format=fmt)
