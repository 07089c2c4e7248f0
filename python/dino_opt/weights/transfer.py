"""Weights in and out: a training run's backbone (and head) in the formats
other tools load, and weights in those formats as a starting point.

Export (:func:`export_weights`, ``dino-opt export``):

- ``timm``: one safetensors file whose state dict
  ``timm.create_model(name, num_classes=0, **kwargs)`` loads with
  ``strict=True`` (``name`` and ``kwargs`` are in the file's metadata:
  ``vit_small_patch16_224``, ``vit_small_patch8_224``, ... and, where the
  image size or patch differ from the name's, ``img_size`` / ``patch_size``);
- ``hf``: a folder (``config.json`` + ``model.safetensors``, the layout of the
  published DINO ViT checkpoints) that
  ``transformers.ViTModel.from_pretrained(path, add_pooling_layer=False)``
  loads; ``last_hidden_state[:, 0]`` is the backbone's feature;
- ``dino``: the original code's files: the backbone state dict its model zoo
  ships (``vision_transformer.vit_*`` or torchvision's ResNet load it), or with
  ``full=True`` a training checkpoint as its ``main_dino.py`` writes and
  resumes (``student`` with DistributedDataParallel's ``module.`` prefix,
  ``teacher``, ``optimizer``, ``epoch``, ``dino_loss``, ``args``).

ViT position tables are stored for 224-pixel inputs. ``image_size`` exports
the table resized the way dino_opt resizes it at that size, so the target
computes what dino_opt computes there; the result says so.

Import (:func:`read_weights`, :func:`init_from`): any of these, or a
dino_opt checkpoint or run folder, detected from the file; a backbone of
another patch grid is resized to the model's. ``model.init_from`` starts a
training run from them; ``dino-opt knn --weights`` evaluates them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save
from torch import nn

from ..checkpoint import atomic_write, fsync_dir
from ..config import Config
from ..eval import knn_evaluate_splits, load_checkpoint
from ..models import build_backbone
from ..models.vit import pos_embed_grid, resize_pos_embed
from ..runtime import resolve_device

__all__ = [
    "FORMATS",
    "ExportResult",
    "ExternalWeights",
    "evaluate_weights",
    "export_weights",
    "init_from",
    "read_weights",
]

FORMATS = ("timm", "hf", "dino")
_VIT_WIDTHS = {192: ("vit_tiny", 3), 384: ("vit_small", 6), 768: ("vit_base", 12)}
_TIMM_NAMES = {"vit_tiny_patch16_224", "vit_small_patch16_224", "vit_small_patch8_224",
               "vit_base_patch16_224", "vit_base_patch8_224"}  # fmt: skip
_NATIVE_SIZE = 224  # the input size every ViT position table is stored for


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


# ---------------------------------------------------------------- key layouts


def _vit_shape(backbone_sd: dict) -> tuple[str, int, int, int]:
    """(name, width, depth, patch) of a ViT state dict in dino_opt's keys."""
    width = backbone_sd["cls_token"].shape[-1]
    if width not in _VIT_WIDTHS:
        raise ValueError(f"a ViT of width {width} is none of {sorted(_VIT_WIDTHS)}")
    depth = len({k.split(".")[1] for k in backbone_sd if k.startswith("blocks.")})
    patch = backbone_sd["patch_embed.proj.weight"].shape[-1]
    return _VIT_WIDTHS[width][0], width, depth, patch


def _to_hf(sd: dict) -> dict:
    """dino_opt's ViT keys -> the published DINO checkpoints' ViTModel keys."""
    out = {
        "embeddings.cls_token": sd["cls_token"],
        "embeddings.position_embeddings": sd["pos_embed"],
        "embeddings.patch_embeddings.projection.weight": sd["patch_embed.proj.weight"],
        "embeddings.patch_embeddings.projection.bias": sd["patch_embed.proj.bias"],
        "layernorm.weight": sd["norm.weight"],
        "layernorm.bias": sd["norm.bias"],
    }
    for i in range(_vit_shape(sd)[2]):
        b, h = f"blocks.{i}.", f"encoder.layer.{i}."
        for kind in ("weight", "bias"):
            q, k, v = sd[f"{b}attn.qkv.{kind}"].chunk(3)
            out |= {f"{h}attention.attention.query.{kind}": q,
                    f"{h}attention.attention.key.{kind}": k,
                    f"{h}attention.attention.value.{kind}": v,
                    f"{h}attention.output.dense.{kind}": sd[f"{b}attn.proj.{kind}"],
                    f"{h}intermediate.dense.{kind}": sd[f"{b}mlp.fc1.{kind}"],
                    f"{h}output.dense.{kind}": sd[f"{b}mlp.fc2.{kind}"],
                    f"{h}layernorm_before.{kind}": sd[f"{b}norm1.{kind}"],
                    f"{h}layernorm_after.{kind}": sd[f"{b}norm2.{kind}"]}  # fmt: skip
    return {k: v.contiguous() for k, v in out.items()}


