"""Weights read from any format dino_opt knows, detected from the file's
content (never its name), as dino_opt's state dicts with the architecture
they hold.

=============  ==========================================================
format         what it is
=============  ==========================================================
``dino_opt``   a dino_opt checkpoint or run folder (student, teacher, config)
``dino-full``  a training checkpoint of DINO's ``main_dino.py``
``dino``       a DINO (v1) backbone state dict (its model zoo's files)
``dinov2``     a DINOv2 backbone state dict (the published ``*_pretrain.pth``,
               with ``mask_token``; chunked blocks too) or a DINOv2
               training checkpoint (``teacher`` / ``model``)
``dinov3``     a DINOv3 backbone state dict (the published
               ``dinov3_*_pretrain_*.pth``: ``storage_tokens``,
               ``rope_embed.periods``, ``qkv.bias_mask``), a DINOv3 training
               checkpoint (``teacher`` / ``model``), or a bare DINOv3
               backbone in dino_opt's keys
``timm``       a timm ViT state dict (safetensors, or a torch file with
               timm's register or SwiGLU layout), or timm's DINOv3 port
               (``vit_*_patch16_dinov3``: ``reg_token``, ``gamma_1``,
               ``attn.q_bias``, ``fc1_g``)
``hf``         a Hugging Face folder or safetensors file: ViTModel (DINO),
               Dinov2Model, Dinov2WithRegistersModel, DINOv3ViTModel
               (``model_type`` ``dinov3_vit``, ``embeddings.register_tokens``,
               ``layer.{i}.*``)
=============  ==========================================================

A ViT without a position table is DINOv3's (RoPE): it is read in
:class:`~dino_opt.models.DinoV3VisionTransformer`'s keys with a
:class:`~dino_opt.weights.layouts.dinov3.DinoV3Arch` (its ``vit_*_dinov3``
size and options; the heads and RoPE from DINOv3's periods or the Hugging
Face config).
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors import safe_open

from ...checkpoint import atomic_write
from ...config import Config
from ...eval import load_checkpoint
from ...ops.library import IMAGENET_MEAN, IMAGENET_STD
from ..layouts.dinov3 import (
    DinoV3Arch,
    RopeSpec,
    dinov3_arch,
    dinov3_layout,
    from_dinov3_layout,
    is_rope_vit,
    rope_from_periods,
)
from ..layouts.vit import (
    ViTArch,
    from_hf_dinov2,
    from_hf_vit,
    from_timm,
    is_chunked,
    unchunk,
    vit_arch,
)
from .hub import weights_location

__all__ = [
    "TRAINING_KEY",
    "ExternalWeights",
    "read_state_dict",
    "read_weights",
    "sub_dict",
    "training_input",
    "training_sidecar",
    "write_training_sidecar",
]

#: Where an export keeps the input its network was trained at: a safetensors
#: metadata key, a Hugging Face config.json key, the key of a torch file's
#: sidecar (:func:`training_sidecar`).
TRAINING_KEY = "dino_opt_training"

_HF_PREFIXES = (
    "embeddings.",
    "vit.embeddings.",
    "dinov2.embeddings.",
    "dinov2_with_registers.embeddings.",
)


@dataclass
class ExternalWeights:
    """Weights read by :func:`read_weights`: the ``format`` detected, the
    ``student`` and ``teacher`` networks as ``{"backbone": ..., "head": ...}``
    state dicts in dino_opt's keys (the same one twice for a backbone-only
    file; ``head`` None when the file has none), the ``backbone`` name
    (``"vit"`` for a ViT of no named size, ``"vit_dinov3"`` for a DINOv3
    ViT of none), its ``patch_size`` (ViTs), the loss's ``center`` of a
    training checkpoint, and for a ViT its ``arch`` (shapes, registers,
    LayerScale, FFN, biases, mask token; the heads and the position
    interpolation where the file says them): a :class:`ViTArch`, or a
    :class:`DinoV3Arch` for DINOv3's ViT (its size, options and RoPE); and
    the input the network was trained at, where a dino_opt run or export
    says it (``training``: ``image_size``, ``mean``, ``std``;
    :func:`training_input`), else None."""

    path: Path
    format: str
    student: dict
    teacher: dict
    backbone: str
    patch_size: int | None = None
    center: torch.Tensor | None = None
    arch: ViTArch | DinoV3Arch | None = None
    training: dict | None = None


class _Raw(NamedTuple):
    format: str
    student: dict
    teacher: dict
    center: torch.Tensor | None = None
    heads: int | None = None
    interpolation: tuple[float, bool] = (0.0, False)
    rope: RopeSpec | None = None
    training: dict | None = None


def sub_dict(state: dict, prefix: str) -> dict:
    """The entries of ``state`` under ``prefix``, the prefix removed."""
    return {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}


def training_input(cfg: Config) -> dict:
    """The input a run of ``cfg`` trains at: ``image_size``, the global
    crops' side (with crop-size pairs: the first pair's), the
    normalisation's ``mean`` and ``std`` (one per channel), and for images
    read at their stored depth the ``image_mode`` (``native``)."""
    d = cfg.data
    mean = list(d.mean) if d.mean is not None else list(IMAGENET_MEAN)
    std = list(d.std) if d.std is not None else list(IMAGENET_STD)
    out = {"image_size": int(cfg.augmentation.crop_size_pairs[0][0]), "mean": mean, "std": std}
    return out | ({"image_mode": d.image_mode} if d.image_mode != "rgb" else {})


def training_sidecar(path: Path) -> Path:
    """The JSON file beside a torch weights file that holds its training input."""
    return path.with_name(path.name + ".json")


def write_training_sidecar(path: Path, training: dict) -> None:
    """Writes ``training`` (:func:`training_input`) beside the torch weights file ``path``."""
    text = json.dumps({TRAINING_KEY: training}, indent=2) + "\n"
    atomic_write(training_sidecar(path), lambda f: f.write(text.encode()))


def _checked_training(value, where: str) -> dict | None:
    try:
        out = json.loads(value) if isinstance(value, str) else value
        size, mean, std = int(out["image_size"]), out["mean"], out["std"]
        mode = out.get("image_mode", "rgb")
        if size < 1 or not mean or len(mean) != len(std) or mode not in ("rgb", "native"):
            raise ValueError("out of range")
        checked = {"image_size": size, "mean": [float(v) for v in mean]}
        checked["std"] = [float(v) for v in std]
        return checked | ({"image_mode": mode} if mode != "rgb" else {})
    except (TypeError, KeyError, ValueError) as e:
        raise ValueError(f"{where}: its {TRAINING_KEY} record is not valid ({e})") from None


def _run_training(ckpt: dict, path: Path) -> dict | None:
    """The training input of a dino_opt checkpoint's config (None without one)."""
    if not isinstance(ckpt.get("config"), dict):
        return None
    try:
        return training_input(Config.from_dict(ckpt["config"]))
    except (ValueError, TypeError, AttributeError) as e:
        raise ValueError(f"checkpoint {str(path)!r}: its config is not valid: {e}") from e


