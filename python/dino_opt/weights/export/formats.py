"""Weights out: a training run's backbone (or a backbone module) in the
formats other tools load.

Export (:func:`export_weights`, ``dino-opt export``; :func:`export_backbone`
for a backbone module):

- ``timm``: one safetensors file whose state dict
  ``timm.create_model(name, **kwargs)`` loads with ``strict=True`` (``name``
  and ``kwargs`` are in the file's metadata): DINO's ``vit_small_patch16_224``,
  ``vit_small_patch8_224``, ... for a DINO ViT, DINOv2's
  ``vit_small_patch14_dinov2``, ``vit_base_patch14_reg4_dinov2``,
  ``vit_giant_patch14_dinov2``, ... for a ViT with registers, LayerScale,
  SwiGLU or bias switches; keywords where the shape, image size or patch
  differ from the name's;
- ``hf``: a folder (``config.json`` + ``model.safetensors``, the layout of the
  published checkpoints): ``transformers.ViTModel`` (``add_pooling_layer=False``)
  for a DINO ViT, ``Dinov2Model`` or ``Dinov2WithRegistersModel`` otherwise,
  each through ``from_pretrained(path)``; ``last_hidden_state[:, 0]`` is the
  backbone's feature;
- ``dino``: the original code's files: the backbone state dict its model zoo
  ships (``vision_transformer.vit_*`` or torchvision's ResNet load it), or with
  ``full=True`` a training checkpoint as its ``main_dino.py`` writes and
  resumes (``student`` with DistributedDataParallel's ``module.`` prefix,
  ``teacher``, ``optimizer``, ``epoch``, ``dino_loss``, ``args``);
- ``dinov2``: the backbone state dict in the layout of the published DINOv2
  checkpoints (``block_chunks=0``, with ``mask_token``), which DINOv2's
  ``vision_transformer.vit_*`` loads with ``strict=True``;
- ``dinov3``: a DINOv3 backbone (``vit_*_dinov3``) in the layout of the
  published DINOv3 checkpoints (``storage_tokens``, the masked qkv bias with
  its ``bias_mask``, ``rope_embed.periods``, ``mask_token``), which DINOv3's
  ``DinoVisionTransformer`` loads with ``strict=True``.

A DINOv3 backbone also goes to ``timm`` (its ``vit_*_patch16_dinov3``,
``_qkvb`` with a qkv bias) and ``hf`` (``DINOv3ViTModel``), not to ``dino``
or ``dinov2``; a DINOv3 ViT has no position table, so ``image_size`` only
sets the size the target's config names (see
:mod:`~dino_opt.weights.layouts.dinov3`).

``image_size`` exports the position table resized the way the model resizes
it at that size (its interpolation offset and anti-aliasing), so the target
computes what dino_opt computes there; the result says so. By default the
table is kept at its own size.

What reads them back: :mod:`dino_opt.weights.load`.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from torch import nn

from ...checkpoint import check_output
from ...config import Config, student_key
from ...eval import load_checkpoint
from ...models import DinoV3VisionTransformer, VisionTransformer
from ...models.vit import pos_embed_grid, resize_pos_embed
from ..layouts.dinov3 import (
    DinoV3Arch,
    dinov3_arch,
    dinov3_load,
    export_notes,
    hf_dinov3_config,
    is_rope_vit,
    module_arch,
    timm_dinov3_model,
    to_dinov3,
    to_hf_dinov3,
    to_timm_dinov3,
    unsupported,
)
from ..layouts.vit import (
    DINO_IMAGE_SIZE,
    ViTArch,
    hf_dinov2_config,
    hf_vit_config,
    timm_model,
    to_hf_dinov2,
    to_hf_vit,
    to_timm,
    vit_arch,
)
from ..load.reading import TRAINING_KEY, sub_dict, training_input, write_training_sidecar
from .cnn import CNN_FORMATS, export_cnn, save_safetensors, save_torch, write_hf_folder

__all__ = ["FORMATS", "ExportResult", "export_backbone", "export_weights"]

FORMATS = ("timm", "hf", "dino", "dinov2", "dinov3", *CNN_FORMATS)


@dataclass
class ExportResult:
    """What :func:`export_weights` wrote: the ``path``, its ``format``, which
    network (``which``), its ``backbone``, the ``image_size`` it is for, how a
    target builds it (``load``), and ``notes`` (position table resized, ...)."""

    path: Path
    format: str
    which: str
    backbone: str
    image_size: int
    load: str
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return {**self.__dict__, "path": str(self.path)}


# ---------------------------------------------------------------- export


def _resized(sd: dict, arch: ViTArch, image_size: int, interp: tuple) -> tuple[dict, list[str]]:
    """The state with its position table for ``image_size`` inputs, and a note."""
    if image_size % arch.patch_size:
        raise ValueError(
            f"image_size {image_size} is not a multiple of the patch size {arch.patch_size}"
        )
    grid, old = (image_size // arch.patch_size,) * 2, pos_embed_grid(sd["pos_embed"])
    if grid == old:
        return sd, []
    how = f"offset {interp[0]}" if interp[0] else "to the grid"
    how += ", anti-aliased" if interp[1] else ""
    note = (
        f"position embeddings resized from {old[0]}x{old[1]} to {grid[0]}x{grid[1]} patches "
        f"for {image_size}-pixel inputs (bicubic {how}, as dino_opt resizes them)"
    )
    return {**sd, "pos_embed": resize_pos_embed(sd["pos_embed"], grid, *interp)}, [note]


def _export_timm(sd: dict, arch: ViTArch, output: Path, image_size: int, meta: dict) -> str:
    model, kwargs = timm_model(arch, image_size)
    meta = meta | {"timm_model": model, "timm_kwargs": json.dumps(kwargs)}
    save_safetensors(to_timm(sd, arch), output, meta)
    return f"timm.create_model({model!r}, **{kwargs})"


def _export_hf(sd: dict, arch: ViTArch, output: Path, image_size: int, meta: dict) -> str:
    if arch.dino_v1:
        config, tensors = hf_vit_config(arch, image_size), to_hf_vit(sd, arch)
        load = "transformers.ViTModel.from_pretrained(path, add_pooling_layer=False)"
    else:
        config, tensors = hf_dinov2_config(arch, image_size), to_hf_dinov2(sd, arch)
        load = f"transformers.{config['architectures'][0]}.from_pretrained(path)"
    write_hf_folder(output, config, tensors, meta)
    return load


def _dinov2_load(arch: ViTArch, image_size: int, interp: tuple) -> str:
    kwargs = dict(
        patch_size=arch.patch_size,
        img_size=image_size,
        init_values=1e-5 if arch.layerscale else None,
        ffn_layer=arch.ffn_layer,
        block_chunks=0,
        num_register_tokens=arch.num_register_tokens,
        interpolate_offset=interp[0],
        interpolate_antialias=interp[1],
    )
    kwargs |= {k: False for k in ("qkv_bias", "proj_bias", "ffn_bias") if not getattr(arch, k)}
    builder = arch.name or "DinoVisionTransformer"
    if builder == "vit_tiny" or not arch.name or not arch.standard_ffn:
        builder = "DinoVisionTransformer"
        kwargs |= dict(
            embed_dim=arch.embed_dim,
            depth=arch.depth,
            num_heads=arch.heads,
            mlp_ratio=arch.mlp_ratio,
        )
    args = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
    return (
        f"dinov2.models.vision_transformer.{builder}({args}).load_state_dict("
        "torch.load(path), strict=True)"
    )


def _export_dinov2(sd: dict, arch: ViTArch, output: Path, image_size: int, interp) -> str:
    state = dict(sd)
    state.setdefault("mask_token", sd["cls_token"].new_zeros(1, arch.embed_dim))
    order = ["cls_token", "pos_embed", "register_tokens", "mask_token"]
    state = {k: state[k] for k in order if k in state} | state  # DINOv2's order
    save_torch({k: v.contiguous() for k, v in state.items()}, output)
    return _dinov2_load(arch, image_size, interp)


def _export_vit(
    fmt: str,
    sd: dict,
    output: Path,
    image_size: int | None,
    meta: dict,
    interp: tuple,
    heads: int | None,
) -> tuple[str, list[str], int]:
    """Writes a ViT backbone state ``sd`` as ``fmt``; (load, notes, image size)."""
    arch = vit_arch(sd, heads)
    image_size = image_size or arch.img_size
    sd, notes = _resized(sd, arch, image_size, interp)
    if fmt == "timm":
        return _export_timm(sd, arch, output, image_size, meta), notes, image_size
    if fmt == "hf":
        return _export_hf(sd, arch, output, image_size, meta), notes, image_size
    return _export_dinov2(sd, arch, output, image_size, interp), notes, image_size


def _export_dino(sd: dict, output: Path, image_size: int | None) -> tuple[str, list[str], int]:
    """DINO's backbone file: a DINO ViT's (or a ResNet's) state dict as it is."""
    notes, native = [], DINO_IMAGE_SIZE
    if "cls_token" in sd:
        arch = vit_arch(sd)
        native = arch.img_size
        if not arch.dino_v1:
            raise ValueError(
                f"--format dino writes DINO's ViT; this one has {_v2_features(arch)}, which "
                "DINO's code does not build; --format dinov2 writes it in DINOv2's layout"
            )
        if "mask_token" in sd:
            sd = {k: v for k, v in sd.items() if k != "mask_token"}
            notes.append("the mask token left out (DINO's ViT has none)")
    if image_size is not None and image_size != native:
        raise ValueError(
            f"image_size {image_size}: --format dino keeps the model's {native}-pixel position "
            "table (DINO's code resizes it for other inputs); --image-size applies to timm, hf "
            "and dinov2"
        )
    save_torch(sd, output)
    return "vision_transformer / torchvision load_state_dict", notes, native


def _v2_features(arch: ViTArch) -> str:
    parts = [
        f"{arch.num_register_tokens} registers" if arch.num_register_tokens else "",
        "LayerScale" if arch.layerscale else "",
        "SwiGLU" if arch.swiglu else "",
        "" if arch.qkv_bias and arch.proj_bias and arch.ffn_bias else "biases switched off",
    ]
    return ", ".join(p for p in parts if p)


def _dino_full(ckpt: dict) -> dict:
    """A training checkpoint as the original main_dino.py writes it."""
    for key in ("student", "teacher", "optimizer", "loss", "epoch"):
        if key not in ckpt:
            raise ValueError(f"a full DINO checkpoint needs the checkpoint's {key!r}")
    optimizer = ckpt["optimizer"]
    groups = [{**g, "fused": None} for g in optimizer["param_groups"]]  # any AdamW resumes it
    return {
        "student": {f"module.{k}": v for k, v in ckpt["student"].items()},  # DDP in main_dino
        "teacher": dict(ckpt["teacher"]),
        "optimizer": {"state": optimizer["state"], "param_groups": groups},
        "epoch": int(ckpt["epoch"]),
        "dino_loss": dict(ckpt["loss"]),
        "args": {"dino_opt_config": ckpt.get("config", {})},
    }


def _check_request(fmt: str, which: str, full: bool) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if which not in ("teacher", "student", "backbone"):
        raise ValueError(f"which must be 'teacher' or 'student', got {which!r}")
    if full and fmt != "dino":
        raise ValueError("full=True (--full) applies to --format dino only")


def _write_backbone(
    fmt: str,
    sd: dict,
    output: Path,
    image_size: int | None,
    meta: dict,
    interp: tuple,
    heads: int | None,
) -> tuple[str, list[str], int]:
    if fmt == "dino":
        return _export_dino(sd, output, image_size)
    return _export_vit(fmt, sd, output, image_size, meta, interp, heads)


def _check_dinov3_export(fmt: str, arch: DinoV3Arch, image_size: int) -> None:
    if fmt in ("dino", "dinov2"):
        raise ValueError(
            f"--format {fmt} writes {'DINO' if fmt == 'dino' else 'DINOv2'}'s ViT (a position "
            f"table); this is DINOv3's ({arch.describe()}, RoPE): --format dinov3, timm or hf "
            "write it"
        )
    if image_size % arch.patch_size:
        raise ValueError(
            f"image_size {image_size} is not a multiple of the patch size {arch.patch_size}"
        )
    missing = unsupported(arch) if fmt in ("timm", "hf") else []
    if missing:
        target = "timm's" if fmt == "timm" else "Hugging Face's"
        raise ValueError(
            f"--format {fmt}: {target} DINOv3 ViT has no {'; no '.join(missing)}; "
            "--format dinov3 writes this one"
        )


def _dinov3_files(
    fmt: str, sd: dict, arch: DinoV3Arch, image_size: int, meta: dict
) -> tuple[dict, dict, str]:
    """(tensors, metadata, load) of a DINOv3 backbone in ``fmt``."""
    if fmt == "dinov3":
        return to_dinov3(sd, arch), meta, dinov3_load(arch, image_size)
    if fmt == "timm":
        model, kwargs = timm_dinov3_model(arch, image_size)
        meta = meta | {"timm_model": model, "timm_kwargs": json.dumps(kwargs)}
        return to_timm_dinov3(sd, arch), meta, f"timm.create_model({model!r}, **{kwargs})"
    return to_hf_dinov3(sd, arch), meta, "transformers.DINOv3ViTModel.from_pretrained(path)"


def _export_dinov3(
    fmt: str,
    sd: dict,
    arch: DinoV3Arch,
    output: Path,
    image_size: int | None,
    meta: dict,
    force: bool,
    sources: tuple = (),
) -> tuple[str, list[str], int]:
    """Writes a DINOv3 backbone state ``sd`` as ``fmt`` (refused before
    ``output`` is touched when the format cannot hold it); (load, notes,
    image size)."""
    image_size = image_size or arch.img_size
    _check_dinov3_export(fmt, arch, image_size)
    tensors, meta, load = _dinov3_files(fmt, sd, arch, image_size, meta)
    check_output(output, force, sources)
    if fmt == "dinov3":
        save_torch(tensors, output)
    elif fmt == "timm":
        save_safetensors(tensors, output, meta)
    else:
        write_hf_folder(output, hf_dinov3_config(arch, image_size), tensors, meta)
    return load, export_notes(arch, fmt), image_size


def _refuse_dinov3_format(fmt: str, what: str) -> None:
    if fmt == "dinov3":
        raise ValueError(
            f"--format dinov3 writes DINOv3's ViT (model.backbone vit_*_dinov3); "
            f"{what} is not one: --format dinov2, timm or hf write it"
        )


def _student_prefix(cfg: Config, student: str | None, source, full: bool) -> tuple[str, str]:
    """(backbone name, state-dict prefix of its backbone) of ``student`` in
    a run of ``cfg`` (its students: ``model.backbone`` and
    ``recipe.distill.students``; ValueError naming them for another)."""
    names = cfg.student_names
    name = student or names[0]
    if name not in names:
        raise ValueError(f"--student {name}: {source} trained {', '.join(names)}")
    if len(names) == 1:
        return name, "backbone."
    if full:
        raise ValueError(
            f"--full writes DINO's checkpoint of one student; {source} trained "
            f"{', '.join(names)}: export each backbone with --student"
        )
    return name, f"members.{student_key(name)}.backbone."


def export_weights(
    source: str | os.PathLike,
    fmt: str,
    output: str | os.PathLike,
    *,
    which: str = "teacher",
    full: bool = False,
    image_size: int | None = None,
    force: bool = False,
    student: str | None = None,
) -> ExportResult:
    """Writes the ``which`` network (teacher by default) of a training
    checkpoint or run folder ``source`` as ``fmt`` (see the module docstring)
    to ``output``; ``image_size`` None keeps the position table's own size.
    A distillation into several students: ``student`` names the one (by
    its backbone; default: the first, ``model.backbone``). Refuses an
    existing ``output`` unless ``force``, a backbone the format does not
    take, an unknown student and a checkpoint without weights, naming each."""
    _check_request(fmt, which, full)
    # the output first, before a checkpoint of gigabytes is read (its side
    # files, which depend on the format, are checked again where written)
    check_output(output, force, (source,))
    ckpt = load_checkpoint(source, keys=(which, "config"))
    cfg = Config.from_dict(ckpt["config"])
    model = cfg.model
    backbone, prefix = _student_prefix(cfg, student, source, full)
    output, sd = Path(output), sub_dict(ckpt[which], prefix)
    meta = {
        "format": "pt",
        "dino_opt_source": str(source),
        "dino_opt_which": which,
        TRAINING_KEY: json.dumps(training_input(cfg)),
    }
    if not backbone.startswith("vit") and not full:  # a ResNet, a ConvNeXt, a user's network
        prepare = functools.partial(check_output, output, force, (source,))
        load, notes = export_cnn(fmt, sd, backbone, output, meta, prepare)
        return ExportResult(output, fmt, which, backbone, DINO_IMAGE_SIZE, load, notes)
    if fmt in CNN_FORMATS:
        raise ValueError(f"--format {fmt} writes a convolutional student, not a {backbone}")
    if is_rope_vit(sd):
        arch = dinov3_arch(sd)
        load, notes, size = _export_dinov3(
            fmt, sd, arch, output, image_size, meta, force, (source,)
        )
        return _recorded(ExportResult(output, fmt, which, backbone, size, load, notes), meta)
    _refuse_dinov3_format(fmt, f"{source}'s {backbone}")
    check_output(output, force, (source,))
    if full:
        save_torch(_dino_full(ckpt), output)
        return _recorded(
            ExportResult(
                output, "dino-full", which, backbone, DINO_IMAGE_SIZE, "main_dino.py --resume", []
            ),
            meta,
        )
    interp = (
        getattr(model, "interpolate_offset", 0.0) or 0.0,
        bool(getattr(model, "interpolate_antialias", False)),
    )
    load, notes, size = _write_backbone(fmt, sd, output, image_size, meta, interp, None)
    return _recorded(ExportResult(output, fmt, which, backbone, size, load, notes), meta)


def _recorded(result: ExportResult, meta: dict) -> ExportResult:
    """``result``, its training input written beside a torch file (a
    safetensors file and a Hugging Face folder hold it themselves)."""
    if result.format not in ("timm", "hf"):
        write_training_sidecar(Path(result.path), json.loads(meta[TRAINING_KEY]))
    return result


def export_backbone(
    backbone: nn.Module,
    fmt: str,
    output: str | os.PathLike,
    *,
    image_size: int | None = None,
    force: bool = False,
) -> ExportResult:
    """Writes a backbone module (a :class:`~dino_opt.models.VisionTransformer`
    of any shape, a :class:`~dino_opt.models.DinoV3VisionTransformer`, or a
    ResNet for ``dino``) as ``fmt``, as :func:`export_weights` does; its
    heads, position interpolation and RoPE come from the module."""
    _check_request(fmt, "backbone", False)
    vit = isinstance(backbone, VisionTransformer)
    if fmt != "dino" and not vit:
        kind = type(backbone).__name__
        raise ValueError(
            f"format {fmt} takes a VisionTransformer, not a {kind}; --format dino writes it"
        )
    output = Path(output)
    sd = {k: v.detach().cpu() for k, v in backbone.state_dict().items()}
    if isinstance(backbone, DinoV3VisionTransformer):
        arch = module_arch(backbone, sd)
        load, notes, size = _export_dinov3(
            fmt, sd, arch, output, image_size, {"format": "pt"}, force
        )
        return ExportResult(output, fmt, "backbone", arch.name or "vit_dinov3", size, load, notes)
    _refuse_dinov3_format(fmt, f"a {type(backbone).__name__}")
    check_output(output, force)
    interp = (backbone.interpolate_offset, backbone.interpolate_antialias) if vit else (0.0, False)
    heads = backbone.num_heads if vit else None
    load, notes, size = _write_backbone(
        fmt, sd, output, image_size, {"format": "pt"}, interp, heads
    )
    name = (vit_arch(sd).name or "vit") if vit else type(backbone).__name__.lower()
    return ExportResult(output, fmt, "backbone", name, size, load, notes)
