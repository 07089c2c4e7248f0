"""The memory table ``dino-opt presets --memory-model`` prints: the released
architectures it covers (:data:`MEMORY_ARCHS`), each at its published batch
per GPU and crops, estimated for every strategy, world size and
checkpointing policy; and the largest batch whose estimate fits a memory."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from torch import nn

from ...config import Config, apply_overrides, load_config
from ...models import CHECKPOINT_POLICIES
from ...train import recipe_of
from .counts import ModelCounts, count_model
from .model import STRATEGIES, MemoryEstimate, estimate_memory

__all__ = ["MEMORY_ARCHS", "ArchRow", "arch_config", "largest_batch", "memory_table"]


@dataclass(frozen=True)
class ArchRow:
    """One architecture of the memory table: ``recipe`` (a config or recipe
    name, None for DINO's defaults) with ``overrides``, and where its batch
    size and crops come from."""

    name: str
    label: str
    recipe: str | None
    overrides: tuple[str, ...]
    source: str


MEMORY_ARCHS: dict[str, ArchRow] = {
    r.name: r
    for r in (
        ArchRow(
            "dino_vits16",
            "DINO ViT-S/16",
            None,
            ("data.batch_size=64", "augmentation.num_local_views=10"),
            "DINO's released ViT-S/16 run: 64 per GPU on 16 GPUs, 2 x 224 + 10 x 96",
        ),
        ArchRow(
            "dino_vitb16",
            "DINO ViT-B/16",
            None,
            ("model.backbone=vit_base", "data.batch_size=32", "augmentation.num_local_views=10"),
            "DINO's released ViT-B/16 run: 32 per GPU on 32 GPUs, 2 x 224 + 10 x 96",
        ),
        ArchRow(
            "dinov2_vits14",
            "DINOv2 ViT-S/14",
            "dinov2_vits14",
            (),
            "DINOv2's default recipe: 64 per GPU, 2 x 224 + 8 x 98, shared 65536 head",
        ),
        ArchRow(
            "dinov2_vitb14",
            "DINOv2 ViT-B/14",
            "dinov2_vits14",
            ("model.backbone=vit_base",),
            "DINOv2's default recipe on ViT-B/14: 64 per GPU, 2 x 224 + 8 x 98",
        ),
        ArchRow(
            "dinov2_vitl14",
            "DINOv2 ViT-L/14",
            "dinov2_vitl14",
            (),
            "DINOv2's ViT-L/14 config: 32 per GPU, SwiGLU, heads of 131072",
        ),
        ArchRow(
            "dinov2_vitg14",
            "DINOv2 ViT-g/14",
            "dinov2_vitg14",
            (),
            "DINOv2's ViT-g/14 config: 12 per GPU, SwiGLU, heads of 131072",
        ),
        ArchRow(
            "dinov3_vitl16",
            "DINOv3 ViT-L/16, Gram",
            "dinov3_vitl16_gram_anchor",
            ("recipe.gram.ckpt=gram.pt",),
            "DINOv3's Gram anchoring stage on ViT-L/16: 16 per GPU, 2 x 256 + 8 x 112, "
            "Gram teacher at 512, heads of 65536",
        ),
        ArchRow(
            "dinov3_vit7b16",
            "DINOv3 ViT-7B/16, Gram",
            "dinov3_vitl16_gram_anchor",
            (
                "recipe.gram.ckpt=gram.pt",
                "model.backbone=vit_7b_dinov3",
                "model.out_dim=262144",
                "model.hidden_dim=8192",
                "model.bottleneck_dim=512",
                "recipe.ibot.out_dim=98304",
            ),
            "DINOv3's ViT-7B Gram anchoring config: 16 per GPU, 2 x 256 + 8 x 112, "
            "Gram teacher at 512, heads of 262144 and 98304",
        ),
    )
}


def arch_config(name: str, batch_size: int | None = None) -> Config:
    """The config of :data:`MEMORY_ARCHS` row ``name``, with ``batch_size``
    per GPU when given."""
    if name not in MEMORY_ARCHS:
        raise ValueError(f"unknown architecture {name!r}; known: {', '.join(MEMORY_ARCHS)}")
    row = MEMORY_ARCHS[name]
    extra = [f"data.batch_size={batch_size}"] if batch_size is not None else []
    return load_config(row.recipe, [*row.overrides, *extra])


def largest_batch(
    cfg: Config, memory_bytes: float, counts: ModelCounts | None = None, **setting
) -> int:
    """The largest batch per GPU whose :func:`estimate_memory` peak (with
    ``setting``: strategy, world_size, checkpointing, ...) is at most
    ``memory_bytes``; 0 when not even one image fits."""
    if counts is None and not recipe_of(cfg).external_teacher:  # a distillation counts its own
        counts = count_model(cfg)

    def fits(batch: int) -> bool:
        sized = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, batch_size=batch))
        return estimate_memory(sized, counts=counts, **setting).peak <= memory_bytes

    if not fits(1):
        return 0
    low, high = 1, 2
    while fits(high):
        low, high = high, 2 * high
    while high - low > 1:  # fits(low), not fits(high)
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


def memory_table(
    archs: list[str] | None = None,
    worlds: tuple[int, ...] = (1, 8, 64, 1024),
    strategies: tuple[str, ...] = STRATEGIES,
    policies: tuple[str, ...] = CHECKPOINT_POLICIES,
    batch_size: int | None = None,
    reshard_after_forward: bool = True,
    config: Config | None = None,
    overrides: tuple[str, ...] = (),
    frozen_teacher: nn.Module | None = None,
) -> list[MemoryEstimate]:
    """Estimates for every combination of architecture (``archs`` of
    :data:`MEMORY_ARCHS`, default all; or ``config`` alone), strategy, world
    size and checkpointing policy (of every block), at each architecture's
    batch per GPU or ``batch_size``, with ``overrides`` (``key=value``)
    applied to each config. A distillation ``config`` needs its
    ``frozen_teacher``; with a student that is not a ViT it has DDP rows
    only (:func:`estimate_distillation`)."""
    extra = [*overrides, *([f"data.batch_size={batch_size}"] if batch_size is not None else [])]
    if config is not None:
        configs = {"config": apply_overrides(config, extra)}
    else:
        configs = {a: apply_overrides(arch_config(a), extra) for a in (archs or MEMORY_ARCHS)}
    rows = []
    for name, cfg in configs.items():
        distill = recipe_of(cfg).external_teacher
        counts = None if distill else count_model(cfg)
        # a distillation with a student that is not a ViT: DDP only
        ddp_only = distill and not all(n.startswith("vit") for n in cfg.student_names)
        for strategy in ("ddp",) if ddp_only else strategies:
            for world in worlds:
                for policy in policies:
                    rows.append(
                        estimate_memory(
                            cfg,
                            strategy=strategy,
                            world_size=world,
                            checkpointing=policy,
                            every=1,
                            reshard_after_forward=reshard_after_forward,
                            arch=name,
                            counts=counts,
                            frozen_teacher=frozen_teacher,
                        )
                    )
    return rows
