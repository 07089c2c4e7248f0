"""The optimizer's parameter groups: DINO's two (weight decay on weights,
none on biases and norms) and DINOv2's, with a learning-rate multiplier per
ViT layer (layer-wise decay, the patch embedding's multiplier), a
weight-decay multiplier and the last-layer flag.

Every group carries ``lr_multiplier``, ``wd_multiplier`` and
``is_last_layer``; :meth:`~dino_opt.train.MemoryOptimizedDINOTrainer.set_schedules`
sets ``lr = schedule * lr_multiplier`` (the last-layer schedule for flagged
groups, when there is one) and ``weight_decay = schedule * wd_multiplier``.
"""

from __future__ import annotations

from collections import defaultdict

from torch import nn

__all__ = ["dinov2_param_groups", "layer_id", "param_groups"]

# Parameters of the ViT's input side: layer 0 of the layer-wise decay.
_EMBEDDINGS = ("pos_embed", "patch_embed", "mask_token", "cls_token")


def param_groups(model: nn.Module) -> list[dict]:
    """DINO's two groups: weight decay on weights, none on biases and norms
    (every parameter with fewer than two dimensions)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim <= 1 or name.endswith(".bias") else decay).append(p)
    return [
        {"params": decay, "lr_multiplier": 1.0, "wd_multiplier": 1.0, "is_last_layer": False},
        {
            "params": no_decay,
            "weight_decay": 0.0,
            "lr_multiplier": 1.0,
            "wd_multiplier": 0.0,
            "is_last_layer": False,
        },
    ]


def layer_id(name: str, n_blocks: int) -> int:
    """The layer of a student parameter for the layer-wise decay: 0 for the
    embeddings (position, patch, mask and class tokens), i + 1 for ViT block
    i, ``n_blocks + 1`` for everything after the blocks (final norm,
    registers, heads), as DINOv2 numbers them."""
    if not name.startswith("backbone."):
        return n_blocks + 1
    rest = name[len("backbone.") :]
    if rest.split(".")[0] in _EMBEDDINGS:
        return 0
    if rest.startswith("blocks."):
        return int(rest.split(".")[1]) + 1
    return n_blocks + 1


def _multipliers(
    name: str, n_blocks: int, decay: float, patch_mult: float, backbone_mult: float
) -> tuple:
    lr_mult = decay ** (n_blocks + 1 - layer_id(name, n_blocks))
    if ".patch_embed." in f".{name}":
        lr_mult *= patch_mult
    if name.startswith("backbone."):
        lr_mult *= backbone_mult
    no_wd = name.endswith(".bias") or "norm" in name or "gamma" in name
    return lr_mult, 0.0 if no_wd else 1.0, "last_layer" in name


def dinov2_param_groups(
    model: nn.Module,
    layerwise_decay: float = 1.0,
    patch_embed_lr_mult: float = 1.0,
    backbone_lr_mult: float = 1.0,
) -> list[dict]:
    """DINOv2's groups of a student (a module with ``backbone`` and heads):
    block i of n gets ``layerwise_decay ** (n + 1 - layer_id)`` times the
    learning rate, the patch embedding ``patch_embed_lr_mult`` more, every
    backbone parameter ``backbone_lr_mult`` (adapting released weights); biases,
    norms and LayerScale gammas no weight decay; the heads' last layers are
    flagged. Parameters with equal multipliers share one group."""
    backbone = getattr(model, "backbone", None)
    n_blocks = len(backbone.blocks) if hasattr(backbone, "blocks") else 0
    groups: dict[tuple, dict] = defaultdict(lambda: {"params": []})
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        name = name.replace("module.", "", 1) if name.startswith("module.") else name
        key = _multipliers(name, n_blocks, layerwise_decay, patch_embed_lr_mult, backbone_lr_mult)
        group = groups[key]
        group["lr_multiplier"], group["wd_multiplier"], group["is_last_layer"] = key
        group["params"].append(p)
    return list(groups.values())
