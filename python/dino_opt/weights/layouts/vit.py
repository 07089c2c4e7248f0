"""Key layouts of ViT weights, and the architecture a state dict holds.

dino_opt's ViT keys are DINO's and DINOv2's own (``cls_token``,
``pos_embed``, ``register_tokens``, ``mask_token``, ``patch_embed.proj``,
``blocks.{i}.norm1 / attn.qkv / attn.proj / ls1.gamma / norm2 / mlp.fc1 /
mlp.fc2 (or mlp.w12 / mlp.w3) / ls2.gamma``, ``norm``). This module maps
them to and from:

- DINOv2's chunked blocks (``blocks.{chunk}.{i}.``, ``block_chunks > 0``);
- timm's ``VisionTransformer``: the same names, with ``reg_token`` for the
  registers, the SwiGLU as ``mlp.fc1`` / ``mlp.fc2`` (timm's packed GLU), no
  mask token, and in its register models (``no_embed_class``) no position
  entry for the CLS token (folded into ``cls_token``, as timm converts
  DINOv2's checkpoints);
- Hugging Face's ``ViTModel`` (DINO) and ``Dinov2Model`` /
  ``Dinov2WithRegistersModel`` in the layout of the published checkpoints
  (what ``save_pretrained`` writes: ``attention.attention.query / key /
  value``, ``attention.output.dense``, ``layer_scale{1,2}.lambda1``,
  ``mlp.fc1 / fc2`` or ``mlp.weights_in / weights_out``); reading also takes
  the module names of transformers 5 (``q_proj``, ``o_proj``,
  ``gate_proj`` / ``up_proj`` / ``down_proj``).
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass

import torch

from ...models.layers import swiglu_hidden_dim
from ...models.vit import pos_embed_grid

__all__ = [
    "DINOV2_NATIVE",
    "DINO_IMAGE_SIZE",
    "VIT_SIZES",
    "ViTArch",
    "from_hf_dinov2",
    "from_hf_vit",
    "from_timm",
    "hf_dinov2_config",
    "hf_vit_config",
    "is_chunked",
    "to_hf_dinov2",
    "to_hf_vit",
    "to_timm",
    "timm_model",
    "unchunk",
    "vit_arch",
]

#: The input size of DINO's position tables (and of a ResNet's evaluation).
DINO_IMAGE_SIZE = 224

#: (width, depth) -> (name, heads) of the ViTs dino_opt builds.
VIT_SIZES = {
    (192, 12): ("vit_tiny", 3),
    (384, 12): ("vit_small", 6),
    (768, 12): ("vit_base", 12),
    (1024, 24): ("vit_large", 16),
    (1536, 40): ("vit_giant2", 24),
}
DINOV2_NATIVE = 518  # the input size of the published DINOv2 position tables
_TIMM_V1 = {
    "vit_tiny_patch16_224",
    "vit_small_patch16_224",
    "vit_small_patch8_224",
    "vit_base_patch16_224",
    "vit_base_patch8_224",
    "vit_large_patch16_224",
}
_TIMM_V2 = {"vit_small": "small", "vit_base": "base", "vit_large": "large", "vit_giant2": "giant"}


@dataclass(frozen=True)
class ViTArch:
    """What a ViT state dict holds (shapes and which parameters exist), the
    heads where a config or metadata says them (None: unknown), and how
    its source resizes position tables (``interpolate_*``, where known)."""

    embed_dim: int
    depth: int
    patch_size: int
    img_size: int
    mlp_hidden: int
    ffn_layer: str = "mlp"  # "mlp" or "swiglufused"
    num_register_tokens: int = 0
    layerscale: bool = False
    qkv_bias: bool = True
    proj_bias: bool = True
    ffn_bias: bool = True
    mask_token: bool = False
    num_heads: int | None = None
    interpolate_offset: float = 0.0
    interpolate_antialias: bool = False
    in_chans: int = 3  # the images' channels (the patch embedding's input)

    @property
    def name(self) -> str | None:
        """dino_opt's backbone name of this width and depth, or None."""
        return VIT_SIZES.get((self.embed_dim, self.depth), (None,))[0]

    @property
    def heads(self) -> int:
        """The heads: as given, else the named size's, else 64 channels each."""
        if self.num_heads:
            return self.num_heads
        return VIT_SIZES.get((self.embed_dim, self.depth), (None, max(1, self.embed_dim // 64)))[1]

    @property
    def swiglu(self) -> bool:
        return self.ffn_layer != "mlp"

    @property
    def mlp_ratio(self) -> float:
        """A ratio that gives ``mlp_hidden`` (through DINOv2's SwiGLU rule for a SwiGLU)."""
        dim, hidden = self.embed_dim, self.mlp_hidden
        if self.swiglu:
            for ratio in (4.0, hidden * 1.5 / dim):
                if swiglu_hidden_dim(int(dim * ratio)) == hidden:
                    return ratio
            raise ValueError(f"a SwiGLU of width {hidden} is not one DINOv2's rule gives")
        ratio = hidden / dim
        return ratio if int(dim * ratio) == hidden else (hidden + 0.5) / dim

    @property
    def standard_ffn(self) -> bool:
        four = 4 * self.embed_dim
        return self.mlp_hidden == (swiglu_hidden_dim(four) if self.swiglu else four)

    @property
    def dino_v1(self) -> bool:
        """DINO's ViT: no registers, no LayerScale, a GELU MLP, every bias."""
        return (
            not self.num_register_tokens
            and not self.layerscale
            and not self.swiglu
            and self.qkv_bias
            and self.proj_bias
            and self.ffn_bias
        )

    def shape(self) -> tuple:
        """What must agree between weights and a model (the rest is adapted)."""
        return (
            self.embed_dim,
            self.depth,
            self.patch_size,
            self.ffn_layer,
            self.mlp_hidden,
            self.num_register_tokens,
        )

    def describe(self) -> str:
        size = (
            f"a {self.name}"
            if self.name
            else f"a ViT of width {self.embed_dim}, depth {self.depth}"
        )
        parts = [f"{size} with patch {self.patch_size}"]
        if self.num_register_tokens:
            parts.append(f"{self.num_register_tokens} registers")
        if self.swiglu:
            parts.append("SwiGLU")
        if not self.standard_ffn:
            parts.append(f"FFN width {self.mlp_hidden}")
        return ", ".join(parts)

    def model_kwargs(self) -> dict:
        """:class:`~dino_opt.models.VisionTransformer` keywords of this architecture."""
        return dict(
            img_size=self.img_size,
            patch_size=self.patch_size,
            embed_dim=self.embed_dim,
            depth=self.depth,
            num_heads=self.heads,
            mlp_ratio=self.mlp_ratio,
            qkv_bias=self.qkv_bias,
            proj_bias=self.proj_bias,
            ffn_bias=self.ffn_bias,
            ffn_layer=self.ffn_layer,
            layerscale_init=1e-5 if self.layerscale else None,
            num_register_tokens=self.num_register_tokens,
            use_mask_token=self.mask_token,
            interpolate_offset=self.interpolate_offset,
            interpolate_antialias=self.interpolate_antialias,
            in_chans=self.in_chans,
        )

    def replace(self, **changes) -> ViTArch:
        return dataclasses.replace(self, **changes)


def _in_blocks(sd: dict, suffix: str) -> bool:
    return any(k.startswith("blocks.") and k.endswith(suffix) for k in sd)


def _first(sd: dict, suffix: str) -> torch.Tensor:
    for k in sorted(sd):
        if k.startswith("blocks.") and k.endswith(suffix):
            return sd[k]
    raise ValueError(f"a ViT state dict without any blocks.*{suffix} (keys {sorted(sd)[:6]} ...)")


def vit_arch(sd: dict, num_heads: int | None = None) -> ViTArch:
    """The architecture of a ViT state dict in dino_opt's keys."""
    for key in ("cls_token", "pos_embed", "patch_embed.proj.weight"):
        if key not in sd:
            raise ValueError(f"a ViT state dict without {key!r} (keys {sorted(sd)[:6]} ...)")
    swiglu = _in_blocks(sd, ".mlp.w12.weight")
    hidden = (
        _first(sd, ".mlp.w3.weight").shape[1] if swiglu else _first(sd, ".mlp.fc1.weight").shape[0]
    )
    patch = sd["patch_embed.proj.weight"].shape[-1]
    regs = sd.get("register_tokens")
    return ViTArch(
        embed_dim=sd["cls_token"].shape[-1],
        depth=len({k.split(".")[1] for k in sd if k.startswith("blocks.")}),
        patch_size=patch,
        img_size=pos_embed_grid(sd["pos_embed"])[0] * patch,
        mlp_hidden=hidden,
        ffn_layer="swiglufused" if swiglu else "mlp",
        num_register_tokens=0 if regs is None else regs.shape[1],
        layerscale=_in_blocks(sd, ".ls1.gamma"),
        qkv_bias=_in_blocks(sd, ".attn.qkv.bias"),
        proj_bias=_in_blocks(sd, ".attn.proj.bias"),
        ffn_bias=_in_blocks(sd, ".mlp.w12.bias" if swiglu else ".mlp.fc1.bias"),
        mask_token="mask_token" in sd,
        num_heads=num_heads,
        in_chans=sd["patch_embed.proj.weight"].shape[1],
    )


# ---------------------------------------------------------------- DINOv2's chunks

_CHUNKED = re.compile(r"^blocks\.(\d+)\.(\d+)\.(.+)$")


def is_chunked(sd: dict) -> bool:
    """DINOv2's ``block_chunks > 0`` layout: ``blocks.{chunk}.{i}.*``."""
    blocks = [k for k in sd if k.startswith("blocks.")]
    return bool(blocks) and all(_CHUNKED.match(k) for k in blocks)


def unchunk(sd: dict) -> dict:
    """``blocks.{chunk}.{i}.*`` -> ``blocks.{i}.*`` (DINOv2 keeps the global
    block index inside its chunks, so the chunk index just goes)."""
    if not is_chunked(sd):
        return sd
    return {(f"blocks.{m[2]}.{m[3]}" if (m := _CHUNKED.match(k)) else k): v for k, v in sd.items()}


# ---------------------------------------------------------------- timm


def _is_square(n: int) -> bool:
    return n > 0 and math.isqrt(n) ** 2 == n


def _rename_ffn(sd: dict, pairs: tuple[tuple[str, str], ...]) -> dict:
    out = {}
    for k, v in sd.items():
        for old, new in pairs:
            if k.startswith("blocks.") and f".mlp.{old}." in k:
                k = k.replace(f".mlp.{old}.", f".mlp.{new}.")
                break
        out[k] = v
    return out


def _packed_swiglu(sd: dict) -> bool:
    """timm's packed SwiGLU: ``fc1`` twice as wide as ``fc2``'s input (a GELU
    MLP has them equal)."""
    for k in sd:
        fc2 = k.replace(".mlp.fc1.weight", ".mlp.fc2.weight")
        if k.startswith("blocks.") and k.endswith(".mlp.fc1.weight") and fc2 in sd:
            return sd[k].shape[0] == 2 * sd[fc2].shape[1]
    return False


def from_timm(sd: dict) -> dict:
    """timm's ViT keys -> dino_opt's: ``reg_token`` to ``register_tokens``
    (a table without a CLS entry gets a zero one: timm adds no position to
    its CLS token there; position entries of the registers are folded into
    them), and a packed SwiGLU (``fc1`` twice as wide as ``fc2``'s input)
    to ``w12`` / ``w3``."""
    sd = dict(sd)
    pos, reg = sd.get("pos_embed"), sd.pop("reg_token", None)
    n_reg = 0 if reg is None else reg.shape[1]
    if pos is not None and _is_square(pos.shape[1]):  # no_embed_class
        sd["pos_embed"] = torch.cat((torch.zeros_like(pos[:, :1]), pos), dim=1)
    elif pos is not None and n_reg and _is_square(pos.shape[1] - 1 - n_reg):
        reg = reg + pos[:, 1 : 1 + n_reg]
        sd["pos_embed"] = torch.cat((pos[:, :1], pos[:, 1 + n_reg :]), dim=1)
    if reg is not None:
        sd["register_tokens"] = reg
    if _packed_swiglu(sd):
        sd = _rename_ffn(sd, (("fc1", "w12"), ("fc2", "w3")))
    return sd


def _zero_biases(sd: dict, arch: ViTArch, layers: list[str]) -> dict:
    """Zero biases for ``layers`` (``attn.proj``, ``mlp.fc1`` ...) of every block
    where the state has none: for targets whose layers always have one."""
    out = dict(sd)
    for i in range(arch.depth):
        for layer in layers:
            key, weight = f"blocks.{i}.{layer}.bias", sd[f"blocks.{i}.{layer}.weight"]
            if key not in out:
                out[key] = weight.new_zeros(weight.shape[0])
    return out


def to_timm(sd: dict, arch: ViTArch) -> dict:
    """dino_opt's keys -> timm's (see :func:`timm_model` for the model)."""
    out = {k: v for k, v in sd.items() if k != "mask_token"}
    if arch.num_register_tokens:
        pos = out["pos_embed"]
        out["reg_token"] = out.pop("register_tokens")
        out["cls_token"] = out["cls_token"] + pos[:, :1]  # timm's register models: no CLS entry
        out["pos_embed"] = pos[:, 1:]
    if arch.swiglu:
        out = _rename_ffn(out, (("w12", "fc1"), ("w3", "fc2")))
    if arch.proj_bias != arch.ffn_bias:  # timm's proj_bias is both; the missing ones are zero
        missing = ["mlp.fc1", "mlp.fc2"] if arch.proj_bias else ["attn.proj"]
        out = _zero_biases(out, arch, missing)
    return out


def _timm_v1(arch: ViTArch, image_size: int) -> tuple[str, dict]:
    kwargs: dict = {"num_classes": 0}
    size = (arch.name or "").removeprefix("vit_")
    model = f"vit_{size}_patch{arch.patch_size}_224"
    if model not in _TIMM_V1:
        model = f"vit_{size}_patch16_224"
        if model not in _TIMM_V1:  # another width or depth: ViT-B/16's builder, reshaped
            model = "vit_base_patch16_224"
            kwargs |= {
                "embed_dim": arch.embed_dim,
                "depth": arch.depth,
                "num_heads": arch.heads,
                "mlp_ratio": arch.mlp_ratio,
            }
        kwargs["patch_size"] = arch.patch_size
    if image_size != 224:
        kwargs["img_size"] = image_size
    if arch.in_chans != 3:
        kwargs["in_chans"] = arch.in_chans
    return model, kwargs


def _timm_v2(arch: ViTArch, image_size: int) -> tuple[str, dict]:
    reg = "reg4_" if arch.num_register_tokens else ""
    size = _TIMM_V2.get(arch.name or "")
    kwargs: dict = {"num_classes": 0}
    if size is None or (size == "giant") != arch.swiglu or not arch.standard_ffn:
        size = "giant" if arch.swiglu else "small"
        kwargs |= {
            "embed_dim": arch.embed_dim,
            "depth": arch.depth,
            "num_heads": arch.heads,
            "mlp_ratio": _timm_mlp_ratio(arch),
        }
    if image_size != DINOV2_NATIVE:
        kwargs["img_size"] = image_size
    if arch.patch_size != 14:
        kwargs["patch_size"] = arch.patch_size
    if not arch.layerscale:
        kwargs["init_values"] = None
    if arch.num_register_tokens not in (0, 4):
        kwargs["reg_tokens"] = arch.num_register_tokens
    if not arch.qkv_bias:
        kwargs["qkv_bias"] = False
    if not (arch.proj_bias or arch.ffn_bias):
        kwargs["proj_bias"] = False
    if arch.in_chans != 3:
        kwargs["in_chans"] = arch.in_chans
    return f"vit_{size}_patch14_{reg}dinov2", kwargs


def _timm_mlp_ratio(arch: ViTArch) -> float:
    # timm's hidden width is int(dim * mlp_ratio); its packed SwiGLU is twice the width.
    width = 2 * arch.mlp_hidden if arch.swiglu else arch.mlp_hidden
    ratio = width / arch.embed_dim
    return ratio if int(arch.embed_dim * ratio) == width else (width + 0.5) / arch.embed_dim


def timm_model(arch: ViTArch, image_size: int) -> tuple[str, dict]:
    """The timm model name and keywords that build ``arch`` for ``image_size``
    inputs: DINO's ``vit_*_patch*_224`` for a DINO ViT, else DINOv2's
    ``vit_*_patch14[_reg4]_dinov2`` (reshaped by keywords where needed)."""
    return _timm_v1(arch, image_size) if arch.dino_v1 else _timm_v2(arch, image_size)


# ---------------------------------------------------------------- Hugging Face ViTModel (DINO)


def to_hf_vit(sd: dict, arch: ViTArch) -> dict:
    """dino_opt's ViT keys -> the published DINO checkpoints' ViTModel keys."""
    out = {
        "embeddings.cls_token": sd["cls_token"],
        "embeddings.position_embeddings": sd["pos_embed"],
        "embeddings.patch_embeddings.projection.weight": sd["patch_embed.proj.weight"],
        "embeddings.patch_embeddings.projection.bias": sd["patch_embed.proj.bias"],
        "layernorm.weight": sd["norm.weight"],
        "layernorm.bias": sd["norm.bias"],
    }
    for i in range(arch.depth):
        b, h = f"blocks.{i}.", f"encoder.layer.{i}."
        for kind in ("weight", "bias"):
            q, k, v = sd[f"{b}attn.qkv.{kind}"].chunk(3)
            out |= {
                f"{h}attention.attention.query.{kind}": q,
                f"{h}attention.attention.key.{kind}": k,
                f"{h}attention.attention.value.{kind}": v,
                f"{h}attention.output.dense.{kind}": sd[f"{b}attn.proj.{kind}"],
                f"{h}intermediate.dense.{kind}": sd[f"{b}mlp.fc1.{kind}"],
                f"{h}output.dense.{kind}": sd[f"{b}mlp.fc2.{kind}"],
                f"{h}layernorm_before.{kind}": sd[f"{b}norm1.{kind}"],
                f"{h}layernorm_after.{kind}": sd[f"{b}norm2.{kind}"],
            }
    return {k: v.contiguous() for k, v in out.items()}


def from_hf_vit(sd: dict) -> dict:
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
            out |= {
                f"{b}attn.qkv.{kind}": torch.cat(qkv),
                f"{b}attn.proj.{kind}": sd[f"{h}attention.output.dense.{kind}"],
                f"{b}mlp.fc1.{kind}": sd[f"{h}intermediate.dense.{kind}"],
                f"{b}mlp.fc2.{kind}": sd[f"{h}output.dense.{kind}"],
                f"{b}norm1.{kind}": sd[f"{h}layernorm_before.{kind}"],
                f"{b}norm2.{kind}": sd[f"{h}layernorm_after.{kind}"],
            }
    return out


def hf_vit_config(arch: ViTArch, image_size: int) -> dict:
    return {
        "architectures": ["ViTModel"],
        "model_type": "vit",
        "hidden_size": arch.embed_dim,
        "num_hidden_layers": arch.depth,
        "num_attention_heads": arch.heads,
        "intermediate_size": arch.mlp_hidden,
        "hidden_act": "gelu",
        "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0,
        "layer_norm_eps": 1e-6,
        "image_size": image_size,
        "patch_size": arch.patch_size,
        "num_channels": arch.in_chans,
        "qkv_bias": True,
        "initializer_range": 0.02,
    }


# ---------------------------------------------------------------- Hugging Face Dinov2


def _hf_block_pairs(swiglu: bool) -> list[tuple[str, str]]:
    """(dino_opt, Hugging Face) names of a block's layers renamed one to one."""
    ffn = (
        [("mlp.w12", "mlp.weights_in"), ("mlp.w3", "mlp.weights_out")]
        if swiglu
        else [("mlp.fc1", "mlp.fc1"), ("mlp.fc2", "mlp.fc2")]
    )
    return [("norm1", "norm1"), ("attn.proj", "attention.output.dense"), ("norm2", "norm2"), *ffn]


_HF_EMBEDDINGS = (
    ("cls_token", "embeddings.cls_token"),
    ("mask_token", "embeddings.mask_token"),
    ("pos_embed", "embeddings.position_embeddings"),
    ("register_tokens", "embeddings.register_tokens"),
    ("patch_embed.proj.weight", "embeddings.patch_embeddings.projection.weight"),
    ("patch_embed.proj.bias", "embeddings.patch_embeddings.projection.bias"),
    ("norm.weight", "layernorm.weight"),
    ("norm.bias", "layernorm.bias"),
)


def to_hf_dinov2(sd: dict, arch: ViTArch) -> dict:
    """dino_opt's keys -> the published Dinov2Model / Dinov2WithRegistersModel
    keys. Their blocks always have LayerScale (1 where ours has none), the
    mask token (zero where ours has none) and biases in the output
    projection and the feed-forward layers (zero where ours have none)."""
    sd = _zero_biases(
        sd, arch, ["attn.proj", *(["mlp.w12", "mlp.w3"] if arch.swiglu else ["mlp.fc1", "mlp.fc2"])]
    )
    sd.setdefault("mask_token", sd["cls_token"].new_zeros(1, arch.embed_dim))
    out = {theirs: sd[ours] for ours, theirs in _HF_EMBEDDINGS if ours in sd}
    ones = sd["norm.weight"].new_ones(arch.embed_dim)
    for i in range(arch.depth):
        b, h = f"blocks.{i}.", f"encoder.layer.{i}."
        kinds = ("weight", "bias") if arch.qkv_bias else ("weight",)
        for kind in kinds:
            q, k, v = sd[f"{b}attn.qkv.{kind}"].chunk(3)
            out |= {
                f"{h}attention.attention.query.{kind}": q,
                f"{h}attention.attention.key.{kind}": k,
                f"{h}attention.attention.value.{kind}": v,
            }
        for ours, theirs in _hf_block_pairs(arch.swiglu):
            out |= {f"{h}{theirs}.{kind}": sd[f"{b}{ours}.{kind}"] for kind in ("weight", "bias")}
        for n in (1, 2):
            out[f"{h}layer_scale{n}.lambda1"] = sd.get(f"{b}ls{n}.gamma", ones)
    return {k: v.contiguous() for k, v in out.items()}


_HF_NEW_NAMES = (
    (".attention.q_proj.", ".attention.attention.query."),
    (".attention.k_proj.", ".attention.attention.key."),
    (".attention.v_proj.", ".attention.attention.value."),
    (".attention.o_proj.", ".attention.output.dense."),
    (".mlp.down_proj.", ".mlp.weights_out."),
)


def _hf_published_names(sd: dict) -> dict:
    """transformers 5's module names -> the published checkpoints' (the split
    SwiGLU input ``gate_proj`` / ``up_proj`` fused into ``weights_in``)."""
    out = {}
    for k, v in sd.items():
        for new, old in _HF_NEW_NAMES:
            k = k.replace(new, old)
        out[k] = v
    for k in [k for k in out if ".mlp.gate_proj." in k]:
        up = k.replace(".mlp.gate_proj.", ".mlp.up_proj.")
        out[k.replace(".mlp.gate_proj.", ".mlp.weights_in.")] = torch.cat((out.pop(k), out.pop(up)))
    return out


def from_hf_dinov2(sd: dict) -> dict:
    """Dinov2Model / Dinov2WithRegistersModel keys (published or transformers
    5 names; ``dinov2.`` / ``dinov2_with_registers.`` prefix allowed) -> dino_opt's."""
    sd = _hf_published_names(
        {re.sub(r"^dinov2(_with_registers)?\.", "", k): v for k, v in sd.items()}
    )
    out = {ours: sd[theirs] for ours, theirs in _HF_EMBEDDINGS if theirs in sd}
    swiglu = any(".mlp.weights_in." in k for k in sd)
    depth = len({k.split(".")[2] for k in sd if k.startswith("encoder.layer.")})
    for i in range(depth):
        b, h = f"blocks.{i}.", f"encoder.layer.{i}."
        for kind in ("weight", "bias"):
            names = [f"{h}attention.attention.{n}.{kind}" for n in ("query", "key", "value")]
            if names[0] in sd:
                out[f"{b}attn.qkv.{kind}"] = torch.cat([sd[n] for n in names])
        for ours, theirs in _hf_block_pairs(swiglu):
            out |= {f"{b}{ours}.{kind}": sd[f"{h}{theirs}.{kind}"] for kind in ("weight", "bias")}
        for n in (1, 2):
            out[f"{b}ls{n}.gamma"] = sd[f"{h}layer_scale{n}.lambda1"]
    return out


def hf_dinov2_config(arch: ViTArch, image_size: int) -> dict:
    """config.json of the Dinov2Model (Dinov2WithRegistersModel with registers)."""
    registers, ratio = arch.num_register_tokens, arch.mlp_ratio
    if not float(ratio).is_integer():
        raise ValueError(
            f"Hugging Face's Dinov2 config takes a whole mlp_ratio; an FFN of width "
            f"{arch.mlp_hidden} at {arch.embed_dim} channels has none"
        )
    config = {
        "architectures": ["Dinov2WithRegistersModel" if registers else "Dinov2Model"],
        "model_type": "dinov2_with_registers" if registers else "dinov2",
        "hidden_size": arch.embed_dim,
        "num_hidden_layers": arch.depth,
        "num_attention_heads": arch.heads,
        "mlp_ratio": int(ratio),
        "hidden_act": "gelu",
        "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0,
        "drop_path_rate": 0.0,
        "layer_norm_eps": 1e-6,
        "image_size": image_size,
        "patch_size": arch.patch_size,
        "num_channels": arch.in_chans,
        "qkv_bias": arch.qkv_bias,
        "layerscale_value": 1.0,
        "use_swiglu_ffn": arch.swiglu,
        "initializer_range": 0.02,
        "apply_layernorm": True,
        "reshape_hidden_states": True,
    }
    return config | ({"num_register_tokens": registers} if registers else {"use_mask_token": True})
