"""From a configuration to the objects of a training run: the one place that
maps config keys to constructor arguments.

The training job, the throughput search and the hardware presets all build
through these functions, so a key means the same thing everywhere:
:func:`build_models`, :func:`build_loss` (and :func:`attach_frozen_copies`),
:func:`build_loader`, :func:`build_optimizer`, :func:`build_schedules`,
:func:`trainer_options` (the :class:`~dino_opt.train.MemoryOptimizedDINOTrainer` keys) and
:func:`data_roots` (which data a config trains and evaluates on) and
:func:`build_source` (the data of one of them, opened with the config's
``data`` options).
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn

from ..config import Config, effective_lr
from ..data import (
    AUGMENT_KEYS,
    RGB_ONLY_AUGMENT_KEYS,
    DataSource,
    MultiCropLoader,
    builtin_dataset,
    open_source,
    sibling_split,
)
from ..models import MultiCropWrapper, apply_block_options, build_backbone, build_dino_models
from ..ops import Schedules
from ..runtime import computes_bf16, resolve_precision
from .recipes import WeightsReader, recipe_of
from .trainer import DINOModel

__all__ = [
    "DataRoots",
    "attach_frozen_copies",
    "attach_teacher",
    "frozen_teacher_dtype",
    "parameters_in",
    "place_frozen_teacher",
    "backbone_options",
    "build_loader",
    "build_loss",
    "build_models",
    "build_optimizer",
    "build_schedules",
    "build_source",
    "build_student",
    "build_trainer",
    "resolve_recipe",
    "data_roots",
    "loader_masks",
    "trainer_options",
]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def backbone_options(cfg: Config) -> dict:
    """The ViT options of ``cfg.model`` as :func:`~dino_opt.models.build_backbone`
    takes them, with the recipe's (the position-embedding grid when
    ``model.img_size`` is unset: DINO's 224 pixels, the global crops' for
    DINOv2; the mask token)."""
    m = cfg.model
    options = recipe_of(cfg).backbone_options(cfg)
    return dict(
        num_register_tokens=m.num_register_tokens,
        layerscale_init=m.layerscale_init,
        ffn_layer=m.ffn_layer,
        qkv_bias=m.qkv_bias,
        proj_bias=m.proj_bias,
        ffn_bias=m.ffn_bias,
        drop_path_uniform=m.drop_path_uniform,
        interpolate_offset=m.interpolate_offset,
        interpolate_antialias=m.interpolate_antialias,
        img_size=m.img_size or options["img_size"],
        use_mask_token=options["use_mask_token"],
        depth=m.depth,
    )


def build_models(cfg: Config) -> tuple[nn.Module, nn.Module]:
    """Student and teacher of ``cfg.model`` (:func:`~dino_opt.models.build_dino_models`),
    on the CPU: what the training job trains and what ``dino-opt knn`` loads
    a checkpoint into. The dinov2 recipe: :class:`~dino_opt.train.DINOv2Wrapper`
    with a separate iBOT head when ``recipe.ibot.separate_head``. The
    backbones carry ``cfg.hardware``'s block options
    (:func:`~dino_opt.models.apply_block_options`: the student's activation
    checkpointing, each block and head of both compiled with ``hardware.compile``),
    ready to be wrapped for several processes. A recipe with several
    students (:meth:`Recipe.student_configs`) gets each one built so, joined
    (:meth:`Recipe.join_students`)."""
    recipe = recipe_of(cfg)
    configs = recipe.student_configs(cfg)
    if len(configs) > 1:
        return recipe.join_students(cfg, [build_student(cfg, i) for i in range(len(configs))])
    return _one_pair(cfg)


def build_student(cfg: Config, index: int) -> tuple[nn.Module, nn.Module]:
    """Student ``index`` of a recipe with several students, alone (its
    :meth:`Recipe.student_alone` config), and its teacher, built from
    ``hardware.seed + index`` whatever else was drawn before (the global
    random state is left as it was): the same networks whether all the
    students are in one process or each on its own ranks."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.hardware.seed + index)
        return _one_pair(recipe_of(cfg).student_alone(cfg, index))


