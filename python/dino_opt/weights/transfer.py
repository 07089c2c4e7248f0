"""Weights in and out: a training run's backbone (and head) in the formats
other tools load, and weights in those formats as a starting point.

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
:mod:`~dino_opt.weights.layouts_dinov3`).

``image_size`` exports the position table resized the way the model resizes
it at that size (its interpolation offset and anti-aliasing), so the target
computes what dino_opt computes there; the result says so. By default the
table is kept at its own size.

Import (:func:`~dino_opt.weights.read_weights`, :func:`init_from`,
:func:`load_backbone`): any of these, or a dino_opt checkpoint or run folder,
detected from the file. A position table of another grid is resized to the
model's; LayerScale, biases and the mask token are adapted where that keeps
the function (a LayerScale of 1, zero biases: see :func:`load_backbone`).
DINOv3's weights load into DINOv3's ViT only, and the other ViTs' into the
others.
``model.init_from`` starts a training run from them; ``dino-opt knn
--weights`` evaluates them.
"""

from __future__ import annotations

import functools
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..checkpoint import check_output
from ..config import Config, student_key
from ..eval import knn_evaluate_splits, load_checkpoint
from ..models import DinoV3VisionTransformer, VisionTransformer, build_backbone
from ..models.channels import adapt_input_weights
from ..models.vit import pos_embed_grid, resize_pos_embed
from ..runtime import resolve_device
from .cnn_export import CNN_FORMATS, export_cnn, save_safetensors, save_torch, write_hf_folder
from .layouts import (
    ViTArch,
    hf_dinov2_config,
    hf_vit_config,
    timm_model,
    to_hf_dinov2,
    to_hf_vit,
    to_timm,
    vit_arch,
)
from .layouts_dinov3 import (
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
from .reading import (
    TRAINING_KEY,
    ExternalWeights,
    read_weights,
    sub_dict,
    training_input,
    write_training_sidecar,
)

__all__ = [
    "FORMATS",
    "ExportResult",
    "evaluate_weights",
    "export_backbone",
    "export_weights",
    "init_from",
    "load_backbone",
]

FORMATS = ("timm", "hf", "dino", "dinov2", "dinov3", *CNN_FORMATS)
_DINO_SIZE = 224  # the input size of DINO's position tables


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
    notes, native = [], _DINO_SIZE
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
        return ExportResult(output, fmt, which, backbone, _DINO_SIZE, load, notes)
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
                output, "dino-full", which, backbone, _DINO_SIZE, "main_dino.py --resume", []
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


# ---------------------------------------------------------------- import


def _note(notes: list[str], text: str) -> None:
    if text not in notes:
        notes.append(text)


def _fit_pos_embed(sd: dict, model: nn.Module, notes: list[str]) -> dict:
    """The backbone state with its position table resized to ``model``'s grid
    (as the model resizes tables: its interpolation offset and anti-aliasing)."""
    if "pos_embed" not in sd or not hasattr(model, "pos_embed"):
        return sd
    mine, theirs = pos_embed_grid(model.pos_embed), pos_embed_grid(sd["pos_embed"])
    if mine == theirs:
        return sd
    _note(
        notes,
        f"position embeddings resized from {theirs[0]}x{theirs[1]} to {mine[0]}x{mine[1]} patches",
    )
    interp = (
        getattr(model, "interpolate_offset", 0.0),
        getattr(model, "interpolate_antialias", False),
    )
    return {**sd, "pos_embed": resize_pos_embed(sd["pos_embed"], mine, *interp)}


def _adapt_layerscale(sd: dict, theirs: ViTArch, mine: ViTArch, path, notes) -> dict:
    if theirs.layerscale == mine.layerscale:
        return sd
    if theirs.layerscale:
        gammas = [k for k in sd if re.search(r"\.ls[12]\.gamma$", k)]
        if not all(bool((sd[k] == 1).all()) for k in gammas):
            raise ValueError(
                f"{path}: the weights have LayerScale, the model has none "
                "(set model.layerscale_init)"
            )
        _note(notes, "LayerScale of 1 left out (the model has none; the same function)")
        return {k: v for k, v in sd.items() if k not in gammas}
    _note(notes, "LayerScale set to 1 (the weights have none; the same function)")
    ones = sd["cls_token"].new_ones(mine.embed_dim)
    return sd | {f"blocks.{i}.ls{n}.gamma": ones for i in range(mine.depth) for n in (1, 2)}


def _bias_keys(arch: ViTArch | DinoV3Arch) -> dict[str, list[str]]:
    """A block's bias entries of each bias switch (DINOv3's masked qkv bias:
    the query's and value's)."""
    ffn = ["mlp.w12", "mlp.w3"] if arch.swiglu else ["mlp.fc1", "mlp.fc2"]
    masked = isinstance(arch, DinoV3Arch) and arch.masked_qkv_bias
    qkv = ["attn.qkv.q_bias", "attn.qkv.v_bias"] if masked else ["attn.qkv.bias"]
    return {
        "qkv_bias": qkv,
        "proj_bias": ["attn.proj.bias"],
        "ffn_bias": [f"{layer}.bias" for layer in ffn],
    }


def _zero_bias(sd: dict, key: str) -> torch.Tensor | None:
    """A zero bias for entry ``key`` (a third of a qkv layer's rows for q / v)."""
    weight = sd.get(key.rsplit(".", 1)[0] + ".weight")
    if weight is None:
        return None
    return weight.new_zeros(weight.shape[0] // (3 if key.endswith(("q_bias", "v_bias")) else 1))


def _adapt_biases(sd: dict, theirs, mine, path, notes) -> dict:
    for flag in ("qkv_bias", "proj_bias", "ffn_bias"):
        if getattr(theirs, flag) == getattr(mine, flag):
            continue
        names = _bias_keys(mine if getattr(mine, flag) else theirs)[flag]
        keys = [f"blocks.{i}.{name}" for i in range(mine.depth) for name in names]
        if getattr(mine, flag):
            zeros = {k: _zero_bias(sd, k) for k in keys}
            sd = sd | {k: z for k, z in zeros.items() if z is not None}
            _note(notes, f"{flag} of zero added (the weights have none; the same function)")
        elif all(bool((sd[k] == 0).all()) for k in keys if k in sd):
            sd = {k: v for k, v in sd.items() if k not in keys}
            _note(notes, f"zero {flag} left out (the model has none; the same function)")
        else:
            raise ValueError(
                f"{path}: the weights have {flag}, the model has none (set model.{flag})"
            )
    return sd


def _adapt_mask_token(sd: dict, theirs: ViTArch, mine: ViTArch, notes) -> dict:
    if theirs.mask_token and not mine.mask_token:
        _note(notes, "the mask token left out (the model has none)")
        return {k: v for k, v in sd.items() if k != "mask_token"}
    if mine.mask_token and not theirs.mask_token:
        _note(notes, "the mask token starts at zero (the weights have none)")
        return sd | {"mask_token": sd["cls_token"].new_zeros(1, mine.embed_dim)}
    return sd


def _adapt_key_bias(sd: dict, theirs: DinoV3Arch, mine: DinoV3Arch, path, notes) -> dict:
    """A plain qkv bias and DINOv3's masked one (q and v, the key's zero) into each other."""
    if not (theirs.qkv_bias and mine.qkv_bias) or theirs.mask_k_bias == mine.mask_k_bias:
        return sd
    out = dict(sd)
    for i in range(mine.depth):
        stem = f"blocks.{i}.attn.qkv."
        if mine.mask_k_bias:
            q, k, v = out.pop(stem + "bias").chunk(3)
            if k.any():
                raise ValueError(
                    f"{path}: the weights have a key bias, the model holds it at "
                    "zero (DINOv3's mask_k_bias)"
                )
            out[stem + "q_bias"], out[stem + "v_bias"] = q, v
        else:
            q, v = out.pop(stem + "q_bias"), out.pop(stem + "v_bias")
            out[stem + "bias"] = torch.cat((q, torch.zeros_like(q), v))
    how = "masked, as the model's" if mine.mask_k_bias else "made a learned one (no mask here)"
    _note(notes, f"the key bias of zero {how}")
    return out


def _adapt_local_norm(sd: dict, theirs: DinoV3Arch, mine: DinoV3Arch, notes) -> dict:
    """The local crops' class norm (training only) left out, or started as the class norm."""
    if theirs.untie_global_and_local_cls_norm == mine.untie_global_and_local_cls_norm:
        return sd
    if theirs.untie_global_and_local_cls_norm:
        _note(notes, "the local crops' class norm left out (the model has none; training only)")
        return {k: v for k, v in sd.items() if not k.startswith("local_cls_norm.")}
    source = "cls_norm" if mine.untie_cls_and_patch_norms else "norm"
    _note(notes, f"the local crops' class norm starts as the {source} (the weights have none)")
    return sd | {f"local_cls_norm.{p}": sd[f"{source}.{p}"].clone() for p in ("weight", "bias")}


def _adapt_dinov3(sd: dict, model: DinoV3VisionTransformer, path: Path, notes) -> dict:
    """A DINOv3 state made to fit ``model`` where the function stays the same."""
    theirs, mine = dinov3_arch(sd), module_arch(model)
    sd = _adapt_layerscale(sd, theirs, mine, path, notes)
    sd = _adapt_key_bias(sd, theirs, mine, path, notes)
    sd = _adapt_biases(sd, dinov3_arch(sd), mine, path, notes)  # the qkv bias now as mine
    sd = _adapt_local_norm(sd, theirs, mine, notes)
    return _adapt_mask_token(sd, theirs, mine, notes)


def _adapt(sd: dict, model: nn.Module, path: Path, notes: list[str]) -> dict:
    """A ViT state made to fit ``model`` where the function stays the same."""
    if "cls_token" not in sd or not isinstance(model, VisionTransformer):
        return sd
    if isinstance(model, DinoV3VisionTransformer):
        return _adapt_dinov3(sd, model, path, notes)
    theirs, mine = vit_arch(sd), vit_arch(model.state_dict(), model.num_heads)
    sd = _adapt_layerscale(sd, theirs, mine, path, notes)
    sd = _adapt_biases(sd, theirs, mine, path, notes)
    return _adapt_mask_token(sd, theirs, mine, notes)


def load_strict(module: nn.Module, sd: dict, what: str, path: Path) -> None:
    try:
        module.load_state_dict(sd, strict=True)
    except RuntimeError as e:
        result = module.load_state_dict(sd, strict=False) if "size mismatch" not in str(e) else None
        if result is None:
            raise ValueError(
                f"{path}: the {what} weights do not fit: {' '.join(str(e).split())}"
            ) from None
        raise ValueError(
            f"{path}: the {what} weights do not fit: missing keys {result.missing_keys}, "
            f"unexpected keys {result.unexpected_keys}"
        ) from None


def _describe(name: str, patch: int | None) -> str:
    return f"a {name}" + (f" with patch {patch}" if patch else "")


def _module_name(sd: dict) -> tuple[str, int | None]:
    if "cls_token" in sd:
        arch = vit_arch(sd)
        return arch.name or "vit", arch.patch_size
    return ("resnet50" if "layer1.0.conv3.weight" in sd else "resnet18"), None


def _check_dinov3(weights: ExternalWeights, backbone: nn.Module) -> None:
    """DINOv3's weights into DINOv3's ViT only, of the same shape, heads and RoPE."""
    theirs = weights.arch if isinstance(weights.arch, DinoV3Arch) else None
    mine = module_arch(backbone) if isinstance(backbone, DinoV3VisionTransformer) else None
    if theirs is None or mine is None:
        held = theirs.describe() if theirs else _describe(weights.backbone, weights.patch_size)
        model = mine.describe() if mine else _describe(*_module_name(backbone.state_dict()))
        raise ValueError(
            f"{weights.path}: the weights hold {held}, the model is {model}; "
            "DINOv3's ViT (RoPE, model.backbone vit_*_dinov3) and the other "
            "backbones do not load into each other"
        )
    if theirs.shape() != mine.shape():
        raise ValueError(
            f"{weights.path}: the weights hold {theirs.describe()}, the model is "
            f"{mine.describe()} (set model.backbone, model.patch_size and "
            "model.depth to match)"
        )
    if theirs.num_heads and theirs.num_heads != mine.heads:
        raise ValueError(
            f"{weights.path}: the weights have {theirs.num_heads} heads, the model {mine.heads}"
        )
    if theirs.rope is not None and theirs.rope != mine.rope_spec:
        raise ValueError(
            f"{weights.path}: the weights' RoPE has {theirs.rope.describe()}, the "
            f"model's {mine.rope_spec.describe()}"
        )


def _check_architecture(weights: ExternalWeights, backbone: nn.Module) -> None:
    if isinstance(weights.arch, DinoV3Arch) or isinstance(backbone, DinoV3VisionTransformer):
        _check_dinov3(weights, backbone)
        return
    if weights.arch is not None and isinstance(backbone, VisionTransformer):
        mine = vit_arch(backbone.state_dict(), backbone.num_heads)
        theirs = weights.arch
        if theirs.shape() != mine.shape():
            raise ValueError(
                f"{weights.path}: the weights hold {theirs.describe()}, the model is "
                f"{mine.describe()} (set model.backbone, model.patch_size and model.depth, "
                "and model.num_register_tokens and model.ffn_layer, to match)"
            )
        if theirs.num_heads and theirs.num_heads != backbone.num_heads:
            raise ValueError(
                f"{weights.path}: the weights have {theirs.num_heads} heads, the "
                f"model {backbone.num_heads}"
            )
        return
    mine = _module_name(backbone.state_dict())
    if mine != (weights.backbone, weights.patch_size):
        raise ValueError(
            f"{weights.path}: the weights hold {_describe(weights.backbone, weights.patch_size)}, "
            f"the model is {_describe(*mine)} (set model.backbone and model.patch_size to match)"
        )


def _load_backbone_state(module: nn.Module, sd: dict, path: Path, notes: list[str]) -> None:
    sd = adapt_input_weights(sd, module, notes)  # RGB filters for a model of other channels
    sd = _fit_pos_embed(_adapt(sd, module, path, notes), module, notes)
    load_strict(module, sd, "backbone", path)


def _load_network(net: nn.Module, weights: dict, path: Path, notes: list[str]) -> None:
    _load_backbone_state(net.backbone, weights["backbone"], path, notes)
    head = weights["head"]
    if head is None:
        return
    shapes = {k: tuple(v.shape) for k, v in net.head.state_dict().items()}
    if shapes != {k: tuple(v.shape) for k, v in head.items()}:
        _note(notes, "head not loaded (its shapes differ from the model's): it starts fresh")
        return
    load_strict(net.head, head, "head", path)


def init_from(
    path: str | os.PathLike, student: nn.Module, teacher: nn.Module, loss: nn.Module | None = None
) -> list[str]:
    """Starts ``student`` and ``teacher`` (multi-crop wrappers of a backbone
    and a head) from the weights at ``path``: each network from its own
    weights in a training checkpoint, both from the one network otherwise;
    the head too when the file has one that fits, and ``loss``'s center when
    the file is a training checkpoint whose center fits. Returns notes on
    what was loaded and adapted. Another architecture raises ValueError
    naming both; a key mismatch one listing the missing and unexpected keys."""
    weights = read_weights(path)
    notes = [f"{weights.format} weights ({weights.backbone}) from {path}"]
    _check_architecture(weights, student.backbone)
    with torch.no_grad():
        _load_network(student, weights.student, weights.path, notes)
        _load_network(teacher, weights.teacher, weights.path, notes)
        center = weights.center
        if loss is not None and center is not None and center.shape == loss.center.shape:
            loss.center.copy_(center)
            notes.append("the loss's center taken from the checkpoint")
    return notes


def load_backbone(
    path: str | os.PathLike, backbone: nn.Module, which: str = "teacher"
) -> list[str]:
    """Loads the ``which`` backbone of the weights at ``path`` (any format
    :func:`~dino_opt.weights.read_weights` reads) into a bare ``backbone``
    module; returns notes on what was adapted. What keeps the function is
    adapted: a position table of another grid resized (as the model
    resizes tables), a LayerScale of 1 or zero biases left out where the
    model has none, a LayerScale of 1 or zero biases added where the weights
    have none, the mask token added (zero) or left out; for DINOv3's ViT
    also a zero key bias between the masked and the plain qkv bias, and the
    local crops' class norm left out or started as the class norm. Anything
    else raises ValueError naming it."""
    if which not in ("teacher", "student"):
        raise ValueError(f"which must be 'teacher' or 'student', got {which!r}")
    weights = read_weights(path)
    notes = [f"{weights.format} weights ({weights.backbone}) from {path}"]
    _check_architecture(weights, backbone)
    with torch.no_grad():
        net = weights.teacher if which == "teacher" else weights.student
        _load_backbone_state(backbone, net["backbone"], weights.path, notes)
    return notes


def evaluation_backbone(weights: ExternalWeights, sd: dict) -> tuple[nn.Module, int]:
    """The backbone the weights hold (a ViT as its architecture says, with
    the heads and interpolation its file says or the named size's), and
    the input size its position table is for."""
    if isinstance(weights.arch, DinoV3Arch):
        return DinoV3VisionTransformer(**weights.arch.model_kwargs()), weights.arch.img_size
    if weights.arch is not None:
        return VisionTransformer(**weights.arch.model_kwargs()), weights.arch.img_size
    return build_backbone(weights.backbone, drop_path_rate=0.0)[0], _DINO_SIZE


def evaluate_weights(
    path: str | os.PathLike,
    data: str | os.PathLike,
    image_size: int | None = None,
    k: int = 20,
    temperature: float = 0.07,
    device: str = "auto",
    which: str = "teacher",
) -> dict:
    """k-NN top-1/top-5 of the backbone of the weights at ``path`` (any
    format :func:`read_weights` reads) on ``data/train`` vs ``data/val``,
    and ``data/test`` where it exists. ``image_size`` defaults to the size
    the network was trained at where the weights say it (a dino_opt run or
    export), else to the size a ViT's position table was made for (224 for
    a ResNet)."""
    if which not in ("teacher", "student"):
        raise ValueError(f"which must be 'teacher' or 'student', got {which!r}")
    weights = read_weights(path)
    sd = (weights.teacher if which == "teacher" else weights.student)["backbone"]
    net, native = evaluation_backbone(weights, sd)
    image_size = image_size or (weights.training or {}).get("image_size") or native
    load_strict(net, sd, "backbone", weights.path)
    root = Path(data)
    splits = {s: root / s for s in ("val", "test") if (root / s).is_dir()}
    if "val" not in splits or not (root / "train").is_dir():
        raise FileNotFoundError(f"data folder {str(root)!r} needs train/ and val/ folders")
    dev = resolve_device(device)
    results = knn_evaluate_splits(
        net.to(dev), root / "train", splits, image_size, dev, k=k, temperature=temperature
    )
    out = {
        "weights": str(path),
        "format": weights.format,
        "backbone": weights.backbone,
        "which": which,
        "image_size": image_size,
        "device": str(dev),
    }
    for split, r in results.items():
        prefix = "" if split == "val" else f"{split}_"
        out |= {f"{prefix}top1": r["top1"], f"{prefix}top5": r["top5"]}
    return out
