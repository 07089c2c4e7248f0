"""DINOv3's names, for code written against facebookresearch/dinov3, each
with dinov3's constructor and call, backed by dino_opt: the Gram anchoring
loss (``dinov3.loss.GramLoss``) and the hub's backbones
(``dinov3.hub.backbones``: ``dinov3_vits16`` ... ``dinov3_vit7b16``, DINOv3's
ViTs with RoPE; ``weights`` a local file of DINOv3's released weights).

    from dino_opt.dinov3 import GramLoss, dinov3_vitl16
    backbone = dinov3_vitl16(weights="dinov3_vitl16_pretrain_lvd1689m-8aa4cbdd.pth")

The training recipe itself is ``recipe.name: dinov3`` of ``dino-opt train``
(docs/dinov3.md).
"""

from __future__ import annotations

import os
from enum import Enum
from pathlib import Path
from urllib.parse import urlparse
from urllib.request import url2pathname

import torch

from .models import (
    DinoV3VisionTransformer,
    convert_dinov3_state_dict,
    vit_7b_dinov3,
    vit_base_dinov3,
    vit_huge_plus_dinov3,
    vit_large_dinov3,
    vit_large_plus_dinov3,
    vit_small_dinov3,
    vit_small_plus_dinov3,
)
from .ops.gram_loss import GramLoss

__all__ = [
    "GramLoss",
    "Weights",
    "dinov3_vit7b16",
    "dinov3_vitb16",
    "dinov3_vith16plus",
    "dinov3_vitl16",
    "dinov3_vitl16plus",
    "dinov3_vits16",
    "dinov3_vits16plus",
]

# The file-name hash of DINOv3's ViT-L/16 trained on satellite images, whose
# local crops' class tokens have a norm of their own (as dinov3's hub reads it).
_SAT_VITL_HASH = "eadcf0ff"


class Weights(Enum):
    """The released weights' names of dinov3's hub."""

    LVD1689M = "LVD1689M"
    SAT493M = "SAT493M"


def _weights_file(weights, name: str) -> Path:
    """A local path (or ``file://`` URL) of the weights; DINOv3's released
    files are fetched by their users (after accepting their license), not here."""
    if isinstance(weights, Weights):
        raise ValueError(
            f"{name}: pretrained=True needs weights=<path of the .pth file> (DINOv3's "
            f"{weights.value} weights are downloaded after accepting their license; dino_opt "
            "does not fetch them), or pretrained=False"
        )
    text = os.fspath(weights)
    parsed = urlparse(text)
    if parsed.scheme not in ("", "file"):
        raise ValueError(f"{name}: weights {text!r}: give a local file or a file:// URL")
    path = Path(url2pathname(parsed.path) if parsed.scheme == "file" else text).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"{name}: weights {str(path)!r} do not exist")
    return path


def _hub(name: str, build, pretrained: bool, weights, **kwargs) -> DinoV3VisionTransformer:
    """A hub backbone: dinov3's settings (a mask token, as its checkpoints have
    one), its released weights loaded strictly when ``pretrained``."""
    kwargs.pop("check_hash", None)
    kwargs.setdefault("pos_embed_rope_rescale_coords", 2.0)  # in training mode only, as the hub's
    model = build(use_mask_token=True, **kwargs)
    if pretrained:
        path = _weights_file(weights, name)
        state = torch.load(path, map_location="cpu", weights_only=True)
        try:
            model.load_state_dict(convert_dinov3_state_dict(state), strict=True)
        except RuntimeError as e:
            first = str(e).splitlines()[1].strip() if "\n" in str(e) else str(e)
            raise ValueError(f"{name}: {path} does not hold its weights ({first})") from None
    return model


def dinov3_vits16(*, pretrained: bool = True, weights=Weights.LVD1689M, **kwargs):
    return _hub("dinov3_vits16", vit_small_dinov3, pretrained, weights, **kwargs)


def dinov3_vits16plus(*, pretrained: bool = True, weights=Weights.LVD1689M, **kwargs):
    return _hub("dinov3_vits16plus", vit_small_plus_dinov3, pretrained, weights, **kwargs)


def dinov3_vitb16(*, pretrained: bool = True, weights=Weights.LVD1689M, **kwargs):
    return _hub("dinov3_vitb16", vit_base_dinov3, pretrained, weights, **kwargs)


def dinov3_vitl16(*, pretrained: bool = True, weights=Weights.LVD1689M, **kwargs):
    """ViT-L/16; the satellite weights (SAT493M, or a file of that hash) have
    a separate norm for the local crops' class tokens, as dinov3's hub builds them."""
    sat = weights == Weights.SAT493M or (
        not isinstance(weights, Weights) and f"-{_SAT_VITL_HASH}" in os.fspath(weights)
    )
    kwargs.setdefault("untie_global_and_local_cls_norm", sat)
    return _hub("dinov3_vitl16", vit_large_dinov3, pretrained, weights, **kwargs)


def dinov3_vitl16plus(*, pretrained: bool = True, weights=Weights.LVD1689M, **kwargs):
    return _hub("dinov3_vitl16plus", vit_large_plus_dinov3, pretrained, weights, **kwargs)


def dinov3_vith16plus(*, pretrained: bool = True, weights=Weights.LVD1689M, **kwargs):
    return _hub("dinov3_vith16plus", vit_huge_plus_dinov3, pretrained, weights, **kwargs)


def dinov3_vit7b16(*, pretrained: bool = True, weights=Weights.LVD1689M, **kwargs):
    return _hub("dinov3_vit7b16", vit_7b_dinov3, pretrained, weights, **kwargs)
