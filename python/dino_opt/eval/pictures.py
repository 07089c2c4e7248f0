"""The pictures people share of a ViT: the last block's attention maps and
the PCA maps of patch features, as PNG grids.

Attention (DINO, Caron et al., 2021, Fig. 1 and ``visualize_attention``):
the class token's attention to the patch tokens in the last block, per head.
The blocks attend through ``scaled_dot_product_attention``, which returns no
weights, so the last block's softmax ``(q k^T / sqrt(d))`` is computed
explicitly; :func:`check_attention` recomputes the block's attention output
from those weights and compares it with the fused block. Register tokens
(Darcet et al., 2023) are left out of the map; the share of the class
token's attention that goes to them, and to itself, is returned beside it.
DINO's thresholded map keeps, per head, the patches holding the top
``threshold`` of the attention mass (renormalised over the patches).

PCA (DINOv2, Oquab et al., 2023, Fig. 1 and 9): a PCA of the normalised
patch tokens over all patches of all the images given; its first component
separates foreground from background (patches scoring above a threshold are
the foreground); a second PCA over the foreground patches only gives three
components mapped to red, green and blue, each min-max scaled over that set,
the background black.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from matplotlib import colormaps
from PIL import Image, ImageDraw, ImageFont, UnidentifiedImageError
from torch import nn

from ..checkpoint import write_file
from ..models import DinoV3VisionTransformer, MultiCropWrapper, VisionTransformer, eval_mode
from ..ops.library import IMAGENET_MEAN, IMAGENET_STD

__all__ = [
    "GAP_PX",
    "PANEL_PX",
    "PICTURE_KINDS",
    "TITLE_PX",
    "attention_grid_arrays",
    "attention_maps",
    "check_attention",
    "feature_pca",
    "load_images",
    "pca_grid_arrays",
    "pca_maps",
    "picture_arrays",
    "safe_stem",
    "save_attention_grid",
    "save_pca_grid",
    "show",
    "split_cls_attention",
    "threshold_attention",
    "write_pictures",
]

#: The kinds of picture :func:`show` and :func:`picture_arrays` draw.
PICTURE_KINDS = ("attention", "pca")
#: Longer side of each panel of a grid, in pixels (default).
PANEL_PX = 224
#: Height of the title strip above the panels, and the gap around each panel.
TITLE_PX = 20
GAP_PX = 4

# ------------------------------------------------------------------ input


def _vit(backbone: nn.Module, who: str) -> VisionTransformer:
    """The ViT inside ``backbone`` (itself, a MultiCropWrapper's or DDP's)."""
    if isinstance(backbone, nn.parallel.DistributedDataParallel):
        backbone = backbone.module
    if isinstance(backbone, MultiCropWrapper):
        backbone = backbone.backbone
    if not isinstance(backbone, VisionTransformer):
        raise ValueError(
            f"{who} needs a dino_opt VisionTransformer (or a MultiCropWrapper of "
            f"one), got {type(backbone).__name__}"
        )
    return backbone


def _checked_images(vit: VisionTransformer, images: torch.Tensor, who: str) -> torch.Tensor:
    """``images`` (B, C, H, W) checked against ``vit`` and moved to its device and dtype."""
    if not isinstance(images, torch.Tensor):
        raise ValueError(
            f"{who}: images must be a tensor (B, 3, H, W), got {type(images).__name__}"
        )
    chans, p = vit.patch_embed.proj.in_channels, vit.patch_size
    if images.ndim != 4 or images.shape[1] != chans or images.shape[0] == 0:
        raise ValueError(
            f"{who}: images must have shape (B >= 1, {chans}, H, W), got {tuple(images.shape)}"
        )
    if not images.is_floating_point():
        raise ValueError(f"{who}: images must be floating point (normalised), got {images.dtype}")
    h, w = images.shape[-2:]
    if h == 0 or w == 0 or h % p or w % p:
        raise ValueError(
            f"{who}: images of {h}x{w} pixels; both sides must be positive multiples "
            f"of the patch size {p} (load_images resizes files so)"
        )
    param = next(vit.parameters())
    return images.to(param.device, param.dtype)


def _check_threshold(threshold: float) -> float:
    if not 0.0 < float(threshold) <= 1.0:
        raise ValueError(
            f"threshold must be a share of the attention mass in (0, 1], got {threshold!r}"
        )
    return float(threshold)


@contextlib.contextmanager
def _evaluating(module: nn.Module) -> Iterator[None]:
    """Evaluation mode without autograd inside; the module's mode is restored after."""
    with eval_mode(module), torch.no_grad():
        yield


