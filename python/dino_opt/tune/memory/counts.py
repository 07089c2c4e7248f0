"""The parameters a memory estimate counts: a config's student and teacher
built on the meta device (no memory, no compute), their parameters grouped
as FSDP shards them (each transformer block, each head, the rest of the
model at the root), and the ViT's shape the activation formulas read."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ...config import Config
from ...train import build_models, recipe_of
from .distill import parameter_numel

__all__ = ["ModelCounts", "count_model", "shard_numel"]


@dataclass(frozen=True)
class ModelCounts:
    """The parameters of a config's student and teacher (counted on the meta
    device) and the ViT's shape.

    ``units`` maps each FSDP unit of the student (``root``, ``blocks.i``,
    ``head``, ``ibot_head``) to its parameters' shapes, and whether they
    train; the teacher has the same units. ``ffn_hidden`` is the MLP's width,
    or SwiGLU's hidden width (``w3``'s input). ``teacher`` counts the
    recipe's ``frozen_copies`` of the teacher's backbone too (the dinov3
    recipe's Gram teacher), which FSDP shards as the teacher's backbone (its
    units but the heads)."""

    student: int
    trainable: int
    teacher: int
    units: dict[str, tuple[tuple[tuple[int, ...], bool], ...]]
    embed_dim: int
    depth: int
    num_heads: int
    ffn: str
    ffn_hidden: int
    layerscale: bool
    extra_tokens: int
    patch_size: int
    head_weight: int
    frozen_copies: int = 0

    def local(
        self, world_size: int, *, trainable_only: bool = False, unit: str | None = None
    ) -> int:
        """Elements of rank 0's FSDP shards (each parameter split along its
        first dimension into ``world_size`` padded chunks), of every unit or
        of ``unit``; ``trainable_only``: of the trained parameters."""
        total = 0
        for name, shapes in self.units.items():
            if unit is not None and name != unit:
                continue
            for shape, trains in shapes:
                if trains or not trainable_only:
                    total += shard_numel(shape, world_size)
        return total

    def unit_size(self, name: str) -> int:
        return sum(math.prod(shape) for shape, _ in self.units[name])

    @property
    def largest_unit(self) -> int:
        return max(self.unit_size(n) for n in self.units if n != "root")

    @property
    def largest_pair(self) -> int:
        """The most parameters of two units next to each other in the order
        the backward pass visits them (a unit and the one prefetched)."""
        sizes = [self.unit_size(n) for n in self.units if n != "root"]
        return (
            max(a + b for a, b in zip(sizes, sizes[1:], strict=False))
            if len(sizes) > 1
            else sizes[0]
        )

    @property
    def head_units(self) -> list[str]:
        return [n for n in self.units if n in ("head", "ibot_head")]

    def local_frozen(self, world_size: int) -> int:
        """Elements of rank 0's shards of the frozen copies of the backbone."""
        units = [n for n in self.units if n not in self.head_units]
        return self.frozen_copies * sum(self.local(world_size, unit=n) for n in units)


def shard_numel(shape: tuple[int, ...], world: int) -> int:
    """Elements of rank 0's shard of a parameter of ``shape`` (FSDP splits dim 0)."""
    if not shape:
        return 1
    return math.ceil(shape[0] / world) * math.prod(shape[1:])


def count_model(cfg: Config) -> ModelCounts:
    """The parameters and shape of ``cfg``'s ViT student and teacher, built
    on the meta device (:func:`~dino_opt.train.build_models`)."""
    if not cfg.model.backbone.startswith("vit"):
        raise ValueError(
            f"the memory model covers ViT backbones; model.backbone is {cfg.model.backbone!r}"
        )
    with torch.device("meta"):
        student, teacher = build_models(cfg)
    vit, block = student.backbone, student.backbone.blocks[0]
    mlp = block.mlp
    hidden = mlp.fc1.out_features if hasattr(mlp, "fc1") else mlp.w3.in_features
    copies = recipe_of(cfg).frozen_backbone_copies(cfg)  # frozen copies of the teacher's backbone
    return ModelCounts(
        student=parameter_numel(student),
        trainable=parameter_numel(student, trainable=True),
        teacher=parameter_numel(teacher) + copies * parameter_numel(teacher.backbone),
        units=_units(student),
        embed_dim=vit.embed_dim,
        depth=len(vit.blocks),
        num_heads=vit.num_heads,
        ffn="mlp" if hasattr(mlp, "fc1") else "swiglu",
        ffn_hidden=hidden,
        layerscale=not isinstance(block.ls1, nn.Identity),
        extra_tokens=1 + vit.num_register_tokens,
        patch_size=vit.patch_size,
        head_weight=sum(
            h.last_layer.weight_v.numel()
            for h in _heads(student).values()
            if hasattr(h, "last_layer")
        ),  # a DINO head's (not a projector's)
        frozen_copies=copies,
    )


def _heads(student: nn.Module) -> dict[str, nn.Module]:
    heads = {"head": student.head}
    if getattr(student, "ibot_head", None) is not None:
        heads["ibot_head"] = student.ibot_head
    return heads


def _units(student: nn.Module) -> dict[str, tuple]:
    """Parameter shapes per FSDP unit: each block, each head, the root."""
    groups: dict[str, list[nn.Module]] = {
        f"blocks.{i}": [b] for i, b in enumerate(student.backbone.blocks)
    }
    groups.update({name: [h] for name, h in _heads(student).items()})
    seen = {id(p) for mods in groups.values() for m in mods for p in m.parameters()}
    units = {
        "root": tuple(
            (tuple(p.shape), p.requires_grad) for p in student.parameters() if id(p) not in seen
        )
    }
    for name, mods in groups.items():
        units[name] = tuple((tuple(p.shape), p.requires_grad) for m in mods for p in m.parameters())
    return units
