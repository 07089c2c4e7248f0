"""Key layouts of DINOv3's ViT weights, and the architecture a state dict holds.

dino_opt's DINOv3 keys are :class:`~dino_opt.models.DinoV3VisionTransformer`'s:
DINOv2's ViT keys without a position table (``cls_token``,
``register_tokens``, ``mask_token``, ``patch_embed.proj``, ``blocks.{i}.norm1 /
attn.qkv`` (its weight, and ``q_bias`` / ``v_bias`` under the masked key bias
or a plain ``bias``) ``/ attn.proj / ls1.gamma / norm2 / mlp.fc1 / mlp.fc2``
(or ``mlp.w12 / mlp.w3``) ``/ ls2.gamma``, ``norm``, ``cls_norm``,
``local_cls_norm``). A ViT state dict with a class token and no position
table is a DINOv3 (RoPE) one. This module maps them to and from:

- DINOv3's own checkpoints: ``storage_tokens``, a qkv bias of all three
  parts with its ``bias_mask`` (the key part masked to zero), the SwiGLU as
  ``w1`` / ``w2`` / ``w3``, the RoPE's ``rope_embed.periods`` (which give
  the heads and the RoPE's base or period range) and always a mask token;
- timm's port (``vit_*_patch16_dinov3``, an ``Eva``): ``reg_token``,
  ``gamma_1`` / ``gamma_2``, ``attn.q_bias`` / ``attn.v_bias``, the SwiGLU as
  ``fc1_g`` / ``fc1_x`` / ``fc2``, no mask token, biases in every output
  projection and feed-forward layer;
- Hugging Face's ``DINOv3ViTModel`` in the layout of the published
  checkpoints (what ``save_pretrained`` writes: ``embeddings.*``,
  ``layer.{i}.attention.q_proj / k_proj / v_proj / o_proj``,
  ``layer_scale{1,2}.lambda1``, ``mlp.up_proj / down_proj`` or ``mlp.gate_proj
  / up_proj / down_proj``, ``norm``); reading also takes transformers 5's
  module names (``model.layer.{i}``).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ...models.rope import rope_periods
from ...models.vit_dinov3 import (
    DINOV3_FFN_LAYERS,
    DINOV3_SIZES,
    DinoV3VisionTransformer,
    convert_dinov3_state_dict,
    convert_timm_dinov3_state_dict,
    dinov3_swiglu_hidden_dim,
)
from .vit import _first, _in_blocks, _zero_biases

__all__ = [
    "DinoV3Arch",
    "RopeSpec",
    "dinov3_arch",
    "dinov3_layout",
    "dinov3_load",
    "export_notes",
    "from_dinov3_layout",
    "from_hf_dinov3",
    "hf_dinov3_config",
    "is_rope_vit",
    "module_arch",
    "rope_from_periods",
    "timm_dinov3_model",
    "to_dinov3",
    "to_hf_dinov3",
    "to_timm_dinov3",
    "unsupported",
]

_PARAMETERS = inspect.signature(DinoV3VisionTransformer).parameters
_DEFAULTS = {name: p.default for name, p in _PARAMETERS.items()}
_SHOWN_ELSEWHERE = (
    "img_size",
    "patch_size",
    "embed_dim",
    "depth",
    "ffn_ratio",
    "ffn_layer",
    "use_mask_token",
)
_TIMM_SIZES = {
    "vit_small_dinov3": "small",
    "vit_small_plus_dinov3": "small_plus",
    "vit_base_dinov3": "base",
    "vit_large_dinov3": "large",
    "vit_huge_plus_dinov3": "huge_plus",
    "vit_7b_dinov3": "7b",
}
_NORM_EPS = 1e-5  # DINOv3's LayerNorm epsilon, the same in every size


class RopeSpec(NamedTuple):
    """A RoPE's periods (``base``, or ``min_period`` to ``max_period``) and
    how it normalises patch coordinates (DINOv3's default: base 100, separate)."""

    base: float | None = 100.0
    min_period: float | None = None
    max_period: float | None = None
    normalize_coords: str = "separate"

    def describe(self) -> str:
        if self.base is not None:
            periods = f"base {self.base:g}"
        else:
            periods = f"periods {self.min_period:g} to {self.max_period:g}"
        return f"{periods}, {self.normalize_coords} coordinates"

    def periods(self, head_dim: int) -> torch.Tensor:
        """The ``head_dim / 4`` periods, float32 (as DINOv3's files hold them)."""
        return rope_periods(head_dim, self.base, self.min_period, self.max_period)


def _size_ffn(size: dict) -> tuple[bool, int]:
    """(SwiGLU, hidden width) of a DINOv3 size."""
    width, align = int(size["embed_dim"] * size["ffn_ratio"]), DINOV3_FFN_LAYERS[size["ffn_layer"]]
    return (True, dinov3_swiglu_hidden_dim(width, align)) if align else (False, width)


@dataclass(frozen=True)
class DinoV3Arch:
    """What a DINOv3 state dict holds (shapes and which parameters exist),
    the heads and RoPE where the file says them (None: unknown, the named
    size's heads and DINOv3's RoPE assumed) and the nominal image side."""

    embed_dim: int
    depth: int
    patch_size: int
    mlp_hidden: int
    swiglu: bool = False
    n_storage_tokens: int = 4
    layerscale: bool = True
    qkv_bias: bool = True
    mask_k_bias: bool = True
    proj_bias: bool = True
    ffn_bias: bool = True
    mask_token: bool = False
    untie_cls_and_patch_norms: bool = False
    untie_global_and_local_cls_norm: bool = False
    num_heads: int | None = None
    rope: RopeSpec | None = None
    img_size: int = 224
    in_chans: int = 3  # the images' channels (the patch embedding's input)

    @property
    def name(self) -> str | None:
        """The ``vit_*_dinov3`` size of this width, depth and FFN, or None."""
        for name, size in DINOV3_SIZES.items():
            if (size["embed_dim"], size["depth"]) == (self.embed_dim, self.depth) and _size_ffn(
                size
            ) == (self.swiglu, self.mlp_hidden):
                return name
        return None

    @property
    def heads(self) -> int:
        """The heads: as given, else the named size's, else 64 channels each."""
        if self.num_heads:
            return self.num_heads
        return DINOV3_SIZES[self.name]["num_heads"] if self.name else max(1, self.embed_dim // 64)

    @property
    def rope_spec(self) -> RopeSpec:
        return self.rope or RopeSpec()

    @property
    def masked_qkv_bias(self) -> bool:
        """Learned query and value biases, the key's held at zero."""
        return self.qkv_bias and self.mask_k_bias

    @property
    def ffn(self) -> tuple[float, str]:
        """``(ffn_ratio, ffn_layer)`` that give ``mlp_hidden``."""
        if self.name:
            size = DINOV3_SIZES[self.name]
            return size["ffn_ratio"], size["ffn_layer"]
        dim, hidden = self.embed_dim, self.mlp_hidden
        width = math.ceil(hidden * 1.5) if self.swiglu else hidden
        ratio = width / dim if int(dim * (width / dim)) == width else (width + 0.5) / dim
        if not self.swiglu:
            return ratio, "mlp"
        for layer, align in DINOV3_FFN_LAYERS.items():
            if align and dinov3_swiglu_hidden_dim(int(dim * ratio), align) == hidden:
                return ratio, layer
        raise ValueError(f"a SwiGLU of width {hidden} is not one DINOv3's rule gives")

    def model_kwargs(self) -> dict:
        """:class:`~dino_opt.models.DinoV3VisionTransformer` keywords of this architecture."""
        (ratio, layer), rope = self.ffn, self.rope_spec
        return dict(
            img_size=self.img_size,
            patch_size=self.patch_size,
            embed_dim=self.embed_dim,
            depth=self.depth,
            num_heads=self.heads,
            ffn_ratio=ratio,
            qkv_bias=self.qkv_bias,
            proj_bias=self.proj_bias,
            ffn_bias=self.ffn_bias,
            ffn_layer=layer,
            layerscale_init=1e-5 if self.layerscale else None,
            n_storage_tokens=self.n_storage_tokens,
            mask_k_bias=self.mask_k_bias,
            untie_cls_and_patch_norms=self.untie_cls_and_patch_norms,
            untie_global_and_local_cls_norm=self.untie_global_and_local_cls_norm,
            use_mask_token=self.mask_token,
            pos_embed_rope_base=rope.base,
            pos_embed_rope_min_period=rope.min_period,
            pos_embed_rope_max_period=rope.max_period,
            pos_embed_rope_normalize_coords=rope.normalize_coords,
            in_chans=self.in_chans,
        )

    def options(self) -> dict:
        """The keywords of :meth:`model_kwargs` that differ from the named
        size's builder (from DinoV3VisionTransformer's defaults without a name;
        the shape and patch size left out)."""
        defaults = _DEFAULTS | DINOV3_SIZES.get(self.name or "", {})
        return {
            k: v
            for k, v in self.model_kwargs().items()
            if k not in _SHOWN_ELSEWHERE
            and v != defaults.get(k)
            and not (k == "num_heads" and not self.name)
        }

    def shape(self) -> tuple:
        """What must agree between weights and a model (the rest is adapted)."""
        return (
            self.embed_dim,
            self.depth,
            self.patch_size,
            self.swiglu,
            self.mlp_hidden,
            self.n_storage_tokens,
            self.untie_cls_and_patch_norms,
        )

    def describe(self) -> str:
        if self.name:
            size = f"a {self.name}"
        else:
            ffn = f"SwiGLU {self.mlp_hidden}" if self.swiglu else f"MLP {self.mlp_hidden}"
            size = f"a DINOv3 ViT of width {self.embed_dim}, depth {self.depth}, {ffn} wide"
        options = ", ".join(f"{k}={v}" for k, v in self.options().items())
        return f"{size} with patch {self.patch_size}" + (f" ({options})" if options else "")

    def replace(self, **changes) -> DinoV3Arch:
        return dataclasses.replace(self, **changes)


def is_rope_vit(sd: dict) -> bool:
    """A ViT state dict with a class token and no position table: DINOv3's (RoPE)."""
    return "cls_token" in sd and "pos_embed" not in sd


def dinov3_arch(
    sd: dict, num_heads: int | None = None, rope: RopeSpec | None = None, img_size: int = 224
) -> DinoV3Arch:
    """The architecture of a DINOv3 state dict in dino_opt's keys."""
    for key in ("cls_token", "patch_embed.proj.weight"):
        if key not in sd:
            raise ValueError(f"a DINOv3 state dict without {key!r} (keys {sorted(sd)[:6]} ...)")
    swiglu = _in_blocks(sd, ".mlp.w12.weight")
    hidden = (
        _first(sd, ".mlp.w3.weight").shape[1] if swiglu else _first(sd, ".mlp.fc1.weight").shape[0]
    )
    regs, masked = sd.get("register_tokens"), _in_blocks(sd, ".attn.qkv.q_bias")
    qkv_bias = masked or _in_blocks(sd, ".attn.qkv.bias")
    return DinoV3Arch(
        embed_dim=sd["cls_token"].shape[-1],
        depth=len({k.split(".")[1] for k in sd if k.startswith("blocks.")}),
        patch_size=sd["patch_embed.proj.weight"].shape[-1],
        mlp_hidden=hidden,
        swiglu=swiglu,
        n_storage_tokens=0 if regs is None else regs.shape[1],
        layerscale=_in_blocks(sd, ".ls1.gamma"),
        qkv_bias=qkv_bias,
        mask_k_bias=masked or not qkv_bias,
        proj_bias=_in_blocks(sd, ".attn.proj.bias"),
        ffn_bias=_in_blocks(sd, ".mlp.w12.bias" if swiglu else ".mlp.fc1.bias"),
        mask_token="mask_token" in sd,
        untie_cls_and_patch_norms="cls_norm.weight" in sd,
        untie_global_and_local_cls_norm="local_cls_norm.weight" in sd,
        num_heads=num_heads,
        rope=rope,
        img_size=img_size,
        in_chans=sd["patch_embed.proj.weight"].shape[1],
    )


def module_arch(model: DinoV3VisionTransformer, sd: dict | None = None) -> DinoV3Arch:
    """The architecture of a DINOv3 module: its state (or ``sd``), heads and RoPE."""
    r = model.rope_embed
    rope = RopeSpec(r.base, r.min_period, r.max_period, r.normalize_coords)
    return dinov3_arch(
        model.state_dict() if sd is None else sd, model.num_heads, rope, model.img_size
    )


def _sig(x: float) -> float:
    return float(f"{x:.6g}")


def rope_from_periods(periods: torch.Tensor, embed_dim: int) -> tuple[int, RopeSpec]:
    """The heads and RoPE of DINOv3's ``rope_embed.periods`` (``head_dim / 4``
    of them): base 100, another base, or a period range, whichever gives
    them (to the precision they are stored in)."""
    p = periods.detach().double().flatten()
    head_dim, n = 4 * len(p), len(p)
    if not n or embed_dim % head_dim:
        raise ValueError(
            f"{n} RoPE periods do not fit a width of {embed_dim} (heads of {head_dim} channels)"
        )
    candidates = [RopeSpec()]
    if n > 1 and p[-1] > 0:
        candidates.append(RopeSpec(_sig(float(p[-1]) ** (head_dim / (4 * (n - 1))))))
    if p[0] > 0:
        candidates.append(RopeSpec(None, _sig(float(p[0])), _sig(float(p[-1]))))
    rtol = 1e-2 if periods.dtype in (torch.bfloat16, torch.float16) else 1e-5
    for spec in candidates:
        want = rope_periods(head_dim, *spec[:3], dtype=torch.float64)
        if torch.allclose(want, p, rtol=rtol, atol=0):
            return embed_dim // head_dim, spec
    raise ValueError(
        f"RoPE periods {[round(float(x), 4) for x in p[:4]]} ... follow neither "
        "a base nor a period range"
    )


# ---------------------------------------------------------------- reading


_TIMM_MARKS = (".gamma_1", ".attn.q_bias", ".mlp.fc1_g.weight")


def dinov3_layout(sd: dict) -> str | None:
    """The layout of a DINOv3 backbone state dict: ``dinov3`` (DINOv3's own),
    ``timm``, ``hf``, or None (dino_opt's keys, or not a DINOv3 backbone)."""
    if "embeddings.patch_embeddings.weight" in sd:
        return "hf"
    if not is_rope_vit(sd):
        return None
    if (
        "storage_tokens" in sd
        or "rope_embed.periods" in sd
        or _in_blocks(sd, ".mlp.w1.weight")
        or any(k.endswith(".bias_mask") for k in sd)
    ):
        return "dinov3"
    if "reg_token" in sd or any(k.startswith("rope.") or k.endswith(_TIMM_MARKS) for k in sd):
        return "timm"
    return None


def from_dinov3_layout(sd: dict, layout: str | None) -> dict:
    """A DINOv3 backbone of ``layout`` (see :func:`dinov3_layout`) in dino_opt's
    keys; a missing entry is a ValueError naming it."""
    convert = {
        "dinov3": convert_dinov3_state_dict,
        "timm": convert_timm_dinov3_state_dict,
        "hf": from_hf_dinov3,
    }.get(layout, dict)
    try:
        return convert(sd)
    except KeyError as e:
        raise ValueError(f"a {layout} DINOv3 state dict without {e.args[0]!r}") from None


# ---------------------------------------------------------------- DINOv3's own


_TOKENS = ("cls_token", "register_tokens", "mask_token")


def to_dinov3(sd: dict, arch: DinoV3Arch) -> dict:
    """dino_opt's DINOv3 keys -> DINOv3's own (what its DinoVisionTransformer
    loads strictly): storage tokens, a mask token (zero where ours has none),
    the RoPE's periods, the masked qkv bias with its mask, SwiGLU's w1 / w2."""
    cls = sd["cls_token"]
    out = {
        "cls_token": cls,
        "storage_tokens": sd.get("register_tokens"),
        "mask_token": sd.get("mask_token", cls.new_zeros(1, arch.embed_dim)),
        "rope_embed.periods": arch.rope_spec.periods(arch.embed_dim // arch.heads),
    }
    out = {k: v for k, v in out.items() if v is not None}
    for key, value in sd.items():
        if key.endswith("qkv.q_bias"):
            stem, v_bias = key.removesuffix("q_bias"), sd[key.replace("q_bias", "v_bias")]
            zero, one = torch.zeros_like(value), torch.ones_like(value)
            out[stem + "bias"] = torch.cat((value, zero, v_bias))
            out[stem + "bias_mask"] = torch.cat((one, zero, one))
        elif ".mlp.w12." in key:
            out[key.replace("w12", "w1")], out[key.replace("w12", "w2")] = value.chunk(2)
        elif key not in _TOKENS and not key.endswith("qkv.v_bias"):
            out[key] = value
    return {k: v.contiguous() for k, v in out.items()}


def dinov3_load(arch: DinoV3Arch, image_size: int) -> str:
    """How DINOv3's code builds and loads ``arch`` (its LayerNorm of eps 1e-5
    is ``layernormbf16``)."""
    (ratio, layer), rope = arch.ffn, arch.rope_spec
    kwargs = dict(
        img_size=image_size,
        patch_size=arch.patch_size,
        pos_embed_rope_base=rope.base,
        pos_embed_rope_min_period=rope.min_period,
        pos_embed_rope_max_period=rope.max_period,
        pos_embed_rope_normalize_coords=rope.normalize_coords,
        pos_embed_rope_dtype="fp32",
        embed_dim=arch.embed_dim,
        depth=arch.depth,
        num_heads=arch.heads,
        ffn_ratio=ratio,
        qkv_bias=arch.qkv_bias,
        layerscale_init=1e-5 if arch.layerscale else None,
        norm_layer="layernormbf16",
        ffn_layer=layer,
        ffn_bias=arch.ffn_bias,
        proj_bias=arch.proj_bias,
        n_storage_tokens=arch.n_storage_tokens,
        mask_k_bias=arch.masked_qkv_bias,
        untie_cls_and_patch_norms=arch.untie_cls_and_patch_norms,
        untie_global_and_local_cls_norm=arch.untie_global_and_local_cls_norm,
    )
    args = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
    return (
        f"dinov3.models.vision_transformer.DinoVisionTransformer({args}).load_state_dict("
        "torch.load(path), strict=True)"
    )


# ---------------------------------------------------------------- timm and Hugging Face


def unsupported(arch: DinoV3Arch) -> list[str]:
    """What of ``arch`` timm's and Hugging Face's DINOv3 models cannot hold."""
    rope, parts = arch.rope_spec, []
    if rope.base is None:
        parts.append(
            f"RoPE periods from {rope.min_period:g} to {rope.max_period:g} (they take a base)"
        )
    if rope.normalize_coords != "separate":
        parts.append(f"RoPE coordinates normalised by the {rope.normalize_coords} side")
    if arch.untie_cls_and_patch_norms:
        parts.append("a final norm of its own for the class token (untie_cls_and_patch_norms)")
    return parts


def export_notes(arch: DinoV3Arch, fmt: str) -> list[str]:
    """What an export to ``fmt`` leaves out or adds."""
    notes = []
    if arch.untie_global_and_local_cls_norm and fmt != "dinov3":
        notes.append("the local crops' class norm left out (used in training only)")
    if arch.mask_token and fmt == "timm":
        notes.append("the mask token left out (timm's model has none)")
    if not arch.mask_token and fmt != "timm":
        notes.append("a mask token of zero added (the target always has one)")
    if not arch.layerscale and fmt != "dinov3":
        notes.append("a LayerScale of 1 added (the target always has one; the same function)")
    if not (arch.proj_bias and arch.ffn_bias) and fmt == "timm":
        notes.append("zero biases added (timm's model has them all; the same function)")
    return notes


def _unmasked_key_bias(sd: dict, arch: DinoV3Arch) -> dict:
    """A plain qkv bias as query and value biases (its key part must be zero)."""
    if not arch.qkv_bias or arch.mask_k_bias:
        return sd
    out = dict(sd)
    for i in range(arch.depth):
        stem = f"blocks.{i}.attn.qkv."
        q, k, v = out.pop(stem + "bias").chunk(3)
        if k.any():
            raise ValueError(
                "timm's DINOv3 ViT holds no key bias; this one has a nonzero one "
                "(mask_k_bias=False): --format hf or dinov3 writes it"
            )
        out[stem + "q_bias"], out[stem + "v_bias"] = q, v
    return out


_TIMM_NAMES = (
    ("register_tokens", "reg_token"),
    (".ls1.gamma", ".gamma_1"),
    (".ls2.gamma", ".gamma_2"),
    (".attn.qkv.q_bias", ".attn.q_bias"),
    (".attn.qkv.v_bias", ".attn.v_bias"),
    (".mlp.w3.", ".mlp.fc2."),
)


def to_timm_dinov3(sd: dict, arch: DinoV3Arch) -> dict:
    """dino_opt's DINOv3 keys -> timm's ``vit_*_patch16_dinov3`` (see
    :func:`timm_dinov3_model`): no mask token or local-crop class norm; a
    LayerScale of 1 and zero biases where ours have none (timm's builders
    have them all)."""
    ffn = ["mlp.w12", "mlp.w3"] if arch.swiglu else ["mlp.fc1", "mlp.fc2"]
    sd = _zero_biases(_unmasked_key_bias(sd, arch), arch, ["attn.proj", *ffn])
    ones = sd["norm.weight"].new_ones(arch.embed_dim)
    sd = {f"blocks.{i}.ls{n}.gamma": ones.clone() for i in range(arch.depth) for n in (1, 2)} | sd
    out = {}
    for key, value in sd.items():
        if key == "mask_token" or key.startswith("local_cls_norm."):
            continue
        if ".mlp.w12." in key:
            out[key.replace("w12", "fc1_g")], out[key.replace("w12", "fc1_x")] = value.chunk(2)
            continue
        for ours, theirs in _TIMM_NAMES:
            key = key.replace(ours, theirs)
        out[key] = value
    return {k: v.contiguous() for k, v in out.items()}


def _timm_shape(arch: DinoV3Arch) -> dict:
    """timm keywords of ``arch``'s shape (its FFN width is ``int(dim * mlp_ratio)``)."""
    dim, hidden = arch.embed_dim, arch.mlp_hidden
    ratio = hidden / dim if int(dim * (hidden / dim)) == hidden else (hidden + 0.5) / dim
    kwargs = dict(embed_dim=dim, depth=arch.depth, num_heads=arch.heads, mlp_ratio=ratio)
    if arch.swiglu:
        kwargs |= {"swiglu_mlp": True, "swiglu_align_to": 8 if hidden % 8 == 0 else 1}
    return kwargs


def timm_dinov3_model(arch: DinoV3Arch, image_size: int) -> tuple[str, dict]:
    """The timm model name and keywords that build ``arch``: the size's
    ``vit_*_patch16_dinov3`` (``_qkvb`` with a qkv bias), ViT-B's reshaped by
    keywords for other shapes; class-token pooling, no classifier."""
    size = _TIMM_SIZES.get(arch.name or "")
    kwargs: dict = {"num_classes": 0, "global_pool": "token"}
    if size is None or arch.heads != DINOV3_SIZES[arch.name]["num_heads"]:
        size, kwargs = "base", kwargs | _timm_shape(arch)
    qkvb = "_qkvb" if arch.qkv_bias and size != "7b" else ""
    changes = {
        "qkv_bias": (size == "7b" and arch.qkv_bias, True),
        "num_reg_tokens": (arch.n_storage_tokens != 4, arch.n_storage_tokens),
        "patch_size": (arch.patch_size != 16, arch.patch_size),
        "img_size": (image_size != 224, image_size),
        "rope_temperature": (arch.rope_spec.base != 100, arch.rope_spec.base),
        "in_chans": (arch.in_chans != 3, arch.in_chans),
    }
    kwargs |= {k: v for k, (changed, v) in changes.items() if changed}
    return f"vit_{size}_patch16_dinov3{qkvb}", kwargs


def _hf_block_pairs(swiglu: bool) -> list[tuple[str, str]]:
    """(dino_opt, Hugging Face) names of a block's layers renamed one to one."""
    ffn = (
        [("mlp.w3", "mlp.down_proj")]
        if swiglu
        else [("mlp.fc1", "mlp.up_proj"), ("mlp.fc2", "mlp.down_proj")]
    )
    return [("norm1", "norm1"), ("norm2", "norm2"), ("attn.proj", "attention.o_proj"), *ffn]


def _to_hf_block(sd: dict, b: str, h: str, arch: DinoV3Arch) -> dict:
    out = {}
    weights = sd[f"{b}attn.qkv.weight"].chunk(3)
    if arch.masked_qkv_bias:
        biases = (sd[f"{b}attn.qkv.q_bias"], None, sd[f"{b}attn.qkv.v_bias"])
    else:
        biases = sd[f"{b}attn.qkv.bias"].chunk(3) if arch.qkv_bias else (None,) * 3
    for p, w, bias in zip("qkv", weights, biases, strict=True):
        out[f"{h}attention.{p}_proj.weight"] = w
        if bias is not None:
            out[f"{h}attention.{p}_proj.bias"] = bias
    for ours, theirs in _hf_block_pairs(arch.swiglu):
        out |= {
            f"{h}{theirs}.{k}": sd[f"{b}{ours}.{k}"]
            for k in ("weight", "bias")
            if f"{b}{ours}.{k}" in sd
        }
    if arch.swiglu:
        for k in ("weight", "bias") if arch.ffn_bias else ("weight",):
            gate, up = sd[f"{b}mlp.w12.{k}"].chunk(2)
            out |= {f"{h}mlp.gate_proj.{k}": gate, f"{h}mlp.up_proj.{k}": up}
    ones = sd["norm.weight"].new_ones(arch.embed_dim)
    for n in (1, 2):
        out[f"{h}layer_scale{n}.lambda1"] = sd.get(f"{b}ls{n}.gamma", ones.clone())
    return out


def to_hf_dinov3(sd: dict, arch: DinoV3Arch) -> dict:
    """dino_opt's DINOv3 keys -> the published DINOv3ViTModel keys. It always
    has LayerScale (1 where ours has none), register tokens (none: an empty
    table) and a mask token (zero where ours has none)."""
    cls, dim = sd["cls_token"], arch.embed_dim
    out = {
        "embeddings.cls_token": cls,
        "embeddings.mask_token": sd.get("mask_token", cls.new_zeros(1, dim)).reshape(1, 1, dim),
        "embeddings.register_tokens": sd.get("register_tokens", cls.new_zeros(1, 0, dim)),
        "embeddings.patch_embeddings.weight": sd["patch_embed.proj.weight"],
        "embeddings.patch_embeddings.bias": sd["patch_embed.proj.bias"],
        "norm.weight": sd["norm.weight"],
        "norm.bias": sd["norm.bias"],
    }
    for i in range(arch.depth):
        out |= _to_hf_block(sd, f"blocks.{i}.", f"layer.{i}.", arch)
    return {k: v.contiguous() for k, v in out.items()}


def _from_hf_attention(sd: dict, h: str, b: str) -> dict:
    a = f"{h}attention."
    out = {f"{b}attn.qkv.weight": torch.cat([sd[f"{a}{p}_proj.weight"] for p in "qkv"])}
    biases = {p: sd.get(f"{a}{p}_proj.bias") for p in "qkv"}
    some = next((v for v in biases.values() if v is not None), None)
    if some is None:
        return out
    q, k, v = (biases[p] if biases[p] is not None else torch.zeros_like(some) for p in "qkv")
    if biases["k"] is not None:  # a learned key bias: a plain qkv bias
        return out | {f"{b}attn.qkv.bias": torch.cat((q, k, v))}
    return out | {f"{b}attn.qkv.q_bias": q, f"{b}attn.qkv.v_bias": v}


def _from_hf_block(sd: dict, h: str, b: str) -> dict:
    out = _from_hf_attention(sd, h, b)
    swiglu = f"{h}mlp.gate_proj.weight" in sd
    for ours, theirs in _hf_block_pairs(swiglu):
        out |= {
            f"{b}{ours}.{k}": sd[f"{h}{theirs}.{k}"]
            for k in ("weight", "bias")
            if f"{h}{theirs}.{k}" in sd or k == "weight"
        }
    if swiglu:
        for k in ("weight", "bias"):
            if f"{h}mlp.gate_proj.{k}" in sd or k == "weight":
                gate, up = sd[f"{h}mlp.gate_proj.{k}"], sd[f"{h}mlp.up_proj.{k}"]
                out[f"{b}mlp.w12.{k}"] = torch.cat((gate, up))
    for n in (1, 2):
        out[f"{b}ls{n}.gamma"] = sd[f"{h}layer_scale{n}.lambda1"]
    return out


def from_hf_dinov3(sd: dict) -> dict:
    """DINOv3ViTModel keys (published or transformers 5 names) -> dino_opt's.
    Its always-present register table and mask token are kept where they hold
    something (an empty register table goes)."""
    sd = {k.removeprefix("model."): v for k, v in sd.items()}
    emb = "embeddings."
    out = {
        "cls_token": sd[emb + "cls_token"],
        "patch_embed.proj.weight": sd[emb + "patch_embeddings.weight"],
        "patch_embed.proj.bias": sd[emb + "patch_embeddings.bias"],
        "norm.weight": sd["norm.weight"],
        "norm.bias": sd["norm.bias"],
    }
    regs = sd.get(emb + "register_tokens")
    if regs is not None and regs.shape[1]:
        out["register_tokens"] = regs
    if emb + "mask_token" in sd:
        out["mask_token"] = sd[emb + "mask_token"].reshape(1, -1)
    depth = len({k.split(".")[1] for k in sd if k.startswith("layer.")})
    for i in range(depth):
        out |= _from_hf_block(sd, f"layer.{i}.", f"blocks.{i}.")
    return out


def hf_dinov3_config(arch: DinoV3Arch, image_size: int) -> dict:
    """config.json of the DINOv3ViTModel (no training-time RoPE augmentation)."""
    return {
        "architectures": ["DINOv3ViTModel"],
        "model_type": "dinov3_vit",
        "hidden_size": arch.embed_dim,
        "num_hidden_layers": arch.depth,
        "num_attention_heads": arch.heads,
        "intermediate_size": arch.mlp_hidden,
        "hidden_act": "silu" if arch.swiglu else "gelu",
        "use_gated_mlp": arch.swiglu,
        "layer_norm_eps": _NORM_EPS,
        "rope_theta": arch.rope_spec.base,
        "image_size": image_size,
        "patch_size": arch.patch_size,
        "num_channels": arch.in_chans,
        "query_bias": arch.qkv_bias,
        "key_bias": arch.qkv_bias and not arch.mask_k_bias,
        "value_bias": arch.qkv_bias,
        "proj_bias": arch.proj_bias,
        "mlp_bias": arch.ffn_bias,
        "layerscale_value": 1.0,
        "num_register_tokens": arch.n_storage_tokens,
        "attention_dropout": 0.0,
        "drop_path_rate": 0.0,
        "initializer_range": 0.02,
        "pos_embed_shift": None,
        "pos_embed_jitter": None,
        "pos_embed_rescale": None,
    }