def _last_block_input(vit: VisionTransformer, images: torch.Tensor) -> tuple[torch.Tensor, tuple]:
    """The last block's input tokens, and what else its blocks take: a DINOv3
    ViT's RoPE of the patch grid (its attention rotates queries and keys)."""
    if isinstance(vit, DinoV3VisionTransformer):
        x, grid = vit.prepare_tokens_with_masks(images)
        extra = (vit.rope(grid, x),)
    else:
        x, extra = vit.prepare_tokens(images), ()
    for block in vit.blocks[:-1]:
        x = block(x, *extra)
    return x, extra


# ------------------------------------------------------------------ attention


def threshold_attention(attention: torch.Tensor, threshold: float = 0.6) -> torch.Tensor:
    """DINO's thresholded attention: along the last dimension (the patches),
    keep the patches holding the top ``threshold`` of the mass. As DINO's
    ``visualize_attention``: sort the weights ascending, divide them by their
    sum (so the mass is renormalised over the patches given), take the
    cumulative sum and keep a patch where it exceeds ``1 - threshold``; that
    is, the fewest largest patches whose mass reaches ``threshold``. Returns a
    bool tensor of ``attention``'s shape."""
    threshold = _check_threshold(threshold)
    if attention.ndim == 0 or attention.shape[-1] == 0:
        raise ValueError(
            f"threshold_attention: no patches in a tensor of shape {tuple(attention.shape)}"
        )
    values, order = torch.sort(attention, dim=-1, stable=True)
    mass = values / values.sum(dim=-1, keepdim=True)
    keep_sorted = mass.cumsum(dim=-1) > 1.0 - threshold
    return torch.empty_like(keep_sorted).scatter_(-1, order, keep_sorted)


def split_cls_attention(
    cls_row: torch.Tensor, num_register_tokens: int, grid: tuple[int, int], threshold: float = 0.6
) -> dict:
    """The class token's row of attention weights ``cls_row`` (B, heads, N)
    over ``N = 1 + registers + h * w`` tokens, split into the dict returned by
    :func:`attention_maps`."""
    r, (h, w) = int(num_register_tokens), grid
    b, heads, n = cls_row.shape
    if n != 1 + r + h * w:
        raise ValueError(
            f"attention row of {n} tokens; expected 1 + {r} registers + {h}x{w} patches"
        )
    patches = cls_row[..., 1 + r :]
    return {
        "attention": patches.reshape(b, heads, h, w),
        "thresholded": threshold_attention(patches, threshold).reshape(b, heads, h, w),
        "cls_share": cls_row[..., 0],
        "register_share": cls_row[..., 1 : 1 + r].sum(dim=-1),
        "register_attention": cls_row[..., 1 : 1 + r],
        "patch_share": patches.sum(dim=-1),
        "threshold": threshold,
        "num_register_tokens": r,
    }


