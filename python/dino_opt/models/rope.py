"""Rotary position embedding (RoPE) of DINOv3 (Simeoni et al., 2025) for the
patch tokens of a Vision Transformer.

Each patch has the coordinates of its centre, ``(i + 0.5) / H`` and
``(j + 0.5) / W`` (normalised by each side, ``separate``; or both by the
shorter side, ``min``, or the longer, ``max``), mapped to [-1, 1]. A head of
``D`` channels has ``D / 4`` periods, ``base ** (2 k / (D / 2))`` (base 100),
or spread geometrically from ``min_period`` to ``max_period``. The angles
``2 pi coord / period`` of the row coordinate, then of the column coordinate,
fill half a head (``D / 2``); the layout is rotate-half: the angles repeat
for the second half, and a query or key ``x`` becomes
``x cos + rotate_half(x) sin`` with ``rotate_half(x1, x2) = (-x2, x1)``.

In training mode the coordinates can be augmented, one draw per call, as
DINOv3 does (all off by default): a shift of both axes uniform in
``[-shift, shift]``, a jitter multiplying each axis by its own log-uniform
factor in ``[1 / jitter, jitter]``, and a rescale multiplying both by one
log-uniform factor in ``[1 / rescale, rescale]``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

__all__ = [
    "ROPE_NORMALIZATIONS",
    "RopePositionEmbedding",
    "apply_rope",
    "augment_coords",
    "patch_coords",
    "rope_periods",
    "rope_sin_cos",
    "rotate_half",
]

#: How patch coordinates are normalised: each side by its own length, or both
#: by the shorter / longer side.
ROPE_NORMALIZATIONS = ("separate", "min", "max")


def rope_periods(
    head_dim: int,
    base: float | None = 100.0,
    min_period: float | None = None,
    max_period: float | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """The ``head_dim / 4`` periods of a head: ``base ** (2 k / (head_dim / 2))``,
    or from ``min_period`` to ``max_period`` geometrically (give ``base`` or
    both periods, not both)."""
    both = min_period is not None and max_period is not None
    if (base is None) == (not both) or (min_period is None) != (max_period is None):
        raise ValueError(
            f"RoPE periods: give base or min_period and max_period, got base={base}, "
            f"min_period={min_period}, max_period={max_period}"
        )
    if head_dim % 4:
        raise ValueError(f"RoPE: head_dim must be a multiple of 4, got {head_dim}")
    n = head_dim // 4
    if base is not None:
        return base ** (2 * torch.arange(n, dtype=dtype, device=device) / (head_dim // 2))
    ratio = max_period / min_period
    exponents = torch.linspace(0, 1, n, dtype=dtype, device=device)
    return ratio**exponents / ratio * max_period


def patch_coords(
    h: int,
    w: int,
    normalize: str = "separate",
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Centres of an ``h`` x ``w`` grid of patches in [-1, 1], row-major,
    shape (h * w, 2) as (row, column)."""
    if normalize not in ROPE_NORMALIZATIONS:
        raise ValueError(
            f"RoPE normalize_coords must be one of "
            f"{', '.join(ROPE_NORMALIZATIONS)}, got {normalize!r}"
        )
    side = {"separate": (h, w), "min": (min(h, w),) * 2, "max": (max(h, w),) * 2}[normalize]
    rows = torch.arange(0.5, h, dtype=dtype, device=device) / side[0]
    cols = torch.arange(0.5, w, dtype=dtype, device=device) / side[1]
    coords = torch.stack(torch.meshgrid(rows, cols, indexing="ij"), dim=-1).flatten(0, 1)
    return 2.0 * coords - 1.0


def augment_coords(
    coords: torch.Tensor,
    shift: float | None = None,
    jitter: float | None = None,
    rescale: float | None = None,
) -> torch.Tensor:
    """DINOv3's training-time augmentation of coordinates (n, 2), in this
    order: shift both axes by a draw uniform in ``[-shift, shift]`` each,
    scale each axis by ``exp(uniform(-log jitter, log jitter))``, scale both by
    one ``exp(uniform(-log rescale, log rescale))``. None: that step is off."""
    dd = {"dtype": coords.dtype, "device": coords.device}
    if shift is not None:
        coords = coords + torch.empty(2, **dd).uniform_(-shift, shift)
    if jitter is not None:
        top = math.log(jitter)
        coords = coords * torch.empty(2, **dd).uniform_(-top, top).exp()
    if rescale is not None:
        top = math.log(rescale)
        coords = coords * torch.empty(1, **dd).uniform_(-top, top).exp()
    return coords