def _one_pair(cfg: Config) -> tuple[nn.Module, nn.Module]:
    m, h = cfg.model, cfg.hardware
    compile = h.compile is True  # null (not resolved by a run): off
    # auto (not resolved by a run): none
    policy = "none" if h.activation_checkpointing == "auto" else h.activation_checkpointing
    checkpointing = (policy, h.checkpoint_every)
    vit = backbone_options(cfg) if m.backbone.startswith("vit") else {}
    vit["in_chans"] = m.in_channels or 3
    recipe = recipe_of(cfg)
    if not recipe.builds_heads(cfg):  # the student's backbone alone
        net, _ = build_backbone(
            m.backbone, patch_size=m.patch_size, drop_path_rate=m.drop_path_rate, **vit
        )
        apply_block_options(
            net,
            *checkpointing,
            compile=compile,
            compile_mode=h.compile_mode,
            recompute_threshold=h.recompute_threshold,
        )
        return recipe.wrap_models(cfg, MultiCropWrapper(net, nn.Identity()), None)
    student, teacher = build_dino_models(
        m.backbone,
        m.out_dim,
        m.patch_size,
        m.drop_path_rate,
        m.norm_last_layer,
        m.use_bn_in_head,
        m.hidden_dim,
        m.bottleneck_dim,
        **vit,
    )
    apply_block_options(
        student.backbone,
        *checkpointing,
        compile=compile,
        compile_mode=h.compile_mode,
        recompute_threshold=h.recompute_threshold,
    )
    # the teacher runs no backward: nothing to recompute
    apply_block_options(teacher.backbone, compile=compile, compile_mode=h.compile_mode)
    student, teacher = recipe.wrap_models(cfg, student, teacher)
    for net in (student, teacher):
        if compile and isinstance(net, MultiCropWrapper):
            net.compile_heads(h.compile_mode)
    return student, teacher


def build_loss(cfg: Config) -> nn.Module:
    """The loss of ``cfg``'s recipe (temperatures, centre momentum, crops per
    image), on the CPU: DINO's :class:`~dino_opt.ops.DINOLoss`, or the dinov2
    recipe's :class:`~dino_opt.train.DINOv2Loss`."""
    return recipe_of(cfg).build_loss(cfg)


def attach_frozen_copies(
    cfg: Config, loss_fn: nn.Module, teacher: nn.Module, reader: WeightsReader | None = None
) -> list[nn.Module]:
    """The frozen copies of ``teacher``'s backbone that ``cfg``'s recipe
    keeps in ``loss_fn`` (the dinov3 recipe's Gram teacher, its
    ``recipe.gram.ckpt`` read through ``reader``; none for the others), made now
    from the unsharded teacher and returned, for
    :func:`~dino_opt.job.sharding.spread` to spread as the teacher."""
    return recipe_of(cfg).frozen_copies(cfg, loss_fn, teacher, reader)


def resolve_recipe(cfg: Config, reader: WeightsReader) -> Config:
    """``cfg`` with what its recipe reads from files when a run starts (a
    distillation's teacher widths) written in (:meth:`Recipe.resolve`)."""
    return recipe_of(cfg).resolve(cfg, reader)


def attach_teacher(
    cfg: Config, loss_fn: nn.Module, reader: WeightsReader, device: torch.device | None = None
) -> nn.Module | None:
    """A distillation's frozen teacher opened through ``reader`` and handed
    to ``loss_fn``; its network, or None for the recipes without one. With
    ``device``, the network is placed there (:func:`place_frozen_teacher`)."""
    network = recipe_of(cfg).attach_teacher(cfg, loss_fn, reader)
    if network is not None and device is not None:
        place_frozen_teacher(cfg, network, device)
    return network


def frozen_teacher_dtype(cfg: Config, device: torch.device) -> torch.dtype | None:
    """bfloat16 where a frozen teacher's parameters are stored in it (a GPU,
    or a CPU that computes bfloat16 natively, under bfloat16 autocast), else
    None (as loaded)."""
    autocast = resolve_precision(cfg.hardware.precision, device)
    stored = device.type == "cuda" or computes_bf16(device)
    return torch.bfloat16 if autocast == torch.bfloat16 and stored else None


def parameters_in(network: nn.Module, dtype: torch.dtype) -> nn.Module:
    """``network`` with its parameters (not its buffers) stored in ``dtype``, in place."""
    for p in network.parameters():
        p.data = p.data.to(dtype)
    return network


