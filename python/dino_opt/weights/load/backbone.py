"""Weights into a backbone: any format :func:`~dino_opt.weights.read_weights`
reads loaded into a module of dino_opt, adapted where that keeps the
function (a position table resized to the model's grid; LayerScale, biases,
the mask token, DINOv3's key bias and local class norm added or left out:
see :func:`load_backbone`); :func:`init_from` starts a training run's
networks from them (``model.init_from``); :func:`open_backbone` builds the
backbone the weights hold and loads them (the probes, ``dino-opt show``,
``embed``, ``predict``, the ONNX export, a distillation's teacher).
DINOv3's weights load into DINOv3's ViT only, and the other ViTs' into the
others."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn

from ...config import Config
from ...eval import load_checkpoint
from ...models import DinoV3VisionTransformer, VisionTransformer, build_backbone
from ...models.channels import adapt_input_weights
from ...models.vit import pos_embed_grid, resize_pos_embed
from ...ops.library import IMAGENET_MEAN, IMAGENET_STD
from ..layouts.dinov3 import DinoV3Arch, dinov3_arch, module_arch
from ..layouts.vit import DINO_IMAGE_SIZE, ViTArch, vit_arch
from .reading import ExternalWeights, read_weights

__all__ = [
    "OpenedBackbone",
    "evaluation_backbone",
    "init_from",
    "load_backbone",
    "load_strict",
    "open_backbone",
]


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
    return build_backbone(weights.backbone, drop_path_rate=0.0)[0], DINO_IMAGE_SIZE


class OpenedBackbone(NamedTuple):
    """A backbone with its weights loaded: ``net``, the input ``image_size``
    it was trained at (where the run or the export says it, else the size
    its position table was made for), the weights' ``format`` and ``name``,
    the run's ``config`` where the weights came from dino_opt training, and
    the normalisation's ``mean`` and ``std``."""

    net: nn.Module
    image_size: int
    format: str
    name: str
    config: Config | None
    mean: tuple[float, ...] = IMAGENET_MEAN
    std: tuple[float, ...] = IMAGENET_STD
    image_mode: str = "rgb"  # "native": images read at their stored depth and channels


def _run_config(path: Path) -> Config | None:
    """The config of a dino_opt run folder or checkpoint file (None for other weights)."""
    try:
        ckpt = load_checkpoint(path, keys=("config",))
    except (ValueError, FileNotFoundError, RuntimeError, OSError):
        return None
    try:
        return Config.from_dict(ckpt["config"])
    except (ValueError, TypeError, AttributeError) as e:
        raise ValueError(f"checkpoint {str(path)!r}: its config is not valid: {e}") from e


def open_backbone(path: str | os.PathLike, which: str = "teacher") -> OpenedBackbone:
    """The ``which`` backbone (teacher or student) of the weights at ``path``."""
    if which not in ("teacher", "student"):
        raise ValueError(f"which must be 'teacher' or 'student', got {which!r}")
    weights = read_weights(path)
    sd = (weights.teacher if which == "teacher" else weights.student)["backbone"]
    net, native = evaluation_backbone(weights, sd)
    load_strict(net, sd, "backbone", weights.path)
    cfg = _run_config(Path(path)) if weights.format == "dino_opt" else None
    trained = weights.training or {"image_size": native}
    norm = {k: tuple(trained[k]) for k in ("mean", "std") if k in trained}
    norm["image_mode"] = trained.get("image_mode", "rgb")
    return OpenedBackbone(
        net.eval(), trained["image_size"], weights.format, weights.backbone, cfg, **norm
    )