def rope_sin_cos(
    coords: torch.Tensor, periods: torch.Tensor, dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sines and cosines (n, 4 * len(periods)) of the angles
    ``2 pi coord / period`` (row angles, then column angles, repeated for the
    second half of the head), computed in ``dtype`` (default: the periods')."""
    dtype = dtype or periods.dtype
    angles = 2 * math.pi * coords.to(dtype)[:, :, None] / periods.to(dtype)[None, None, :]
    angles = angles.flatten(1, 2).tile(2)
    return angles.sin(), angles.cos()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``(x1, x2) -> (-x2, x1)`` over the halves of the last dimension."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, sin: torch.Tensor, cos: torch.Tensor) -> torch.Tensor:
    """``x`` (..., N, D) with its last ``n`` tokens rotated, ``n`` = the rows of
    ``sin`` and ``cos`` (n, D); the first ``N - n`` tokens (class and register
    tokens) are kept. Computed in the wider of the two dtypes and returned in
    ``x``'s."""
    prefix = x.shape[-2] - sin.shape[-2]
    if prefix < 0:
        raise ValueError(f"apply_rope: {sin.shape[-2]} positions for {x.shape[-2]} tokens")
    work = torch.promote_types(x.dtype, sin.dtype)
    patches = x[..., prefix:, :].to(work)
    rotated = patches * cos.to(work) + rotate_half(patches) * sin.to(work)
    return torch.cat((x[..., :prefix, :], rotated.to(x.dtype)), dim=-2)


class RopePositionEmbedding(nn.Module):
    """DINOv3's RoPE: ``forward(h, w)`` gives ``(sin, cos)``, each
    (h * w, head_dim), for an ``h`` x ``w`` patch grid.

    Args:
        embed_dim, num_heads: the attention's shape; a head has
            ``embed_dim / num_heads`` channels, a multiple of 4.
        base: period base (DINOv3: 100); or None with ``min_period`` and
            ``max_period``.
        normalize_coords: one of :data:`ROPE_NORMALIZATIONS`.
        shift_coords, jitter_coords, rescale_coords: training-time coordinate
            augmentation (see :func:`augment_coords`); None: off.
        dtype: the precision of periods and coordinates (DINOv3's published
            backbones: float32). Angles, sines and cosines are computed in the
            wider of it and the dtype asked of ``forward``.

    The module holds no parameters or buffers: periods are recomputed on each
    call (a few numbers), so it builds on the meta device and has nothing to
    shard or load.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        base: float | None = 100.0,
        min_period: float | None = None,
        max_period: float | None = None,
        normalize_coords: str = "separate",
        shift_coords: float | None = None,
        jitter_coords: float | None = None,
        rescale_coords: float | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        if embed_dim % (4 * num_heads):
            raise ValueError(
                f"RoPE: embed_dim {embed_dim} must be a multiple of 4 x num_heads ({4 * num_heads})"
            )
        _check_augmentation(shift_coords, jitter_coords, rescale_coords)
        self.head_dim = embed_dim // num_heads
        self.base, self.min_period, self.max_period = base, min_period, max_period
        rope_periods(self.head_dim, base, min_period, max_period, device="meta")  # checks them
        patch_coords(1, 1, normalize_coords, device="meta")  # checks the normalisation
        self.normalize_coords = normalize_coords
        self.shift_coords = shift_coords
        self.jitter_coords = jitter_coords
        self.rescale_coords = rescale_coords
        self.dtype = dtype

    @property
    def augmenting(self) -> bool:
        """Whether calls draw augmented coordinates (training mode, some augmentation set)."""
        augs = (self.shift_coords, self.jitter_coords, self.rescale_coords)
        return self.training and any(a is not None for a in augs)

    def periods(self, device: torch.device | str | None = None) -> torch.Tensor:
        """The head's ``head_dim / 4`` periods, in the module's dtype."""
        return rope_periods(
            self.head_dim,
            self.base,
            self.min_period,
            self.max_period,
            dtype=self.dtype,
            device=device,
        )

    def forward(
        self,
        h: int,
        w: int,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        coords = patch_coords(h, w, self.normalize_coords, dtype=self.dtype, device=device)
        if self.augmenting:
            coords = augment_coords(
                coords, self.shift_coords, self.jitter_coords, self.rescale_coords
            )
        work = self.dtype if dtype is None else torch.promote_types(self.dtype, dtype)
        return rope_sin_cos(coords, self.periods(device), work)

    def extra_repr(self) -> str:
        periods = (
            f"base={self.base}"
            if self.base is not None
            else f"min_period={self.min_period}, max_period={self.max_period}"
        )
        named = (
            ("shift", self.shift_coords),
            ("jitter", self.jitter_coords),
            ("rescale", self.rescale_coords),
        )
        augs = [f"{k}={v}" for k, v in named if v is not None]
        return ", ".join([f"head_dim={self.head_dim}", periods, self.normalize_coords, *augs])


def _check_augmentation(shift: float | None, jitter: float | None, rescale: float | None) -> None:
    if shift is not None and not shift >= 0:
        raise ValueError(f"RoPE shift_coords must be >= 0 (or None: off), got {shift}")
    for name, value in (("jitter_coords", jitter), ("rescale_coords", rescale)):
        if value is not None and not value >= 1:
            raise ValueError(f"RoPE {name} is a factor >= 1 (or None: off), got {value}")
