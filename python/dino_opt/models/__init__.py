"""Models for DINO and DINOv2: ViT backbones (SDPA attention), DINOv3's
ConvNeXts, ResNets through torchvision, the DINO head and the multi-crop
wrapper, and builders for student / teacher."""

from __future__ import annotations

from torch import nn

from .channels import adapt_input_weight, input_channels, set_input_channels
from .convnext import (
    CONVNEXT_SIZES,
    ConvNeXt,
    convert_convnext_state_dict,
    convert_dinov3_convnext_state_dict,
    convert_hf_convnext_state_dict,
    convert_timm_convnext_state_dict,
    convnext_base,
    convnext_large,
    convnext_small,
    convnext_tiny,
)
from .external import ExternalBackbone, build_external
from .head import DINOHead, WeightNormLinear
from .layers import CHECKPOINT_POLICIES, FFN_LAYERS, recompute_flops_per_byte
from .modes import eval_mode, running_stats_kept
from .rope import RopePositionEmbedding
from .tokens import Tokens, backbone_tokens, feature_width, pool_to_grid
from .vit import (
    VisionTransformer,
    apply_block_options,
    vit_base,
    vit_giant2,
    vit_large,
    vit_small,
    vit_tiny,
)
from .vit_dinov3 import (
    DINOV3_SIZES,
    DinoV3VisionTransformer,
    convert_dinov3_state_dict,
    convert_timm_dinov3_state_dict,
    vit_7b_dinov3,
    vit_base_dinov3,
    vit_huge_plus_dinov3,
    vit_large_dinov3,
    vit_large_plus_dinov3,
    vit_small_dinov3,
    vit_small_plus_dinov3,
)
from .wrapper import MultiCropWrapper

__all__ = [
    "BACKBONES",
    "CHECKPOINT_POLICIES",
    "CONVNEXT_SIZES",
    "DINOV3_SIZES",
    "FFN_LAYERS",
    "recompute_flops_per_byte",
    "VIT_OPTIONS",
    "ConvNeXt",
    "DINOHead",
    "DinoV3VisionTransformer",
    "ExternalBackbone",
    "MultiCropWrapper",
    "RopePositionEmbedding",
    "Tokens",
    "VisionTransformer",
    "WeightNormLinear",
    "apply_block_options",
    "backbone_tokens",
    "build_backbone",
    "build_dino_models",
    "build_external",
    "adapt_input_weight",
    "input_channels",
    "set_input_channels",
    "convert_convnext_state_dict",
    "convert_dinov3_convnext_state_dict",
    "convert_dinov3_state_dict",
    "convert_hf_convnext_state_dict",
    "convert_timm_convnext_state_dict",
    "convert_timm_dinov3_state_dict",
    "convnext_base",
    "convnext_large",
    "convnext_small",
    "convnext_tiny",
    "eval_mode",
    "running_stats_kept",
    "feature_width",
    "pool_to_grid",
    "vit_base",
    "vit_giant2",
    "vit_large",
    "vit_small",
    "vit_tiny",
    "vit_7b_dinov3",
    "vit_base_dinov3",
    "vit_huge_plus_dinov3",
    "vit_large_dinov3",
    "vit_large_plus_dinov3",
    "vit_small_dinov3",
    "vit_small_plus_dinov3",
]

_VITS = {
    "vit_tiny": vit_tiny,
    "vit_small": vit_small,
    "vit_base": vit_base,
    "vit_large": vit_large,
    "vit_giant2": vit_giant2,
}
_DINOV3 = {
    "vit_small_dinov3": vit_small_dinov3,
    "vit_small_plus_dinov3": vit_small_plus_dinov3,
    "vit_base_dinov3": vit_base_dinov3,
    "vit_large_dinov3": vit_large_dinov3,
    "vit_large_plus_dinov3": vit_large_plus_dinov3,
    "vit_huge_plus_dinov3": vit_huge_plus_dinov3,
    "vit_7b_dinov3": vit_7b_dinov3,
}
_RESNETS = {"resnet18": 512, "resnet50": 2048}
_CONVNEXTS = {
    "convnext_tiny": convnext_tiny,
    "convnext_small": convnext_small,
    "convnext_base": convnext_base,
    "convnext_large": convnext_large,
}
BACKBONES = tuple(_VITS) + tuple(_DINOV3) + tuple(_RESNETS) + tuple(_CONVNEXTS)

