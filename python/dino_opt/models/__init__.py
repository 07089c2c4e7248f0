"""Models for DINO: ViT backbones (SDPA attention), ResNets through torchvision,
the DINO head and the multi-crop wrapper, and builders for student / teacher."""

from __future__ import annotations

from torch import nn

from .head import DINOHead, WeightNormLinear
from .vit import VisionTransformer, vit_base, vit_small, vit_tiny
from .wrapper import MultiCropWrapper

__all__ = [
    "BACKBONES",
    "DINOHead",
    "MultiCropWrapper",
    "VisionTransformer",
    "WeightNormLinear",
    "build_backbone",
    "build_dino_models",
    "vit_base",
    "vit_small",
    "vit_tiny",
]

_VITS = {"vit_tiny": vit_tiny, "vit_small": vit_small, "vit_base": vit_base}
_RESNETS = {"resnet18": 512, "resnet50": 2048}
BACKBONES = tuple(_VITS) + tuple(_RESNETS)


def build_backbone(
    name: str, patch_size: int = 16, drop_path_rate: float = 0.1, **kwargs
) -> tuple[nn.Module, int]:
    """Build a backbone by name; returns ``(module, embed_dim)``.

    ``name`` is one of ``BACKBONES``. ViTs take ``patch_size``, ``drop_path_rate``
    and further :class:`VisionTransformer` keywords. ResNets come from torchvision
    (randomly initialised, ``fc`` replaced by ``Identity`` so the output is the
    pooled feature); ``patch_size`` and ``drop_path_rate`` do not apply to them and
    ``kwargs`` go to the torchvision constructor.
    """
    if name in _VITS:
        model = _VITS[name](patch_size=patch_size, drop_path_rate=drop_path_rate, **kwargs)
        return model, model.embed_dim
    if name in _RESNETS:
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
        return model, _RESNETS[name]
    raise ValueError(f"unknown backbone {name!r}; allowed: {', '.join(BACKBONES)}")


def build_dino_models(
    backbone: str = "vit_small",
    out_dim: int = 65536,
    patch_size: int = 16,
    drop_path_rate: float = 0.1,
    norm_last_layer: bool = True,
    use_bn_in_head: bool = False,
    hidden_dim: int = 2048,
    bottleneck_dim: int = 256,
) -> tuple[MultiCropWrapper, MultiCropWrapper]:
    """Student and teacher networks of DINO, each a :class:`MultiCropWrapper`
    of a backbone and a :class:`DINOHead`.

    The student's backbone uses ``drop_path_rate``; the teacher has the same
    architecture without stochastic depth, starts with the student's weights and
    has ``requires_grad`` off on every parameter (it is updated by EMA only).
    Both are returned in training mode; the teacher's mode is left to the caller.
    """

    def make(dpr: float) -> MultiCropWrapper:
        net, dim = build_backbone(backbone, patch_size=patch_size, drop_path_rate=dpr)
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