def _json_object(path: Path) -> dict:
    """The JSON object in the file ``path`` (a Hugging Face folder's
    config.json or index); ValueError naming the file otherwise."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: holds a JSON {type(value).__name__}, not an object")
    return value


def _recorded_training(path: Path) -> dict | None:
    """The training input an export records: in a Hugging Face folder's
    config.json, a safetensors file's metadata or a torch file's sidecar."""
    if path.is_dir():
        config = path / "config.json"
        value = _json_object(config).get(TRAINING_KEY) if config.is_file() else None
        return None if value is None else _checked_training(value, str(config))
    if _is_safetensors(path):
        with safe_open(str(path), "pt") as f:
            value = (f.metadata() or {}).get(TRAINING_KEY)
        return None if value is None else _checked_training(value, str(path))
    sidecar = training_sidecar(path)
    if not sidecar.is_file():
        return None
    try:
        value = json.loads(sidecar.read_text()).get(TRAINING_KEY)
    except (ValueError, AttributeError) as e:
        raise ValueError(f"{sidecar}: not a JSON object ({e})") from None
    return None if value is None else _checked_training(value, str(sidecar))


def _torch_load(path: Path) -> dict:
    # The original DINO code pickles its argparse arguments into checkpoints.
    with torch.serialization.safe_globals([argparse.Namespace]):
        try:
            with open(path, "rb") as f:  # a file object: whatever its name, torch's format
                return torch.load(f, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - any unreadable file: one message naming it
            raise ValueError(f"{path}: not a weights file torch can read safely ({e})") from e


def read_state_dict(path: str | os.PathLike) -> dict:
    """The tensors of a state-dict file as they are stored (a safetensors
    file, or a torch file holding a state dict, or one under ``state_dict``
    or ``model``); ValueError naming the file otherwise."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such file")
    state = _read_safetensors(path)[0] if _is_safetensors(path) else _torch_load(path)
    for key in ("state_dict", "model"):
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            state = state[key]
    items = state.items() if isinstance(state, dict) else ()
    tensors = {k: v for k, v in items if torch.is_tensor(v)}
    if not tensors:
        raise ValueError(f"{path}: holds no state dict (a mapping of names to tensors)")
    return tensors