def _from_hf(sd: dict) -> dict:
    """The published ViTModel keys (``vit.`` prefix allowed) -> dino_opt's."""
    sd = {k.removeprefix("vit."): v for k, v in sd.items()}
    out = {
        "cls_token": sd["embeddings.cls_token"],
        "pos_embed": sd["embeddings.position_embeddings"],
        "patch_embed.proj.weight": sd["embeddings.patch_embeddings.projection.weight"],
        "patch_embed.proj.bias": sd["embeddings.patch_embeddings.projection.bias"],
        "norm.weight": sd["layernorm.weight"],
        "norm.bias": sd["layernorm.bias"],
    }
    depth = len({k.split(".")[2] for k in sd if k.startswith("encoder.layer.")})
    for i in range(depth):
        b, h = f"blocks.{i}.", f"encoder.layer.{i}."
        for kind in ("weight", "bias"):
            qkv = [sd[f"{h}attention.attention.{n}.{kind}"] for n in ("query", "key", "value")]
            out |= {f"{b}attn.qkv.{kind}": torch.cat(qkv),
                    f"{b}attn.proj.{kind}": sd[f"{h}attention.output.dense.{kind}"],
                    f"{b}mlp.fc1.{kind}": sd[f"{h}intermediate.dense.{kind}"],
                    f"{b}mlp.fc2.{kind}": sd[f"{h}output.dense.{kind}"],
                    f"{b}norm1.{kind}": sd[f"{h}layernorm_before.{kind}"],
                    f"{b}norm2.{kind}": sd[f"{h}layernorm_after.{kind}"]}  # fmt: skip
    return out


def _hf_config(sd: dict, image_size: int) -> dict:
    name, width, depth, patch = _vit_shape(sd)
    return {
        "architectures": ["ViTModel"],
        "model_type": "vit",
        "hidden_size": width,
        "num_hidden_layers": depth,
        "num_attention_heads": _VIT_WIDTHS[width][1],
        "intermediate_size": sd["blocks.0.mlp.fc1.weight"].shape[0],
        "hidden_act": "gelu",
        "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0,
        "layer_norm_eps": 1e-6,
        "image_size": image_size,
        "patch_size": patch,
        "num_channels": 3,
        "qkv_bias": True,
        "initializer_range": 0.02,
    }


def _timm_load(name: str, patch: int, image_size: int) -> tuple[str, dict]:
    """The timm model name and the keywords that build the exported network."""
    size = name.removeprefix("vit_")
    kwargs: dict = {"num_classes": 0}
    model = f"vit_{size}_patch{patch}_224"
    if model not in _TIMM_NAMES:
        model, kwargs["patch_size"] = f"vit_{size}_patch16_224", patch
    if image_size != _NATIVE_SIZE:
        kwargs["img_size"] = image_size
    return model, kwargs


# ---------------------------------------------------------------- export


def _sub_dict(state: dict, prefix: str) -> dict:
    return {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}


def _check_output(output: Path, force: bool) -> None:
    if output.exists() or output.is_symlink():
        if not force:
            raise FileExistsError(
                f"output {str(output)!r} exists; choose another path or pass --force to replace it"
            )
        if output.is_dir() and not output.is_symlink():
            shutil.rmtree(output)
        else:
            output.unlink()
    output.parent.mkdir(parents=True, exist_ok=True)


def _save_safetensors(tensors: dict, path: Path, metadata: dict) -> None:
    data = save({k: v.contiguous() for k, v in tensors.items()}, metadata=metadata)
    atomic_write(path, lambda f: f.write(data))
    fsync_dir(path.parent)