#: The ViT options of :func:`build_backbone` and their defaults (DINO's ViT).
#: ``ffn_layer`` None: the architecture's own (SwiGLU for vit_giant2, else the MLP).
VIT_OPTIONS = {
    "num_register_tokens": 0,
    "layerscale_init": None,
    "ffn_layer": None,
    "qkv_bias": True,
    "proj_bias": True,
    "ffn_bias": True,
    "drop_path_uniform": False,
    "interpolate_offset": 0.0,
    "interpolate_antialias": False,
    "img_size": 224,
    "use_mask_token": False,
    "depth": None,
}


def build_backbone(
    name: str,
    patch_size: int = 16,
    drop_path_rate: float = 0.1,
    *,
    num_register_tokens: int = 0,
    layerscale_init: float | None = None,
    ffn_layer: str | None = None,
    qkv_bias: bool = True,
    proj_bias: bool = True,
    ffn_bias: bool = True,
    drop_path_uniform: bool = False,
    interpolate_offset: float = 0.0,
    interpolate_antialias: bool = False,
    img_size: int = 224,
    use_mask_token: bool = False,
    depth: int | None = None,
    in_chans: int = 3,
    **kwargs,
) -> tuple[nn.Module, int]:
    """Build a backbone by name; returns ``(module, embed_dim)``.

    ``in_chans``: the channels of its images (``model.in_channels``; see
    :mod:`~dino_opt.models.channels`).

    ``name`` is one of ``BACKBONES``. ViTs take ``patch_size``,
    ``drop_path_rate``, the DINOv2 options (see :class:`VisionTransformer`;
    their defaults give DINO's ViT; ``ffn_layer`` None is the architecture's
    own: ``swiglufused`` for vit_giant2, ``mlp`` otherwise; ``depth`` None
    is the size's own number of blocks, else replaces it) and further
    :class:`VisionTransformer` keywords. ResNets come from torchvision
    (randomly initialised, ``fc`` replaced by ``Identity`` so the output is the
    pooled feature); ``patch_size``, ``drop_path_rate`` and the ViT options do
    not apply to them (a ViT option away from its default is refused) and
    ``kwargs`` go to the torchvision constructor. ConvNeXts
    (:class:`~dino_opt.models.convnext.ConvNeXt`, DINOv3's sizes) take
    ``drop_path_rate`` and ``kwargs``; ``patch_size`` does not apply (their
    patch size equivalent is 32) and a ViT option away from its default is
    refused, as for ResNets.
    """
    vit = dict(
        num_register_tokens=num_register_tokens,
        layerscale_init=layerscale_init,
        ffn_layer=ffn_layer,
        qkv_bias=qkv_bias,
        proj_bias=proj_bias,
        ffn_bias=ffn_bias,
        drop_path_uniform=drop_path_uniform,
        interpolate_offset=interpolate_offset,
        interpolate_antialias=interpolate_antialias,
        img_size=img_size,
        use_mask_token=use_mask_token,
        depth=depth,
    )
    if name in _VITS:
        vit = {k: v for k, v in vit.items() if not (k in ("ffn_layer", "depth") and v is None)}
        model = _VITS[name](
            patch_size=patch_size, drop_path_rate=drop_path_rate, in_chans=in_chans, **vit, **kwargs
        )
        return model, model.embed_dim
    if name in _DINOV3:
        model = _dinov3_backbone(
            name, patch_size, drop_path_rate, vit, dict(kwargs, in_chans=in_chans)
        )
        return model, model.embed_dim
    if name in _RESNETS:
        return set_input_channels(_resnet(name, vit, kwargs), in_chans, name), _RESNETS[name]
    if ":" in name:  # a network of the user's own: timm:NAME, torchvision:NAME, module:function
        _no_vit_options(name, "a network of your own", vit)
        model = build_external(name, in_chans=in_chans, **kwargs)
        return model, model.embed_dim
    if name in _CONVNEXTS:
        _no_vit_options(name, "a ConvNeXt", vit)
        model = _CONVNEXTS[name](drop_path_rate=drop_path_rate, in_chans=in_chans, **kwargs)
        return model, model.embed_dim
    raise ValueError(f"unknown backbone {name!r}; allowed: {', '.join(BACKBONES)}")