def _split(state: dict) -> dict:
    """``{"backbone", "head"}`` of a network's state dict (``module.`` and a
    backbone prefix stripped; a bare backbone gives no head; several
    students of a distillation: the first one's)."""
    state = {k.removeprefix("module."): v for k, v in state.items()}
    if state and next(iter(state)).startswith("members."):  # students of a distillation
        state = sub_dict(state, f"members.{next(iter(state)).split('.')[1]}.")  # the first's
    if any(k.startswith("backbone.") for k in state):
        head = sub_dict(state, "head.")
        return {"backbone": sub_dict(state, "backbone."), "head": head or None}
    return {"backbone": state, "head": None}


def _read_safetensors(path: Path) -> tuple[dict, dict]:
    """(tensors, metadata) of a safetensors file."""
    try:
        with safe_open(str(path), "pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}, f.metadata() or {}  # noqa: SIM118
    except Exception as e:  # noqa: BLE001 - any unreadable file: one message naming it
        raise ValueError(f"{path}: not a readable safetensors file ({e})") from e


def _is_safetensors(path: Path) -> bool:
    """A safetensors file starts with the little-endian length of its JSON
    header, then the header's ``{``; torch's files are zip archives (``PK``)."""
    with open(path, "rb") as f:
        head = f.read(9)
    size = int.from_bytes(head[:8], "little") if len(head) == 9 else 0
    return head[8:9] == b"{" and 0 < size <= path.stat().st_size - 8


def _hf_state(folder: Path) -> dict:
    """The tensors of a Hugging Face folder (one safetensors file, shards with
    an index, or an older ``pytorch_model.bin``)."""
    single, index = folder / "model.safetensors", folder / "model.safetensors.index.json"
    legacy = folder / "pytorch_model.bin"
    if not single.is_file() and not index.is_file() and legacy.is_file():
        return _torch_load(legacy)
    if single.is_file() or not index.is_file():
        return _read_safetensors(single)[0]
    weight_map = _json_object(index).get("weight_map")
    names = list(weight_map.values()) if isinstance(weight_map, dict) else None
    if not names or not all(isinstance(n, str) and n == Path(n).name for n in names):
        raise ValueError(f"{index}: its weight_map does not map tensor names to shard files here")
    shards = sorted(set(names))
    state: dict = {}
    for shard in shards:
        state |= _read_safetensors(folder / shard)[0]
    return state


def _hf_dinov3(sd: dict, config: dict) -> _Raw:
    """A Hugging Face DINOv3ViTModel state (renamed by :func:`_in_dinov3_keys`);
    the heads and RoPE base from its config."""
    net = {"backbone": sd, "head": None}
    rope = RopeSpec(float(config["rope_theta"])) if "rope_theta" in config else None
    return _Raw("hf", net, net, None, config.get("num_attention_heads"), rope=rope)


def _hf(sd: dict, config: dict | None = None) -> _Raw:
    """A Hugging Face ViTModel / Dinov2Model / Dinov2WithRegistersModel /
    DINOv3ViTModel state."""
    config = config or {}
    heads = config.get("num_attention_heads")
    if heads is not None and (not isinstance(heads, int) or isinstance(heads, bool) or heads < 1):
        raise ValueError(f"num_attention_heads is {heads!r}, not a positive int")
    if config.get("model_type") == "dinov3_vit" or dinov3_layout(sd) == "hf":
        return _hf_dinov3(sd, config)
    dinov2 = str(config.get("model_type", "")).startswith("dinov2") or any(
        "layer_scale1" in k for k in sd
    )
    net = {"backbone": from_hf_dinov2(sd) if dinov2 else from_hf_vit(sd), "head": None}
    registers = "register_tokens" in net["backbone"]
    # transformers resizes Dinov2's tables to the exact grid, anti-aliased with registers
    return _Raw("hf", net, net, None, config.get("num_attention_heads"), (0.0, registers))


def _backbone_state(sd: dict, container: str, heads: int | None = None) -> _Raw:
    """A bare ViT or ResNet backbone: DINOv2's layout (``mask_token``,
    ``register_tokens`` or chunked blocks), timm's (``reg_token``, a
    safetensors file, or DINOv2 features without a mask token) or DINO's."""
    if any(k.startswith(_HF_PREFIXES) for k in sd):
        return _hf(sd)
    net = _split(sd)
    bb = net["backbone"]
    if is_rope_vit(bb):  # DINOv3's (renamed by _in_dinov3_keys)
        return _Raw("timm" if container == "safetensors" else "dinov3", net, net, None, heads)
    if "cls_token" not in bb:  # a ResNet
        return _Raw("timm" if container == "safetensors" else "dino", net, net, None, heads)
    dinov2 = "mask_token" in bb or "register_tokens" in bb or is_chunked(bb)
    v2 = "reg_token" in bb or any(k.endswith((".ls1.gamma", ".mlp.w12.weight")) for k in bb)
    net = {**net, "backbone": from_timm(unchunk(bb))}
    if dinov2:
        # as DINOv2's hub builds its ViTs: offset 0.1, or anti-aliased with registers
        interp = (0.0, True) if "register_tokens" in bb else (0.1, False)
        return _Raw("dinov2", net, net, None, heads, interp)
    fmt = "timm" if container == "safetensors" or v2 else "dino"
    return _Raw(fmt, net, net, None, heads)


def _timm_kwargs(meta: dict, path: Path) -> dict:
    """The ``timm_kwargs`` an export records (what timm builds the model
    with): a JSON object whose ``num_heads`` is a positive int where given;
    ValueError naming the file otherwise (never guessed from the shapes)."""
    try:
        kwargs = json.loads(meta.get("timm_kwargs", "{}"))
    except ValueError as e:
        raise ValueError(f"{path}: its timm_kwargs metadata is not JSON ({e})") from None
    heads = kwargs.get("num_heads", 1) if isinstance(kwargs, dict) else None
    if not isinstance(heads, int) or isinstance(heads, bool) or heads < 1:
        raise ValueError(
            f"{path}: its timm_kwargs metadata {kwargs!r} is not an object with an int num_heads"
        )
    return kwargs


def _dino_opt_interp(ckpt: dict) -> tuple[float, bool]:
    model = (ckpt.get("config") or {}).get("model") or {}
    return (float(model.get("interpolate_offset") or 0.0), bool(model.get("interpolate_antialias")))


def _training_checkpoint(state: dict, path: Path) -> _Raw | None:
    """dino_opt's, DINO's main_dino.py's or DINOv2's training checkpoints."""
    if "student" in state and "teacher" in state:
        kind, loss = ("dino_opt", "loss") if "config" in state else ("dino-full", "dino_loss")
        center = (state.get(loss) or {}).get("center")
        return _Raw(
            kind,
            _split(state["student"]),
            _split(state["teacher"]),
            center,
            None,
            _dino_opt_interp(state),
            training=_run_training(state, path),
        )
    teacher = state.get("teacher")
    model = state.get("model")
    if isinstance(model, dict) and any(k.startswith("teacher.backbone.") for k in model):
        student = _split(sub_dict(model, "student."))
        return _Raw(
            "dinov2", student, _split(sub_dict(model, "teacher.")), None, None, (0.1, False)
        )
    if isinstance(teacher, dict) and any(k.startswith("backbone.") for k in teacher):
        net = _split(teacher)  # DINOv2's teacher_checkpoint.pth
        return _Raw("dinov2", net, net, None, None, (0.1, False))
    return None


def _read_raw(path: Path) -> _Raw:
    if path.is_dir() and (path / "config.json").is_file():
        config = _json_object(path / "config.json")
        state = _hf_state(path)
        try:
            return _hf(state, config)
        except (KeyError, TypeError, AttributeError, ValueError) as e:
            raise ValueError(
                f"{path / 'config.json'}: not a config this project reads with its weights "
                f"({type(e).__name__}: {e})"
            ) from None
    if path.is_dir():  # a dino_opt run folder or checkpoints/ folder
        ckpt = load_checkpoint(path, keys=("student", "teacher"))
        center = ckpt.get("loss", {}).get("center")
        return _Raw(
            "dino_opt",
            _split(ckpt["student"]),
            _split(ckpt["teacher"]),
            center,
            None,
            _dino_opt_interp(ckpt),
            training=_run_training(ckpt, path),
        )
    if _is_safetensors(path):
        sd, meta = _read_safetensors(path)
        kwargs = _timm_kwargs(meta, path)
        raw = _backbone_state(sd, "safetensors", kwargs.get("num_heads"))
        base = kwargs.get("rope_temperature")
        return raw._replace(rope=RopeSpec(float(base))) if base else raw
    state = _torch_load(path)
    if not isinstance(state, dict):
        raise ValueError(f"{path}: holds a {type(state).__name__}, not a state dict")
    return _training_checkpoint(state, path) or _backbone_state(state, "torch")


def _in_dinov3_keys(raw: _Raw) -> _Raw:
    """A DINOv3 backbone in DINOv3's own, timm's or Hugging Face's layout,
    renamed to dino_opt's keys (student and teacher); the heads and RoPE from
    DINOv3's periods."""
    bb = raw.teacher["backbone"]
    layout = dinov3_layout(bb)
    if layout is None:
        return raw
    heads, rope = raw.heads, raw.rope
    if "rope_embed.periods" in bb:
        heads, rope = rope_from_periods(bb["rope_embed.periods"], bb["cls_token"].shape[-1])
    fmt = raw.format if raw.format in ("dino_opt", "dino-full") else layout
    student, teacher = (
        {**net, "backbone": from_dinov3_layout(net["backbone"], layout)}
        for net in (raw.student, raw.teacher)
    )
    return raw._replace(format=fmt, student=student, teacher=teacher, heads=heads, rope=rope)


def _name(sd: dict, raw: _Raw) -> tuple[str, int | None, ViTArch | DinoV3Arch | None]:
    if is_rope_vit(sd):
        arch = dinov3_arch(sd, raw.heads, raw.rope)
        return arch.name or "vit_dinov3", arch.patch_size, arch
    if "cls_token" in sd:
        arch = vit_arch(sd, raw.heads)
        return arch.name or "vit", arch.patch_size, arch
    if "layer4.0.conv1.weight" in sd:
        return ("resnet50" if "layer1.0.conv3.weight" in sd else "resnet18"), None, None
    raise ValueError(f"the weights are neither a ViT nor a ResNet (keys {sorted(sd)[:4]} ...)")


def read_weights(path: str | os.PathLike) -> ExternalWeights:
    """Weights from a timm file, a Hugging Face folder or file (ViT, Dinov2,
    Dinov2 with registers, DINOv3), an original DINO, DINOv2 or DINOv3
    backbone or training checkpoint, or a dino_opt checkpoint or run folder,
    detected from the content (see the module docstring), in dino_opt's keys;
    or any of those by name (:mod:`~dino_opt.weights.load.hub`: ``dinov2_vits14``,
    ``hf:ORG/NAME``, ``timm:NAME``), from its library's cache."""
    path = weights_location(path)
    if not path.exists():
        raise FileNotFoundError(f"weights {str(path)!r} do not exist")
    try:
        raw = _read_raw(path)
    except (KeyError, TypeError, AttributeError, IndexError) as e:  # a malformed file's contents
        raise ValueError(f"{path}: cannot be read as weights ({type(e).__name__}: {e})") from None
    if not raw.teacher["backbone"]:
        raise ValueError(f"{path}: holds no backbone weights")
    try:
        raw = _in_dinov3_keys(raw)
        name, patch, arch = _name(raw.teacher["backbone"], raw)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    if isinstance(arch, ViTArch):
        offset, antialias = raw.interpolation
        arch = arch.replace(interpolate_offset=offset, interpolate_antialias=antialias)
    return ExternalWeights(
        path,
        raw.format,
        raw.student,
        raw.teacher,
        name,
        patch,
        raw.center,
        arch,
        raw.training or _recorded_training(path),
    )