def _export_vit(
    fmt: str, backbone_sd: dict, output: Path, image_size: int, meta: dict
) -> tuple[str, list[str]]:
    name, _, _, patch = _vit_shape(backbone_sd)
    if image_size % patch:
        raise ValueError(f"image_size {image_size} is not a multiple of the patch size {patch}")
    grid = (image_size // patch,) * 2
    notes, sd = [], dict(backbone_sd)
    if grid != pos_embed_grid(sd["pos_embed"]):
        old = pos_embed_grid(sd["pos_embed"])
        sd["pos_embed"] = resize_pos_embed(sd["pos_embed"], grid)
        notes.append(
            f"position embeddings resized from {old[0]}x{old[1]} to {grid[0]}x{grid[1]} patches "
            f"for {image_size}-pixel inputs (bicubic, as dino_opt resizes them)"
        )
    if fmt == "timm":
        model, kwargs = _timm_load(name, patch, image_size)
        meta |= {"timm_model": model, "timm_kwargs": json.dumps(kwargs)}
        _save_safetensors(sd, output, meta)
        return f"timm.create_model({model!r}, **{kwargs})", notes
    output.mkdir(parents=True)
    (output / "config.json").write_text(json.dumps(_hf_config(sd, image_size), indent=2) + "\n")
    _save_safetensors(_to_hf(sd), output / "model.safetensors", meta)
    return "transformers.ViTModel.from_pretrained(path, add_pooling_layer=False)", notes


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


def export_weights(
    source: str | os.PathLike,
    fmt: str,
    output: str | os.PathLike,
    *,
    which: str = "teacher",
    full: bool = False,
    image_size: int = _NATIVE_SIZE,
    force: bool = False,
) -> ExportResult:
    """Writes the ``which`` network (teacher by default) of a training
    checkpoint or run folder ``source`` as ``fmt`` (see the module docstring)
    to ``output``. Refuses an existing ``output`` unless ``force``, a
    backbone the format does not take, and a checkpoint without weights,
    naming each."""
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if which not in ("teacher", "student"):
        raise ValueError(f"which must be 'teacher' or 'student', got {which!r}")
    if full and fmt != "dino":
        raise ValueError("full=True (--full) applies to --format dino only")
    if fmt == "dino" and image_size != _NATIVE_SIZE:
        raise ValueError(
            f"image_size {image_size}: --format dino keeps DINO's 224-pixel position table "
            "(its code resizes it for other inputs); --image-size applies to timm and hf"
        )
    ckpt = load_checkpoint(source, keys=(which, "config"))
    cfg = Config.from_dict(ckpt["config"])
    backbone = cfg.model.backbone
    if fmt in ("timm", "hf") and not backbone.startswith("vit"):
        raise ValueError(
            f"format {fmt} takes ViT backbones (vit_tiny, vit_small, vit_base); {source} "
            f"holds a {backbone}; --format dino writes it as a torchvision state dict"
        )
    output = Path(output)
    _check_output(output, force)
    backbone_sd = _sub_dict(ckpt[which], "backbone.")
    meta = {"format": "pt", "dino_opt_source": str(source), "dino_opt_which": which}
    if fmt in ("timm", "hf"):
        load, notes = _export_vit(fmt, backbone_sd, output, image_size, meta)
        return ExportResult(output, fmt, which, backbone, image_size, load, notes)
    state = _dino_full(ckpt) if full else backbone_sd
    atomic_write(output, lambda f: torch.save(state, f))
    fsync_dir(output.parent)
    load = "main_dino.py --resume" if full else "vision_transformer / torchvision load_state_dict"
    return ExportResult(output, "dino-full" if full else "dino", which, backbone,
                        _NATIVE_SIZE, load, [])  # fmt: skip


# ---------------------------------------------------------------- import


@dataclass
class ExternalWeights:
    """Weights read by :func:`read_weights`: the ``format`` detected, the
    ``student`` and ``teacher`` networks as ``{"backbone": ..., "head": ...}``
    state dicts in dino_opt's keys (the same one twice for a backbone-only
    file; ``head`` None when the file has none), the ``backbone`` name, its
    ``patch_size`` (ViTs), and the loss's ``center`` of a training checkpoint."""

    path: Path
    format: str
    student: dict
    teacher: dict
    backbone: str
    patch_size: int | None = None
    center: torch.Tensor | None = None


def _torch_load(path: Path) -> dict:
    # The original DINO code pickles its argparse arguments into checkpoints.
    with torch.serialization.safe_globals([argparse.Namespace]):
        try:
            with open(path, "rb") as f:  # a file object: whatever its name, torch's format
                return torch.load(f, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - any unreadable file: one message naming it
            raise ValueError(f"{path}: not a weights file torch can read safely ({e})") from e


def _split(state: dict) -> dict:
    """``{"backbone", "head"}`` of a network's state dict (``module.`` and a
    backbone prefix stripped; a bare backbone gives no head)."""
    state = {k.removeprefix("module."): v for k, v in state.items()}
    if any(k.startswith("backbone.") for k in state):
        head = _sub_dict(state, "head.")
        return {"backbone": _sub_dict(state, "backbone."), "head": head or None}
    return {"backbone": state, "head": None}


def _backbone_name(sd: dict) -> tuple[str, int | None]:
    if "cls_token" in sd:
        name, _, _, patch = _vit_shape(sd)
        return name, patch
    if "layer4.0.conv1.weight" in sd:
        return ("resnet50" if "layer1.0.conv3.weight" in sd else "resnet18"), None
    raise ValueError(f"the weights are neither a ViT nor a ResNet (keys {sorted(sd)[:4]} ...)")


def _read_safetensors(path: Path) -> dict:
    try:
        with safe_open(str(path), "pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - no items()
    except Exception as e:  # noqa: BLE001 - any unreadable file: one message naming it
        raise ValueError(f"{path}: not a readable safetensors file ({e})") from e


def _is_safetensors(path: Path) -> bool:
    """A safetensors file starts with the little-endian length of its JSON
    header, then the header's ``{``; torch's files are zip archives (``PK``)."""
    with open(path, "rb") as f:
        head = f.read(9)
    size = int.from_bytes(head[:8], "little") if len(head) == 9 else 0
    return head[8:9] == b"{" and 0 < size <= path.stat().st_size - 8


def _read_raw(path: Path) -> tuple[str, dict, dict, torch.Tensor | None]:
    """(format, student state, teacher state, center) of a file or folder."""
    if path.is_dir() and (path / "config.json").is_file():
        sd = _read_safetensors(path / "model.safetensors")
        net = {"backbone": _from_hf(sd), "head": None}
        return "hf", net, net, None
    if path.is_dir():  # a dino_opt run folder or checkpoints/ folder
        ckpt = load_checkpoint(path, keys=("student", "teacher"))
        center = ckpt.get("loss", {}).get("center")
        return "dino_opt", _split(ckpt["student"]), _split(ckpt["teacher"]), center
    if _is_safetensors(path):
        sd = _read_safetensors(path)
        if any(k.startswith(("embeddings.", "vit.embeddings.")) for k in sd):
            net = {"backbone": _from_hf(sd), "head": None}
            return "hf", net, net, None
        net = _split(sd)
        return "timm", net, net, None
    state = _torch_load(path)
    if not isinstance(state, dict):
        raise ValueError(f"{path}: holds a {type(state).__name__}, not a state dict")
    if "student" in state and "teacher" in state:
        kind, loss = ("dino_opt", "loss") if "config" in state else ("dino-full", "dino_loss")
        center = (state.get(loss) or {}).get("center")
        return kind, _split(state["student"]), _split(state["teacher"]), center
    net = _split(state)
    return "dino", net, net, None


def read_weights(path: str | os.PathLike) -> ExternalWeights:
    """Weights from a timm safetensors file, a Hugging Face ViT folder, an
    original DINO backbone or training checkpoint, or a dino_opt checkpoint
    or run folder, detected from the file (see the module docstring)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"weights {str(path)!r} do not exist")
    fmt, student, teacher, center = _read_raw(path)
    if not teacher["backbone"]:
        raise ValueError(f"{path}: holds no backbone weights")
    name, patch = _backbone_name(teacher["backbone"])
    return ExternalWeights(path, fmt, student, teacher, name, patch, center)


def _fit_pos_embed(sd: dict, model: nn.Module, notes: list[str]) -> dict:
    """The backbone state with its position table resized to ``model``'s grid."""
    if "pos_embed" not in sd or not hasattr(model, "pos_embed"):
        return sd
    mine, theirs = pos_embed_grid(model.pos_embed), pos_embed_grid(sd["pos_embed"])
    if mine == theirs:
        return sd
    notes.append(f"position embeddings resized from {theirs[0]}x{theirs[1]} to "
                 f"{mine[0]}x{mine[1]} patches")  # fmt: skip
    return {**sd, "pos_embed": resize_pos_embed(sd["pos_embed"], mine)}


def _load_strict(module: nn.Module, sd: dict, what: str, path: Path) -> None:
    try:
        module.load_state_dict(sd, strict=True)
    except RuntimeError as e:
        result = module.load_state_dict(sd, strict=False) if "size mismatch" not in str(e) else None
        if result is None:
            raise ValueError(f"{path}: the {what} weights do not fit: {e}") from None
        raise ValueError(
            f"{path}: the {what} weights do not fit: missing keys {result.missing_keys}, "
            f"unexpected keys {result.unexpected_keys}"
        ) from None


def _describe(name: str, patch: int | None) -> str:
    return f"a {name}" + (f" with patch {patch}" if patch else "")


def _check_architecture(weights: ExternalWeights, backbone: nn.Module) -> None:
    mine = _backbone_name(backbone.state_dict())
    if mine != (weights.backbone, weights.patch_size):
        raise ValueError(
            f"{weights.path}: the weights hold {_describe(weights.backbone, weights.patch_size)}, "
            f"the model is {_describe(*mine)} (set model.backbone and model.patch_size to match)"
        )


def _load_network(net: nn.Module, weights: dict, path: Path, notes: list[str]) -> None:
    _load_strict(net.backbone, _fit_pos_embed(weights["backbone"], net.backbone, notes),
                 "backbone", path)  # fmt: skip
    head = weights["head"]
    if head is None:
        return
    shapes = {k: tuple(v.shape) for k, v in net.head.state_dict().items()}
    if shapes != {k: tuple(v.shape) for k, v in head.items()}:
        notes.append("head not loaded (its shapes differ from the model's): it starts fresh")
        return
    _load_strict(net.head, head, "head", path)


def init_from(
    path: str | os.PathLike, student: nn.Module, teacher: nn.Module, loss: nn.Module | None = None
) -> list[str]:
    """Starts ``student`` and ``teacher`` (multi-crop wrappers of a backbone
    and a head) from the weights at ``path``: each network from its own
    weights in a training checkpoint, both from the one network otherwise;
    the head too when the file has one that fits, and ``loss``'s center when
    the file is a training checkpoint whose center fits. Returns notes on
    what was loaded and adapted. A key mismatch raises ValueError listing the
    missing and unexpected keys."""
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
    and ``data/test`` where it exists. ``image_size`` defaults to the size a
    ViT's position table was exported for (224 for a ResNet)."""
    if which not in ("teacher", "student"):
        raise ValueError(f"which must be 'teacher' or 'student', got {which!r}")
    weights = read_weights(path)
    sd = (weights.teacher if which == "teacher" else weights.student)["backbone"]
    kwargs, native = {}, _NATIVE_SIZE
    if weights.patch_size is not None:  # a ViT built for the size its table was exported for
        native = pos_embed_grid(sd["pos_embed"])[0] * weights.patch_size
        kwargs = {"patch_size": weights.patch_size, "img_size": native}
    image_size = image_size or native
    net, _ = build_backbone(weights.backbone, drop_path_rate=0.0, **kwargs)
    _load_strict(net, sd, "backbone", weights.path)
    root = Path(data)
    splits = {s: root / s for s in ("val", "test") if (root / s).is_dir()}
    if "val" not in splits or not (root / "train").is_dir():
        raise FileNotFoundError(f"data folder {str(root)!r} needs train/ and val/ folders")
    dev = resolve_device(device)
    results = knn_evaluate_splits(net.to(dev), root / "train", splits, image_size, dev, k=k,
                                  temperature=temperature)  # fmt: skip
    out = {"weights": str(path), "format": weights.format, "backbone": weights.backbone,
           "which": which, "image_size": image_size, "device": str(dev)}  # fmt: skip
    for split, r in results.items():
        prefix = "" if split == "val" else f"{split}_"
        out |= {f"{prefix}top1": r["top1"], f"{prefix}top5": r["top5"]}
    return out