# What a DINOv3 size takes from the ViT options: the rest (storage tokens,
# LayerScale, biases, MLP, RoPE in place of a position table) is the size's own.
_DINOV3_TAKES = ("img_size", "use_mask_token", "depth")


def _dinov3_backbone(
    name: str, patch_size: int, drop_path_rate: float, vit_options: dict, kwargs: dict
) -> nn.Module:
    changed = [k for k, v in vit_options.items() if k not in _DINOV3_TAKES and v != VIT_OPTIONS[k]]
    if changed:
        raise ValueError(
            f"backbone {name!r} is a DINOv3 size, which fixes {', '.join(changed)} "
            "(leave them at their defaults)"
        )
    taken = {k: vit_options[k] for k in _DINOV3_TAKES if vit_options[k] is not None}
    return _DINOV3[name](patch_size=patch_size, drop_path_rate=drop_path_rate, **taken, **kwargs)


def _no_vit_options(name: str, kind: str, vit_options: dict) -> None:
    """ValueError naming the ViT options away from their defaults given to
    backbone ``name`` (``kind``), which has none."""
    changed = [k for k, v in vit_options.items() if v != VIT_OPTIONS[k]]
    if changed:
        raise ValueError(
            f"backbone {name!r} is {kind}; the ViT options {', '.join(changed)} "
            "do not apply to it (leave them at their defaults)"
        )


def _resnet(name: str, vit_options: dict, kwargs: dict) -> nn.Module:
    _no_vit_options(name, "a ResNet", vit_options)
    try:
        import torchvision.models as tvm
    except ImportError as e:
        raise ImportError(
            f"backbone {name!r} needs torchvision, which is not installed; "
            "install it (pip install torchvision) or use a ViT backbone "
            f"({', '.join(_VITS)})"
        ) from e
    model = getattr(tvm, name)(weights=None, **kwargs)
    model.fc = nn.Identity()
    return model


def build_dino_models(
    backbone: str = "vit_small",
    out_dim: int = 65536,
    patch_size: int = 16,
    drop_path_rate: float = 0.1,
    norm_last_layer: bool = True,
    use_bn_in_head: bool = False,
    hidden_dim: int = 2048,
    bottleneck_dim: int = 256,
    **backbone_kwargs,
) -> tuple[MultiCropWrapper, MultiCropWrapper]:
    """Student and teacher of DINO, each a :class:`MultiCropWrapper` of a
    backbone and a :class:`DINOHead`.

    ``backbone_kwargs`` go to :func:`build_backbone` (the DINOv2 options:
    ``num_register_tokens``, ``layerscale_init``, ``ffn_layer``, ``qkv_bias``,
    ``proj_bias``, ``ffn_bias``, ``drop_path_uniform``, ``interpolate_offset``,
    ``interpolate_antialias``, ``img_size``, ``use_mask_token``). The
    student's backbone uses ``drop_path_rate``; the teacher has the same
    architecture without stochastic depth, starts with the student's weights
    and has ``requires_grad`` off on every parameter (it is updated by EMA
    only). Both are returned in training mode; the teacher's mode is left to
    the caller.
    """

    def make(dpr: float) -> MultiCropWrapper:
        net, dim = build_backbone(
            backbone, patch_size=patch_size, drop_path_rate=dpr, **backbone_kwargs
        )
        head = DINOHead(
            dim,
            out_dim,
            use_bn=use_bn_in_head,
            norm_last_layer=norm_last_layer,
            hidden_dim=hidden_dim,
            bottleneck_dim=bottleneck_dim,
        )
        return MultiCropWrapper(net, head)

    student = make(drop_path_rate)
    teacher = make(0.0)
    teacher.load_state_dict(student.state_dict())
    teacher.requires_grad_(False)
    return student, teacher