def attention_maps(backbone: nn.Module, images: torch.Tensor, threshold: float = 0.6) -> dict:
    """The class token's attention to the patches in the last block of a ViT.

    ``images`` (B, 3, H, W), normalised, with H and W multiples of the patch
    size (the position table is interpolated to the grid by the model). The
    model runs in evaluation mode without autograd (its mode is restored).
    Returns a dict (tensors on the model's device; float32, or float64 for a
    float64 model):

    - ``attention`` (B, heads, h, w): the weights of the patches, h = H / patch,
      w = W / patch (not renormalised: with the shares below they sum to 1);
    - ``thresholded`` bool (B, heads, h, w): DINO's map keeping the top
      ``threshold`` of the mass (:func:`threshold_attention`), renormalised
      over the patches only (the class and register tokens left out);
    - ``cls_share``, ``register_share``, ``patch_share`` (B, heads): the
      attention the class token pays itself, the register tokens, the patches;
    - ``register_attention`` (B, heads, registers): per register token;
    - ``threshold``, ``num_register_tokens``.
    """
    vit = _vit(backbone, "attention_maps")
    threshold = _check_threshold(threshold)
    images = _checked_images(vit, images, "attention_maps")
    last = vit.blocks[-1]
    with _evaluating(vit):
        x, extra = _last_block_input(vit, images)
        weights = last.attn.attention_weights(last.norm1(x), *extra)
    grid = (images.shape[-2] // vit.patch_size, images.shape[-1] // vit.patch_size)
    row = weights[:, :, 0]
    row = row if row.dtype == torch.float64 else row.float()
    return split_cls_attention(row, vit.num_register_tokens, grid, threshold)


def check_attention(backbone: nn.Module, images: torch.Tensor) -> float:
    """Self-check of the explicit attention: the last block's attention output
    recomputed from the explicit weights (weights @ v, heads merged, the output
    projection) against the fused block's own output on the same input.
    Returns the largest absolute difference (about 1e-6 in float32 on
    activations of order 1; far larger means the weights drawn are not the
    attention the model computes)."""
    vit = _vit(backbone, "check_attention")
    images = _checked_images(vit, images, "check_attention")
    attn = vit.blocks[-1].attn
    with _evaluating(vit):
        x, extra = _last_block_input(vit, images)
        x = vit.blocks[-1].norm1(x)
        b, n, c = x.shape
        v = attn.qkv(x).reshape(b, n, 3, attn.num_heads, c // attn.num_heads)[:, :, 2]
        heads = attn.attention_weights(x, *extra) @ v.transpose(1, 2)
        explicit = attn.proj(heads.transpose(1, 2).reshape(b, n, c))
        return (explicit - attn(x, *extra)).abs().max().item()


# ------------------------------------------------------------------ PCA


def _components(x: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores (rows, n) of ``x`` (rows, C) on its top ``n`` principal directions
    (each oriented so that its largest loading is positive; zero columns where
    there are fewer directions) and their shares of the variance (n,)."""
    xc = x - x.mean(dim=0, keepdim=True)
    if len(x) < 2:
        return torch.zeros(len(x), n, dtype=x.dtype), torch.zeros(n, dtype=x.dtype)
    eigvals, eigvecs = torch.linalg.eigh(xc.T @ xc)
    k = min(n, x.shape[1])
    vecs = eigvecs[:, -k:].flip(-1)
    signs = torch.sign(vecs[vecs.abs().argmax(dim=0), torch.arange(k)])
    vecs = vecs * torch.where(signs == 0, 1.0, signs)
    total = eigvals.clamp_min(0).sum()
    share = (
        eigvals.flip(-1)[:k].clamp_min(0) / total if total > 0 else torch.zeros(k, dtype=x.dtype)
    )
    scores = xc @ vecs
    return F.pad(scores, (0, n - k)), F.pad(share, (0, n - k))


def _border(h: int, w: int) -> torch.Tensor:
    edge = torch.zeros(h, w, dtype=torch.bool)
    edge[0], edge[-1], edge[:, 0], edge[:, -1] = True, True, True, True
    return edge.reshape(-1)


def _first_component(x: torch.Tensor, border: torch.Tensor, invert: bool):
    """Scores of the first principal component, oriented so that the patches
    on the image borders score lower on average than the others (largest
    loading positive where that does not decide), negated with ``invert``."""
    scores, share = _components(x, 1)
    scores = scores[:, 0]
    if border.any() and (~border).any():
        if scores[border].mean() > scores[~border].mean():
            scores = -scores
    return (-scores if invert else scores), share[0]


def _minmax(scores: torch.Tensor) -> torch.Tensor:
    if len(scores) == 0:
        return scores
    lo, hi = scores.min(dim=0).values, scores.max(dim=0).values
    span = hi - lo
    return torch.where(span > 0, (scores - lo) / span.where(span > 0, 1.0), 0.0)


def _as_grids(features) -> tuple[list[torch.Tensor], bool]:
    if isinstance(features, torch.Tensor):
        if features.ndim != 4 or features.shape[0] == 0:
            raise ValueError(
                f"feature_pca: features must have shape (B >= 1, h, w, C), "
                f"got {tuple(features.shape)}"
            )
        return list(features.unbind(0)), True
    grids = list(features)
    if not grids or any(not isinstance(g, torch.Tensor) or g.ndim != 3 for g in grids):
        raise ValueError(
            "feature_pca: features must be a tensor (B, h, w, C) or a non-empty "
            "list of tensors (h, w, C)"
        )
    if len({g.shape[-1] for g in grids}) != 1:
        raise ValueError(f"feature_pca: feature widths differ: {[g.shape[-1] for g in grids]}")
    return grids, False


def _colours(components: torch.Tensor) -> torch.Tensor:
    """(rows, n) in [0, 1] -> RGB (rows, 3): 3 -> as is, 1 -> grey, 2 -> red and green."""
    n = components.shape[1]
    if n == 1:
        return components.expand(-1, 3)
    return F.pad(components, (0, 3 - n))


def feature_pca(
    features: torch.Tensor | Sequence[torch.Tensor],
    n_components: int = 3,
    foreground: bool = True,
    threshold: float = 0.0,
    invert: bool = False,
) -> dict:
    """DINOv2's PCA picture of patch features ``features`` (B, h, w, C), or a
    list of (h_i, w_i, C) for images of different sizes; see :func:`pca_maps`."""
    if not 1 <= int(n_components) <= 3:
        raise ValueError(f"n_components must be 1, 2 or 3 (mapped to colours), got {n_components}")
    grids, stacked = _as_grids(features)
    x = torch.cat([g.reshape(-1, g.shape[-1]) for g in grids]).detach().cpu().double()
    border = torch.cat([_border(g.shape[0], g.shape[1]) for g in grids])
    first, first_share = _first_component(x, border, invert)
    fg = first > threshold if foreground else torch.ones(len(x), dtype=torch.bool)
    scores, share = _components(x[fg], int(n_components))
    comps = torch.zeros(len(x), int(n_components), dtype=x.dtype)
    comps[fg] = _minmax(scores)
    out = {"rgb": _colours(comps).float(), "first_component": first.float(), "foreground": fg}
    sizes = [g.shape[0] * g.shape[1] for g in grids]
    for key, value in out.items():
        parts = [
            p.reshape(g.shape[0], g.shape[1], *p.shape[1:])
            for p, g in zip(value.split(sizes), grids, strict=True)
        ]
        out[key] = torch.stack(parts) if stacked else parts
    out.update(
        first_variance_share=float(first_share),
        variance_share=share.float(),
        threshold=float(threshold),
        invert=bool(invert),
    )
    return out


def pca_maps(
    backbone: nn.Module,
    images: torch.Tensor | Sequence[torch.Tensor],
    n_components: int = 3,
    foreground: bool = True,
    threshold: float = 0.0,
    invert: bool = False,
) -> dict:
    """DINOv2's PCA maps of the last layer's normalised patch tokens.

    ``images``: a batch (B, 3, H, W), or a list of (3, H_i, W_i) images of
    different sizes (then every map below is a list, one per image). A PCA
    over all patches of all the images gives the first component (centred
    scores, in units of the features). Its sign is fixed so that the patches
    on the image borders score lower on average than the others (the
    background usually touches the border); ``invert=True`` flips it. With
    ``foreground``, the foreground is the patches whose first component is
    above ``threshold`` (0: above the mean of all patches, as DINOv2 removes
    the patches of negative score), and a second PCA over the foreground
    patches gives ``n_components`` (1 to 3) components, each oriented so that
    its largest loading is positive and min-max scaled to [0, 1] over the
    foreground, mapped to red, green, blue (1: grey); the background is black.
    Without ``foreground``, the components of the PCA of all patches are
    mapped. Returns a dict: ``rgb`` (B, h, w, 3) in [0, 1], ``first_component``
    (B, h, w), ``foreground`` bool (B, h, w), ``first_variance_share``,
    ``variance_share`` (n_components,) of the second PCA, ``threshold``,
    ``invert``. Features are taken in evaluation mode; the PCA runs in float64
    on the CPU, so the same images give the same picture."""
    vit = _vit(backbone, "pca_maps")
    batches = [images] if isinstance(images, torch.Tensor) else [i[None] for i in images]
    if not batches:
        raise ValueError("pca_maps: no images given")
    grids = []
    with _evaluating(vit):
        for batch in batches:
            if batch.ndim != 4:
                raise ValueError(
                    f"pca_maps: each image must be (3, H, W), got {tuple(batch.shape[1:])}"
                )
            batch = _checked_images(vit, batch, "pca_maps")
            tokens = vit.forward_features(batch)["x_norm_patchtokens"]
            h, w = batch.shape[-2] // vit.patch_size, batch.shape[-1] // vit.patch_size
            grids.extend(tokens.reshape(len(batch), h, w, -1).unbind(0))
    feats = torch.stack(grids) if isinstance(images, torch.Tensor) else grids
    return feature_pca(feats, n_components, foreground, threshold, invert)


# ------------------------------------------------------------------ grids


def safe_stem(name: str) -> str:
    """``name`` made safe for a file name: runs of characters other than
    letters, digits, ``.``, ``_`` and ``-`` become ``_``; at most 100
    characters; ``image`` when nothing is left."""
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", str(name)).strip("._-")
    return stem[:100] or "image"


def _stems(names: Sequence[str] | None, count: int) -> list[str]:
    names = [f"image{i}" for i in range(count)] if names is None else [str(n) for n in names]
    if len(names) != count:
        raise ValueError(f"{len(names)} names for {count} images")
    used, stems = set(), []
    for name in names:
        stem, k = safe_stem(name), 0
        while (stem if k == 0 else f"{stem}_{k}") in used:
            k += 1
        stems.append(stem if k == 0 else f"{stem}_{k}")
        used.add(stems[-1])
    return stems


def _image_list(images: torch.Tensor | Sequence[torch.Tensor], count: int) -> list[torch.Tensor]:
    images = list(images.unbind(0)) if isinstance(images, torch.Tensor) else list(images)
    if len(images) != count or not images:
        raise ValueError(f"{len(images)} images for maps of {count} images")
    return [img.detach().cpu().float() for img in images]


def _rgb(image: torch.Tensor, size: tuple[int, int], mean, std) -> np.ndarray:
    """A normalised image (3, H, W) back to RGB in [0, 1], resized to ``size``, (h, w, 3)."""
    img = image * torch.tensor(std).view(3, 1, 1) + torch.tensor(mean).view(3, 1, 1)
    img = F.interpolate(img[None], size=size, mode="bilinear", antialias=True, align_corners=False)
    return img[0].clamp(0, 1).permute(1, 2, 0).numpy()


def _upsample(grid: torch.Tensor, size: tuple[int, int]) -> np.ndarray:
    """A patch map (h, w) upsampled to ``size`` by repeating patches (nearest)."""
    return F.interpolate(grid.detach().cpu().float()[None, None], size=size, mode="nearest")[
        0, 0
    ].numpy()


def _coloured(grid: torch.Tensor, size: tuple[int, int], cmap: str = "viridis") -> np.ndarray:
    """A patch map min-max scaled over itself, upsampled and coloured, (h, w, 3)."""
    m = _upsample(grid, size)
    span = m.max() - m.min()
    m = (m - m.min()) / span if span > 0 else np.zeros_like(m)
    return colormaps[cmap](m)[..., :3]


def _diverging(grid: torch.Tensor, centre: float, size: tuple[int, int]) -> np.ndarray:
    """A patch map coloured coolwarm with ``centre`` at the middle (white):
    red above it, blue below, scaled by the largest distance from it."""
    m = _upsample(grid, size) - centre
    reach = np.abs(m).max()
    scaled = 0.5 + 0.5 * m / reach if reach > 0 else np.full_like(m, 0.5)
    return colormaps["coolwarm"](scaled)[..., :3]


def _panel_size(image: torch.Tensor, panel: int) -> tuple[int, int]:
    if isinstance(panel, bool) or not isinstance(panel, int) or panel < 8:
        raise ValueError(f"panel must be an int >= 8 (pixels), got {panel!r}")
    h, w = image.shape[-2:]
    scale = panel / max(h, w)
    return max(1, round(h * scale)), max(1, round(w * scale))


def _compose(panels: list[np.ndarray], titles: list[str]) -> np.ndarray:
    """Panels (h, w, 3) in [0, 1] side by side under their titles -> uint8
    (TITLE_PX + h + GAP_PX, n * w + (n + 1) * GAP_PX, 3), white background."""
    ph, pw = panels[0].shape[:2]
    n = len(panels)
    canvas = np.full((TITLE_PX + ph + GAP_PX, n * pw + (n + 1) * GAP_PX, 3), 255, np.uint8)
    for i, p in enumerate(panels):
        x0 = GAP_PX + i * (pw + GAP_PX)
        canvas[TITLE_PX : TITLE_PX + ph, x0 : x0 + pw] = np.round(np.clip(p, 0, 1) * 255)
    picture = Image.fromarray(canvas)
    draw, font = ImageDraw.Draw(picture), ImageFont.load_default(size=12)
    for i, title in enumerate(titles):
        while len(title) > 1 and draw.textlength(title, font=font) > pw:
            title = title[:-1]
        left, top, right, bottom = draw.textbbox((0, 0), title, font=font)
        x = GAP_PX + i * (pw + GAP_PX) + (pw - (right - left)) / 2 - left
        draw.text((x, (TITLE_PX - (bottom - top)) / 2 - top), title, fill=(0, 0, 0), font=font)
    return np.asarray(picture).copy()


def _attention_row(image, maps: dict, i: int, name: str, panel: int, mean, std) -> np.ndarray:
    size = _panel_size(image, panel)
    attn, r = maps["attention"][i].detach().cpu(), maps["num_register_tokens"]
    reg = maps["register_share"][i].detach().cpu()
    panels, titles = [_rgb(image, size, mean, std)], [name]
    for h in range(attn.shape[0]):
        panels.append(_coloured(attn[h], size))
        titles.append(f"head {h}" + (f", reg {reg[h]:.0%}" if r else ""))
    cls = maps["cls_share"][i].detach().cpu().mean()
    panels.append(_coloured(attn.mean(dim=0), size))
    titles.append(f"mean, cls {cls:.0%}" + (f", reg {reg.mean():.0%}" if r else ""))
    agree = _upsample(maps["thresholded"][i].float().mean(dim=0), size)[..., None]
    red = np.array([1.0, 0.1, 0.1])
    panels.append(panels[0] * (0.35 + 0.65 * (agree > 0)) * (1 - 0.5 * agree) + 0.5 * agree * red)
    titles.append(f"top {maps['threshold']:.0%} mass")
    return _compose(panels, titles)


def attention_grid_arrays(
    images: torch.Tensor | Sequence[torch.Tensor],
    maps: dict,
    names: Sequence[str] | None = None,
    *,
    panel: int = PANEL_PX,
    mean: Sequence[float] = IMAGENET_MEAN,
    std: Sequence[float] = IMAGENET_STD,
) -> list[np.ndarray]:
    """One picture per image of :func:`attention_maps`' ``maps``, as uint8
    (height, width, 3) arrays: a row of panels, each ``panel`` pixels on its
    longer side with the image's aspect, under a title strip: the image
    (un-normalised with ``mean`` and ``std``), each head's map (upsampled by
    repeating patches, min-max scaled per head, viridis; titled with the
    share of the class token's attention that went to the registers), the
    mean over heads (titled with the class token's share on itself), and the
    image overlaid in red by the share of heads whose thresholded map keeps
    each patch (patches no head keeps darkened)."""
    imgs = _image_list(images, len(maps["attention"]))
    stems = names if names is not None else _stems(None, len(imgs))
    _stems(stems, len(imgs))
    return [
        _attention_row(img, maps, i, str(stems[i]), panel, mean, std) for i, img in enumerate(imgs)
    ]


def _pca_row(image, maps: dict, i: int, name: str, panel: int, mean, std) -> np.ndarray:
    size = _panel_size(image, panel)
    fg = maps["foreground"][i].detach().cpu()
    rgb = maps["rgb"][i].detach().cpu().permute(2, 0, 1)
    rgb = F.interpolate(rgb[None].float(), size=size, mode="nearest")[0].permute(1, 2, 0).numpy()
    first = _diverging(maps["first_component"][i], maps["threshold"], size)
    mask = np.repeat(_upsample(fg.float(), size)[..., None], 3, axis=-1)
    panels = [_rgb(image, size, mean, std), first, mask, rgb]
    titles = [
        name,
        f"PC1, {maps['first_variance_share']:.0%} of var",
        f"foreground {fg.float().mean():.0%}",
        "PCA of foreground",
    ]
    return _compose(panels, titles)


def pca_grid_arrays(
    images: torch.Tensor | Sequence[torch.Tensor],
    maps: dict,
    names: Sequence[str] | None = None,
    *,
    panel: int = PANEL_PX,
    mean: Sequence[float] = IMAGENET_MEAN,
    std: Sequence[float] = IMAGENET_STD,
) -> list[np.ndarray]:
    """One picture per image of :func:`pca_maps`' ``maps``, as uint8 arrays
    laid out as :func:`attention_grid_arrays`: the image, the first component
    (coolwarm centred on the threshold: red above it, blue below), the
    foreground mask (white) and the components in RGB (background black)."""
    imgs = _image_list(images, len(maps["rgb"]))
    stems = names if names is not None else _stems(None, len(imgs))
    _stems(stems, len(imgs))
    return [_pca_row(img, maps, i, str(stems[i]), panel, mean, std) for i, img in enumerate(imgs)]


def write_pictures(arrays: list[np.ndarray], names, output_dir, kind: str) -> list[Path]:
    """``arrays`` as ``<stem>_<kind>.png`` in ``output_dir`` (created), each
    written atomically; the stems as :func:`save_attention_grid` makes them."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{stem}_{kind}.png" for stem in _stems(names, len(arrays))]
    for array, path in zip(arrays, paths, strict=True):
        # each picture whole or not at all: a killed run leaves no torn PNG
        write_file(path, lambda f, a=array: Image.fromarray(a).save(f, format="PNG"))
    return paths


def save_attention_grid(
    images, maps: dict, output_dir: str | os.PathLike, names: Sequence[str] | None = None, **kw
) -> list[Path]:
    """Write :func:`attention_grid_arrays` as ``<stem>_attention.png`` in
    ``output_dir`` (created), the stems made from ``names`` (default
    ``image0``, ``image1``, ...) by :func:`safe_stem` (repeats get ``_1``,
    ``_2``, ...); returns the paths. ``kw``: ``panel``, ``mean``, ``std``."""
    return write_pictures(
        attention_grid_arrays(images, maps, names, **kw), names, output_dir, "attention"
    )


def save_pca_grid(
    images, maps: dict, output_dir: str | os.PathLike, names: Sequence[str] | None = None, **kw
) -> list[Path]:
    """Write :func:`pca_grid_arrays` as ``<stem>_pca.png`` in ``output_dir``,
    named as :func:`save_attention_grid`; returns the paths."""
    return write_pictures(pca_grid_arrays(images, maps, names, **kw), names, output_dir, "pca")


# ------------------------------------------------------------------ files and the one call


def _target_size(w0: int, h0: int, image_size, patch: int) -> tuple[int, int]:
    if isinstance(image_size, (tuple, list)):
        if len(image_size) != 2 or any(not isinstance(s, int) or s < 1 for s in image_size):
            raise ValueError(f"image_size must be an int or (height, width), got {image_size!r}")
        h, w = image_size
    else:
        side = 448 if image_size is None else image_size
        if isinstance(side, bool) or not isinstance(side, int) or side < 1:
            raise ValueError(f"image_size must be a positive int or (height, width), got {side!r}")
        h, w = h0 * side / max(w0, h0), w0 * side / max(w0, h0)
    return max(patch, round(h / patch) * patch), max(patch, round(w / patch) * patch)


def _load_one(path: Path, image_size, patch: int, mean, std) -> torch.Tensor:
    if not path.is_file():
        raise FileNotFoundError(f"image file not found: {path}")
    try:
        with Image.open(path) as im:
            im = im.convert("RGB")
    except (UnidentifiedImageError, OSError) as e:
        reason = (str(e).splitlines() or [type(e).__name__])[0]
        raise ValueError(f"cannot read image {path}: {reason}") from None
    h, w = _target_size(im.width, im.height, image_size, patch)
    im = im.resize((w, h), Image.Resampling.BICUBIC)
    x = torch.from_numpy(np.asarray(im).copy()).permute(2, 0, 1).float() / 255.0
    return (x - torch.tensor(mean).view(3, 1, 1)) / torch.tensor(std).view(3, 1, 1)


def load_images(
    paths: str | os.PathLike | Sequence[str | os.PathLike],
    image_size: int | tuple[int, int] | None = None,
    patch_size: int = 16,
    mean: Sequence[float] = IMAGENET_MEAN,
    std: Sequence[float] = IMAGENET_STD,
) -> list[torch.Tensor]:
    """Image files -> normalised tensors (3, H, W), one per file (sizes may
    differ). Each is read with PIL as RGB and resized (bicubic): with
    ``image_size`` None or an int, its longer side to that many pixels (None:
    448), the aspect kept; with ``(height, width)``, to that size; then each
    side to the nearest multiple of ``patch_size`` (at least one patch).
    Normalised with ``mean`` and ``std`` (ImageNet's)."""
    paths = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    if not paths:
        raise ValueError("load_images: no image paths given")
    return [_load_one(Path(p), image_size, int(patch_size), mean, std) for p in paths]


def _check_kind(kind: str) -> str:
    if kind not in PICTURE_KINDS:
        raise ValueError(f"kind must be one of {', '.join(PICTURE_KINDS)}, got {kind!r}")
    return kind


def picture_arrays(
    backbone: nn.Module,
    images: torch.Tensor | Sequence[torch.Tensor],
    kind: str = "attention",
    names: Sequence[str] | None = None,
    *,
    threshold: float = 0.6,
    n_components: int = 3,
    foreground: bool = True,
    pca_threshold: float = 0.0,
    invert: bool = False,
    panel: int = PANEL_PX,
    mean: Sequence[float] = IMAGENET_MEAN,
    std: Sequence[float] = IMAGENET_STD,
) -> list[np.ndarray]:
    """The pictures of ``kind`` (``attention`` or ``pca``) of ``images``
    (normalised, (B, 3, H, W) or a list of (3, H, W)) through ``backbone``, one
    uint8 (height, width, 3) array per image (for TensorBoard's ``add_image``
    with ``dataformats="HWC"``). Attention runs image by image when a list is
    given; the PCA is fitted over all the images together."""
    vit = _vit(backbone, "picture_arrays")
    style = dict(panel=panel, mean=mean, std=std)
    if _check_kind(kind) == "pca":
        maps = pca_maps(vit, images, n_components, foreground, pca_threshold, invert)
        return pca_grid_arrays(images, maps, names, **style)
    if isinstance(images, torch.Tensor):
        return attention_grid_arrays(images, attention_maps(vit, images, threshold), names, **style)
    stems = _stems(names, len(images))
    if not stems:
        raise ValueError("picture_arrays: no images given")
    rows = []
    for img, stem in zip(images, stems, strict=True):
        maps = attention_maps(vit, img[None], threshold)
        rows.extend(attention_grid_arrays(img[None], maps, [stem], **style))
    return rows


def show(
    backbone: nn.Module,
    image_paths: str | os.PathLike | Sequence[str | os.PathLike],
    kind: str = "attention",
    output_dir: str | os.PathLike = ".",
    image_size: int | tuple[int, int] | None = None,
    **options,
) -> list[Path]:
    """Read image files (:func:`load_images`, the backbone's patch size), draw
    the pictures of ``kind`` (``attention`` or ``pca``; ``options`` as
    :func:`picture_arrays`: ``threshold``, ``n_components``, ``foreground``,
    ``pca_threshold``, ``invert``, ``panel``) and write one PNG per image,
    ``<stem>_<kind>.png`` in ``output_dir``, named after the file's stem
    (:func:`safe_stem`). Returns the paths written."""
    vit = _vit(backbone, "show")
    _check_kind(kind)
    paths = [image_paths] if isinstance(image_paths, (str, os.PathLike)) else list(image_paths)
    images = load_images(paths, image_size, vit.patch_size)
    names = _stems([Path(p).stem for p in paths], len(paths))
    return write_pictures(
        picture_arrays(vit, images, kind, names, **options), names, output_dir, kind
    )
