"""From a configuration to the objects of a training run: the one place that
maps config keys to constructor arguments.

The training job, the throughput search and the hardware presets all build
through these functions, so a key means the same thing everywhere:
:func:`build_models`, :func:`build_loss`, :func:`build_loader`,
:func:`build_optimizer`, :func:`build_schedules`, :func:`trainer_options`
(the :class:`~dino_opt.train.MemoryOptimizedDINOTrainer` keys) and
:func:`data_roots` (which folders a config trains and evaluates on).
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn

from ..config import Config, effective_lr
from ..data import AUGMENT_KEYS, MultiCropLoader, builtin_dataset
from ..models import build_dino_models
from ..ops import DINOLoss, Schedules
from .trainer import param_groups

__all__ = [
    "DataRoots",
    "build_loader",
    "build_loss",
    "build_models",
    "build_optimizer",
    "build_schedules",
    "data_roots",
    "trainer_options",
]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_models(cfg: Config) -> tuple[nn.Module, nn.Module]:
    """Student and teacher of ``cfg.model`` (:func:`~dino_opt.models.build_dino_models`),
    on the CPU: what the training job trains and what ``dino-opt knn`` loads
    a checkpoint into."""
    m = cfg.model
    return build_dino_models(
        m.backbone, m.out_dim, m.patch_size, m.drop_path_rate, m.norm_last_layer,
        m.use_bn_in_head, m.hidden_dim, m.bottleneck_dim,
    )  # fmt: skip


def build_loss(cfg: Config) -> DINOLoss:
    """The DINO loss of ``cfg`` (temperatures, centre momentum, crops per
    image), on the CPU."""
    s = cfg.schedule
    return DINOLoss(
        cfg.model.out_dim, 2 + cfg.augmentation.num_local_views, s.warmup_teacher_temp,
        s.teacher_temp, s.warmup_teacher_temp_epochs, s.epochs, s.student_temp,
        s.center_momentum,
    )  # fmt: skip


class DataRoots(NamedTuple):
    """The image folders of a run: ``train``, and the held-out ``val`` and
    ``test`` splits (None where there is none)."""

    train: Path
    val: Path | None
    test: Path | None


def data_roots(cfg: Config) -> DataRoots:
    """The folders of a config: the built-in data set's ``train``, ``val`` and
    ``test`` when ``cfg.data.root`` is None, else ``cfg.data.root`` and its
    sibling ``val`` and ``test`` folders where they exist."""
    train = builtin_dataset() / "train" if cfg.data.root is None else Path(cfg.data.root)
    val, test = train.parent / "val", train.parent / "test"
    return DataRoots(train, val if val.is_dir() else None, test if test.is_dir() else None)


def build_loader(
    cfg: Config,
    root: str | Path,
    device: torch.device,
    *,
    rank: int = 0,
    world_size: int = 1,
) -> MultiCropLoader:
    """The native multi-crop loader of ``cfg`` over ``root``: this rank's
    shard, the augmentation of ``cfg.augmentation``, the threads, prefetch,
    dtype and photometric placement of ``cfg.data``, seeded by
    ``cfg.hardware.seed``."""
    aug = cfg.augmentation
    gpu_photometric = cfg.data.photometric == "gpu"
    return MultiCropLoader(
        root,
        cfg.data.batch_size,
        global_size=aug.global_crop_size,
        local_size=aug.local_crop_size,
        n_local=aug.num_local_views,
        global_scale=aug.global_crops_scale,
        local_scale=aug.local_crops_scale,
        num_threads=cfg.data.num_workers,
        prefetch=cfg.data.prefetch,
        seed=cfg.hardware.seed,
        rank=rank,
        world_size=world_size,
        dtype=_DTYPES[cfg.data.dtype],
        photometric=cfg.data.photometric,
        device=device if gpu_photometric else None,
        on_error=cfg.data.on_error,
        augment={k: getattr(aug, k) for k in AUGMENT_KEYS},
        pin_memory=cfg.data.pin_memory and device.type == "cuda",
    )


def build_optimizer(
    cfg: Config | None,
    student: nn.Module,
    device: torch.device,
    *,
    lr: float = 0.0,
    weight_decay: float = 0.0,
):
    """The optimizer of ``cfg.optim`` over DINO's two parameter groups
    (:func:`~dino_opt.train.param_groups`; the second, biases and norms,
    never decays): AdamW (fused on a GPU unless ``optim.fused`` says
    otherwise) or SGD with momentum 0.9. ``lr`` and ``weight_decay`` are the
    starting values; in a training run the schedules set them every step
    (:meth:`~dino_opt.train.MemoryOptimizedDINOTrainer.set_schedules`).
    ``cfg`` None: the defaults (AdamW)."""
    optim = (cfg or Config()).optim
    groups = param_groups(student)
    if optim.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=0.9, weight_decay=weight_decay)
    fused = optim.fused if optim.fused is not None else device.type == "cuda"
    return torch.optim.AdamW(groups, lr=lr, weight_decay=weight_decay, fused=fused)


def build_schedules(cfg: Config, niter_per_epoch: int, world_size: int = 1) -> Schedules:
    """DINO's per-iteration schedules for ``cfg``: learning rate (scaled by
    the global batch, :func:`~dino_opt.config.effective_lr`), weight decay and
    teacher momentum, for ``niter_per_epoch`` optimizer steps per epoch."""
    s, o = cfg.schedule, cfg.optim
    return Schedules.dino(
        base_lr=effective_lr(cfg, world_size=world_size),
        min_lr=o.min_lr,
        weight_decay=o.weight_decay,
        weight_decay_end=o.weight_decay_end,
        momentum_teacher=s.momentum_teacher,
        epochs=s.epochs,
        warmup_epochs=s.warmup_epochs,
        niter_per_epoch=niter_per_epoch,
    )


def trainer_options(cfg: Config) -> dict:
    """The :class:`~dino_opt.train.MemoryOptimizedDINOTrainer` config of
    ``cfg``: precision, gradient checkpointing, crop batching, accumulation,
    gradient clipping and the frozen last layer."""
    return {
        "precision": cfg.hardware.precision,
        "gradient_checkpointing": cfg.hardware.grad_checkpointing,
        "crop_batch_size": cfg.hardware.crop_batch_size,
        "accumulation_steps": cfg.optim.accumulation_steps,
        "gradient_clip": cfg.optim.clip_grad,
        "freeze_last_layer": cfg.optim.freeze_last_layer,
    }