def place_frozen_teacher(cfg: Config, network: nn.Module, device: torch.device) -> nn.Module:
    """A frozen teacher on ``device`` as a run uses it: on a GPU under
    bfloat16 autocast its parameters are stored in bfloat16 (half its
    memory; autocast computes its matrix products in bfloat16 anyway; its
    buffers, e.g. RoPE's periods, stay float32); each ViT block compiled
    with ``hardware.compile`` in ``hardware.compile_mode`` (another network whole)."""
    network.to(device)
    dtype = frozen_teacher_dtype(cfg, device)
    if dtype is not None:
        parameters_in(network, dtype)
    if cfg.hardware.compile is True:
        backbone = getattr(network, "backbone", network)
        apply_block_options(backbone, compile=True, compile_mode=cfg.hardware.compile_mode)
    return network


class DataRoots(NamedTuple):
    """The data of a run: ``train``, and the held-out ``val`` and ``test``
    splits (None where there is none); each a folder, file, shard pattern or
    data set that :func:`~dino_opt.data.open_source` opens. ``knn_train`` is
    the labelled data the k-NN evaluation's neighbours come from (``train``
    unless ``eval.train_root`` names other data)."""

    train: Path
    val: Path | None
    test: Path | None
    knn_train: Path | None = None


def data_roots(cfg: Config) -> DataRoots:
    """The data of a config: the built-in data set's ``train``, ``val`` and
    ``test`` when ``cfg.data.root`` is None; else ``cfg.data.root`` and the
    splits beside it (:func:`~dino_opt.data.sibling_split`: ``val`` and
    ``test`` folders, a Hugging Face ``DatasetDict``'s splits, ``train`` in the
    name replaced); ``eval.train_root``, ``eval.val_root`` and
    ``eval.test_root`` name the k-NN's data explicitly."""
    if cfg.data.root is None:
        builtin = builtin_dataset(variant=cfg.data.builtin_variant)
        train, val, test = builtin / "train", builtin / "val", builtin / "test"
        val, test = (val if val.is_dir() else None), (test if test.is_dir() else None)
    else:
        train = Path(cfg.data.root)
        if (train / "dataset_dict.json").is_file():  # a Hugging Face DatasetDict: its train split
            train = train / "train"
        val, test = (_given(sibling_split(cfg.data.root, s)) for s in ("val", "test"))
    ev = cfg.eval
    return DataRoots(
        train,
        Path(ev.val_root) if ev.val_root is not None else val,
        Path(ev.test_root) if ev.test_root is not None else test,
        Path(ev.train_root) if ev.train_root is not None else train,
    )


def _given(spec: str | None) -> Path | None:
    return None if spec is None else Path(spec)


def build_source(cfg: Config, root: str | Path | DataSource) -> DataSource:
    """The data of ``root`` (a :class:`DataRoots` entry) opened with the
    options of ``cfg.data``: its format (``auto``: found from the name; only
    for ``data.root`` itself, the evaluation splits are found by name),
    shard index folder, file-list root and Hugging Face columns."""
    if isinstance(root, DataSource):
        return root
    d = cfg.data
    is_train = d.root is not None and Path(root) in (Path(d.root), Path(d.root) / "train")
    return open_source(
        root,
        format=d.format if is_train else "auto",
        list_root=d.list_root,
        index_dir=d.index_dir,
        image_column=d.image_column,
        label_column=d.label_column,
    )


def build_loader(
    cfg: Config,
    root: str | Path | DataSource,
    device: torch.device,
    *,
    rank: int = 0,
    world_size: int = 1,
) -> MultiCropLoader:
    """The native multi-crop loader of ``cfg`` over ``root`` (any data
    :func:`build_source` opens): this rank's shard, the augmentation of
    ``cfg.augmentation``, the threads, prefetch, dtype, photometric placement
    and shuffle buffer of ``cfg.data``, seeded by ``cfg.hardware.seed``; with
    the dinov2 recipe also the global crops' block masks (:func:`loader_masks`).
    Crop-size lists give a loader that draws one (global, local) pair per
    batch with ``augmentation.crop_size_ratios``."""
    aug = cfg.augmentation
    gpu_photometric = cfg.data.photometric == "gpu"
    return MultiCropLoader(
        build_source(cfg, root),
        cfg.data.batch_size,
        global_size=aug.global_crop_size,
        local_size=aug.local_crop_size,
        crop_size_ratios=aug.crop_size_ratios,
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
        augment=_augment_options(aug),
        image_mode=cfg.data.image_mode,
        mean=cfg.data.mean,
        std=cfg.data.std,
        pin_memory=cfg.data.pin_memory and device.type == "cuda",
        masks=loader_masks(cfg),
        shuffle_buffer=cfg.data.shuffle_buffer,
    )


