"""A backbone's image-level and patch-level features, whatever the backbone:
the class token and the patch tokens of a ViT (after its final norm), the
pooled feature and the last feature map of a convolutional network (a
torchvision ResNet, or any module with ``forward_features`` returning the
ViTs' keys, such as a ConvNeXt), as ``[B, C]`` and ``[B, h * w, C]`` with
the grid ``(h, w)``."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

__all__ = ["Tokens", "backbone_tokens", "feature_width", "pool_to_grid", "resnet_map"]


class Tokens(NamedTuple):
    """``cls`` [B, C], ``patches`` [B, h * w, C] (row-major) and ``grid`` (h, w)."""

    cls: torch.Tensor
    patches: torch.Tensor
    grid: tuple[int, int]


def feature_width(backbone: nn.Module) -> int:
    """The width of a backbone's features: a ViT's or ConvNeXt's
    ``embed_dim``, a torchvision ResNet's last stage's channels."""
    width = getattr(backbone, "embed_dim", None)
    if width is None and hasattr(backbone, "layer4"):
        width = backbone.inplanes  # torchvision leaves it at the last stage's output
    if width is None:
        raise ValueError(f"{type(backbone).__name__}: its feature width is not known")
    return int(width)


def resnet_map(net: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The last feature map of a torchvision ResNet (before its pooling)."""
    x = net.maxpool(net.relu(net.bn1(net.conv1(x))))
    return net.layer4(net.layer3(net.layer2(net.layer1(x))))


def _grid(images: torch.Tensor, n: int) -> tuple[int, int]:
    """The grid of ``n`` tokens over an image of ``images``' height and
    width, from their common stride."""
    h, w = images.shape[-2:]
    stride = round((h * w / max(n, 1)) ** 0.5)
    if stride < 1 or (h // stride) * (w // stride) != n:
        raise ValueError(f"{n} patch tokens do not tile a {h} x {w} image on a square grid")
    return h // stride, w // stride


def backbone_tokens(backbone: nn.Module, images: torch.Tensor) -> Tokens:
    """The :class:`Tokens` of ``images`` [B, 3, H, W] through ``backbone``: a
    ViT's normalised class and patch tokens (``forward_features``), or a
    ResNet's global average and its last feature map, flattened."""
    if hasattr(backbone, "forward_features"):
        out = backbone.forward_features(images)
        patches = out["x_norm_patchtokens"]
        return Tokens(out["x_norm_clstoken"], patches, _grid(images, patches.shape[1]))
    if all(hasattr(backbone, n) for n in ("conv1", "layer4")):
        fmap = resnet_map(backbone, images)
        return Tokens(fmap.mean((-2, -1)), fmap.flatten(-2).transpose(1, 2), tuple(fmap.shape[-2:]))
    raise ValueError(
        f"{type(backbone).__name__} gives no patch features (neither forward_features nor a "
        "ResNet's layers)"
    )


def pool_to_grid(patches: torch.Tensor, grid: tuple[int, int], to: tuple[int, int]) -> torch.Tensor:
    """``patches`` [B, h * w, C] on ``grid`` (h, w) averaged over blocks onto
    the coarser grid ``to``, which must divide it side by side (ValueError
    naming both grids otherwise)."""
    (h, w), (th, tw) = grid, to
    if (h, w) == (th, tw):
        return patches
    if th < 1 or tw < 1 or h % th or w % tw:
        raise ValueError(
            f"a {h} x {w} grid of patch features cannot be aligned with a {th} x {tw} grid (each "
            "side must be a whole multiple of the other's)"
        )
    maps = patches.transpose(1, 2).unflatten(-1, (h, w))
    pooled = nn.functional.avg_pool2d(maps, (h // th, w // tw))
    return pooled.flatten(-2).transpose(1, 2)