def _augment_options(aug) -> dict:
    """The loader's photometric options of ``augmentation``: every key, but
    the RGB-only ones only where set away from their defaults (asked for:
    the loader refuses those for images that are not 8-bit RGB)."""
    defaults = type(aug)()
    return {
        k: getattr(aug, k)
        for k in AUGMENT_KEYS
        if k not in RGB_ONLY_AUGMENT_KEYS or getattr(aug, k) != getattr(defaults, k)
    }


def loader_masks(cfg: Config) -> dict | None:
    """The loader's block masks of ``cfg``'s recipe (dinov2), or None (dino)."""
    return recipe_of(cfg).loader_masks(cfg)


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
    never decays), or DINOv2's (:func:`~dino_opt.train.dinov2_param_groups`:
    the dinov2 recipe, or a layer-wise decay or patch-embedding multiplier
    other than 1): AdamW (fused on a GPU and on the CPU unless ``optim.fused`` says
    otherwise) or SGD with momentum 0.9. ``lr`` and ``weight_decay`` are the
    starting values; in a training run the schedules set them every step
    (:meth:`~dino_opt.train.MemoryOptimizedDINOTrainer.set_schedules`).
    ``cfg`` None: the defaults (AdamW)."""
    cfg = cfg or Config()
    optim = cfg.optim
    groups = recipe_of(cfg).param_groups(cfg, student)
    if optim.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=0.9, weight_decay=weight_decay)
    # fused: one kernel for all parameters, and a non-finite step skipped on
    # the device (no host sync); on the CPU also about 3x the default loop
    fused = optim.fused if optim.fused is not None else device.type in ("cuda", "cpu")
    return torch.optim.AdamW(groups, lr=lr, weight_decay=weight_decay, fused=fused)


def build_schedules(cfg: Config, niter_per_epoch: int, world_size: int = 1) -> Schedules:
    """The per-iteration schedules of ``cfg``'s recipe: learning rate (scaled
    by the global batch, :func:`~dino_opt.config.effective_lr`), weight decay
    and teacher momentum (DINOv2: also the teacher temperature and the last
    layer's freezing), for ``niter_per_epoch`` optimizer steps per epoch."""
    base_lr = effective_lr(cfg, world_size=world_size)
    return recipe_of(cfg).build_schedules(cfg, niter_per_epoch, base_lr)


def trainer_options(cfg: Config) -> dict:
    """The :class:`~dino_opt.train.MemoryOptimizedDINOTrainer` config of
    ``cfg``: precision, crop batching, accumulation, gradient clipping and
    the frozen last layer, and whether compiled graphs replay as CUDA graphs
    (activation checkpointing and compilation are the model's:
    :func:`build_models`)."""
    h = cfg.hardware
    return {
        "precision": cfg.hardware.precision,
        "crop_batch_size": cfg.hardware.crop_batch_size,
        "accumulation_steps": cfg.optim.accumulation_steps,
        "gradient_clip": cfg.optim.clip_grad,
        "freeze_last_layer": recipe_of(cfg).freeze_last_layer(cfg),
        "freeze_backbone": cfg.optim.freeze_backbone_epochs,
        "cuda_graphs": h.compile is True and h.compile_mode == "reduce-overhead",
    }


def build_trainer(cfg: Config, model: DINOModel, loss_fn, optimizer, device: torch.device):
    """The one-step engine of ``cfg.recipe``: :class:`~dino_opt.train.MemoryOptimizedDINOTrainer`
    (dino) or :class:`~dino_opt.train.DINOv2Trainer` (dinov2)."""
    cls = recipe_of(cfg).trainer_class(cfg)
    return cls(model, loss_fn, optimizer, trainer_options(cfg), device)
