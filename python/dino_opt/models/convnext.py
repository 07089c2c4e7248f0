"""ConvNeXt backbones (Liu et al., 2022) as DINOv3 distils its ViT-7B into
them: Tiny, Small, Base and Large.

A stem (4x4 convolution of stride 4, then a channels-first LayerNorm), four
stages of residual blocks, a downsampling layer (LayerNorm, 2x2 convolution
of stride 2) before each of the last three, and a final LayerNorm. A block is
``x + DropPath(gamma * pwconv2(GELU(pwconv1(LN(dwconv(x))))))``: a 7x7
depthwise convolution, a LayerNorm over the channels (channels last), an MLP
four times as wide, and a LayerScale ``gamma`` (1e-6). The last stage has
stride 32, so the model's patch size equivalent is 32.

The model is fully convolutional: any input of at least 32 x 32 pixels goes
through (a side that is not a multiple of 32 is floored, as the strided
convolutions do), so DINO's global (224) and local (96) crops share one
model. ``forward`` gives the pooled feature (B, C) that DINO's head takes;
``forward_features`` gives DINOv2's dict: the class token is the global
average of the last feature map through the final norm, the patch tokens
are that map flattened (row by row), each through the final norm.

The parameters are named as DINOv3's ConvNeXt names them
(``downsample_layers``, ``stages``, ``norm``; DINOv3's ``norms.3`` alias of
``norm`` left out). :func:`convert_timm_convnext_state_dict`,
:func:`convert_hf_convnext_state_dict` and
:func:`convert_dinov3_convnext_state_dict` rename timm's, Hugging Face's and
DINOv3's state dicts to this model's; :func:`convert_convnext_state_dict`
tells them apart. :func:`to_timm_convnext_state_dict`,
:func:`to_hf_convnext_state_dict` and :func:`hf_convnext_config` write
this model's for timm and Hugging Face.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .layers import DropPath
from .vit import drop_path_rates

__all__ = [
    "CONVNEXT_SIZES",
    "ConvNeXt",
    "ConvNeXtBlock",
    "LayerNorm2d",
    "convert_convnext_state_dict",
    "convert_dinov3_convnext_state_dict",
    "convert_hf_convnext_state_dict",
    "convert_timm_convnext_state_dict",
    "convnext_base",
    "convnext_large",
    "convnext_small",
    "convnext_shape",
    "convnext_tiny",
    "hf_convnext_config",
    "to_hf_convnext_state_dict",
    "to_timm_convnext_state_dict",
]

#: DINOv3's ConvNeXt sizes (as the original paper's): blocks per stage and
#: channels per stage, by builder name.
CONVNEXT_SIZES = {
    "convnext_tiny": dict(depths=(3, 3, 9, 3), dims=(96, 192, 384, 768)),
    "convnext_small": dict(depths=(3, 3, 27, 3), dims=(96, 192, 384, 768)),
    "convnext_base": dict(depths=(3, 3, 27, 3), dims=(128, 256, 512, 1024)),
    "convnext_large": dict(depths=(3, 3, 27, 3), dims=(192, 384, 768, 1536)),
}

_EPS = 1e-6  # every LayerNorm of ConvNeXt
_STRIDE = 32  # stem 4, then three downsamplings of 2


class LayerNorm2d(nn.LayerNorm):
    """LayerNorm over the channels of a (B, C, H, W) map (channels first)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.permute(0, 2, 3, 1)
        x = F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return x.permute(0, 3, 1, 2)


class ConvNeXtBlock(nn.Module):
    """A ConvNeXt block on a (B, C, H, W) map: 7x7 depthwise convolution,
    LayerNorm and a 4x GELU MLP over the channels (channels last), LayerScale
    ``gamma`` (none when ``layer_scale_init`` is None or 0), drop path, residual."""

    def __init__(
        self, dim: int, drop_path: float = 0.0, layer_scale_init: float | None = 1e-6
    ) -> None:
        super().__init__()
        self.dwconv = nn.Conv2d(dim, dim, kernel_size=7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=_EPS)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.act = nn.GELU()
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.layer_scale_init = layer_scale_init or None
        self.gamma = (
            nn.Parameter(torch.full((dim,), float(layer_scale_init)))
            if self.layer_scale_init
            else None
        )
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.dwconv(x).permute(0, 2, 3, 1)
        y = self.pwconv2(self.act(self.pwconv1(self.norm(y))))
        if self.gamma is not None:
            y = y * self.gamma
        return x + self.drop_path(y.permute(0, 3, 1, 2))


class ConvNeXt(nn.Module):
    """ConvNeXt backbone of ``depths`` blocks and ``dims`` channels per stage.

    ``drop_path_rate``: stochastic depth ramped linearly from 0 at the first
    block to the rate at the last, over all stages. ``layer_scale_init``: the
    LayerScale's initial value (None or 0: no LayerScale).

    Attributes as the ViTs have them: ``embed_dim`` (the last stage's
    channels), ``patch_size`` (32, the last stage's stride),
    ``num_register_tokens`` (0); and ``embed_dims``, ``depths``,
    ``in_chans``."""

    def __init__(
        self,
        depths: Sequence[int] = (3, 3, 9, 3),
        dims: Sequence[int] = (96, 192, 384, 768),
        in_chans: int = 3,
        drop_path_rate: float = 0.0,
        layer_scale_init: float | None = 1e-6,
    ) -> None:
        super().__init__()
        depths, dims = tuple(int(d) for d in depths), tuple(int(d) for d in dims)
        if len(depths) != 4 or len(dims) != 4 or min(depths + dims) < 1:
            raise ValueError(
                f"ConvNeXt needs 4 positive depths and 4 positive dims, got "
                f"depths={list(depths)}, dims={list(dims)}"
            )
        self.depths, self.embed_dims, self.in_chans = depths, dims, int(in_chans)
        self.embed_dim = self.num_features = dims[-1]
        self.patch_size = _STRIDE
        self.num_register_tokens = 0

        stem = nn.Sequential(
            nn.Conv2d(in_chans, dims[0], kernel_size=4, stride=4), LayerNorm2d(dims[0], eps=_EPS)
        )
        downs = [
            nn.Sequential(
                LayerNorm2d(dims[i - 1], eps=_EPS),
                nn.Conv2d(dims[i - 1], dims[i], kernel_size=2, stride=2),
            )
            for i in range(1, 4)
        ]
        self.downsample_layers = nn.ModuleList([stem, *downs])
        rates = iter(drop_path_rates(drop_path_rate, sum(depths)))
        self.stages = nn.ModuleList(
            nn.Sequential(*(ConvNeXtBlock(dim, next(rates), layer_scale_init) for _ in range(n)))
            for n, dim in zip(depths, dims, strict=True)
        )
        self.norm = nn.LayerNorm(dims[-1], eps=_EPS)
        self.apply(_init_weights)

    # ------------------------------------------------------------ forward

    def _check(self, x: object) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or x.dim() != 4:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"ConvNeXt takes images (B, {self.in_chans}, H, W), got {shape}")
        if x.shape[1] != self.in_chans:
            raise ValueError(
                f"ConvNeXt takes {self.in_chans} channels, got images "
                f"{tuple(x.shape)} with {x.shape[1]}"
            )
        if min(x.shape[-2:]) < _STRIDE:
            raise ValueError(
                f"ConvNeXt needs images of at least {_STRIDE} x {_STRIDE} pixels (its "
                f"last stage has stride {_STRIDE}), got {tuple(x.shape)}"
            )
        return x

    def forward_maps(self, x: torch.Tensor) -> list[torch.Tensor]:
        """The output map of each stage, (B, dims[i], H / 2 ** (i + 2), W / 2 ** (i + 2))
        (floored), before the final norm."""
        x, maps = self._check(x), []
        for down, stage in zip(self.downsample_layers, self.stages, strict=True):
            x = stage(down(x))
            maps.append(x)
        return maps

    def forward_features(
        self,
        x: torch.Tensor | Sequence[torch.Tensor],
        masks: torch.Tensor | Sequence[torch.Tensor | None] | None = None,
    ) -> dict | list[dict]:
        """The outputs of a batch (B, C, H, W), as the ViTs give them:
        ``x_norm_clstoken`` (B, C: the average of the last map, normed),
        ``x_norm_regtokens`` (B, 0, C: none), ``x_norm_patchtokens``
        (B, h * w, C; h = H // 32, w = W // 32, row by row, each normed),
        ``x_prenorm`` (B, 1 + h * w, C: the average and the tokens before the
        norm) and ``masks`` (as given). A ConvNeXt has no mask token:
        ``masks`` that mask a patch are refused. A list of batches (with a
        list of masks, or None) gives a list of dicts."""
        if isinstance(x, (list, tuple)):
            return self.forward_features_list(x, masks)
        if masks is not None and bool(torch.as_tensor(masks).any()):
            raise ValueError(
                "ConvNeXt has no mask token: masked patches (iBOT's masked image "
                "modelling) need a ViT backbone"
            )
        last = self.forward_maps(x)[-1]
        tokens = last.flatten(2).transpose(1, 2)
        prenorm = torch.cat((last.mean(dim=(-2, -1)).unsqueeze(1), tokens), dim=1)
        normed = self.norm(prenorm)
        return {
            "x_norm_clstoken": normed[:, 0],
            "x_norm_regtokens": normed[:, 1:1],
            "x_norm_patchtokens": normed[:, 1:],
            "x_prenorm": prenorm,
            "masks": masks,
        }

    def forward_features_list(
        self, x_list: Sequence[torch.Tensor], masks_list: Sequence | None = None
    ) -> list[dict]:
        """:meth:`forward_features` of each batch of ``x_list`` with its masks."""
        masks_list = [None] * len(x_list) if masks_list is None else list(masks_list)
        if len(masks_list) != len(x_list):
            raise ValueError(f"ConvNeXt: {len(x_list)} batches but {len(masks_list)} masks")
        return [self.forward_features(x, m) for x, m in zip(x_list, masks_list, strict=True)]

    def forward(self, x: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
        """The pooled feature (B, embed_dim): the global average of the last
        map through the final norm (``forward_features``' class token); of a
        list of batches, those of all in input order."""
        if isinstance(x, (list, tuple)):
            if len(x) == 0:
                raise ValueError("ConvNeXt: no images given")
            return torch.cat([self(b) for b in x])
        return self.norm(self.forward_maps(x)[-1].mean(dim=(-2, -1)))


def _init_weights(m: nn.Module) -> None:
    # ConvNeXt's: truncated normal (std 0.02) convolution and linear weights,
    # zero biases, unit LayerNorm; LayerScale keeps its initial value.
    if isinstance(m, (nn.Conv2d, nn.Linear)):
        nn.init.trunc_normal_(m.weight, std=0.02)
        if m.bias is not None:
            nn.init.zeros_(m.bias)
    elif isinstance(m, nn.LayerNorm):
        nn.init.ones_(m.weight)
        nn.init.zeros_(m.bias)


def _convnext(name: str, kwargs: dict) -> ConvNeXt:
    return ConvNeXt(**(CONVNEXT_SIZES[name] | kwargs))


def convnext_tiny(**kwargs) -> ConvNeXt:
    """ConvNeXt-T: depths 3-3-9-3, dims 96-192-384-768 (27.8M parameters)."""
    return _convnext("convnext_tiny", kwargs)


def convnext_small(**kwargs) -> ConvNeXt:
    """ConvNeXt-S: depths 3-3-27-3, dims 96-192-384-768 (49.5M parameters)."""
    return _convnext("convnext_small", kwargs)


def convnext_base(**kwargs) -> ConvNeXt:
    """ConvNeXt-B: depths 3-3-27-3, dims 128-256-512-1024 (87.6M parameters)."""
    return _convnext("convnext_base", kwargs)


def convnext_large(**kwargs) -> ConvNeXt:
    """ConvNeXt-L: depths 3-3-27-3, dims 192-384-768-1536 (196.2M parameters)."""
    return _convnext("convnext_large", kwargs)


# ------------------------------------------------------------ weights in and out

# Each library's names beside this model's, as templates whose fields stand
# for: {s} a stage, {b} a block, {d} a downsampling stage (1-3), {j} the
# index within a stem or downsampling layer, {m} a block's convolution or
# linear layer, {p} weight or bias. One table renames either way.
_FIELDS = {
    "s": r"\d",
    "b": r"\d+",
    "d": "[1-3]",
    "j": "[01]",
    "m": "dwconv|pwconv1|pwconv2",
    "p": "weight|bias",
}
_TIMM_NAMES = (
    ("downsample_layers.0.{j}.{p}", "stem.{j}.{p}"),
    ("downsample_layers.{d}.{j}.{p}", "stages.{d}.downsample.{j}.{p}"),
    ("stages.{s}.{b}.dwconv.{p}", "stages.{s}.blocks.{b}.conv_dw.{p}"),
    ("stages.{s}.{b}.norm.{p}", "stages.{s}.blocks.{b}.norm.{p}"),
    ("stages.{s}.{b}.pwconv1.{p}", "stages.{s}.blocks.{b}.mlp.fc1.{p}"),
    ("stages.{s}.{b}.pwconv2.{p}", "stages.{s}.blocks.{b}.mlp.fc2.{p}"),
    ("stages.{s}.{b}.gamma", "stages.{s}.blocks.{b}.gamma"),
    ("norm.{p}", "head.norm.{p}"),
)
_HF_NAMES = (  # transformers' ConvNextModel
    ("downsample_layers.0.0.{p}", "embeddings.patch_embeddings.{p}"),
    ("downsample_layers.0.1.{p}", "embeddings.layernorm.{p}"),
    ("downsample_layers.{d}.{j}.{p}", "encoder.stages.{d}.downsampling_layer.{j}.{p}"),
    ("stages.{s}.{b}.{m}.{p}", "encoder.stages.{s}.layers.{b}.{m}.{p}"),
    ("stages.{s}.{b}.norm.{p}", "encoder.stages.{s}.layers.{b}.layernorm.{p}"),
    ("stages.{s}.{b}.gamma", "encoder.stages.{s}.layers.{b}.layer_scale_parameter"),
    ("norm.{p}", "layernorm.{p}"),
)
_OURS = re.compile(
    r"downsample_layers\.[0-3]\.[01]\.(weight|bias)|norm\.(weight|bias)"
    r"|stages\.[0-3]\.\d+\.((dwconv|norm|pwconv1|pwconv2)\.(weight|bias)|gamma)"
)


@functools.cache
def _rules(names: tuple, to_ours: bool) -> list[tuple[re.Pattern, str]]:
    """(pattern, replacement) pairs from a table of names: theirs to ours
    when ``to_ours``, else ours to theirs."""
    out = []
    for ours, theirs in names:
        source, target = (theirs, ours) if to_ours else (ours, theirs)
        parts = re.split(r"\{(\w)\}", source)  # literal, field, literal, ...
        pattern = "".join(
            re.escape(part) if i % 2 == 0 else f"(?P<{part}>{_FIELDS[part]})"
            for i, part in enumerate(parts)
        )
        out.append((re.compile(pattern), re.sub(r"\{(\w)\}", r"\\g<\1>", target)))
    return out


def _unknown(keys: list[str], layout: str) -> ValueError:
    shown = ", ".join(keys[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")
    return ValueError(f"not a {layout} ConvNeXt state dict: unknown keys {shown}")


def _renamed(
    state_dict: dict, names: tuple, to_ours: bool, layout: str, skip: str | None = None
) -> dict:
    """``state_dict`` renamed by the table ``names`` (to this model's names
    when ``to_ours``; keys starting with ``skip`` left out); any other key is
    refused in one line, naming the ``layout`` it was read as."""
    out, unknown, rules = {}, [], _rules(names, to_ours)
    for key, value in state_dict.items():
        if skip is not None and key.startswith(skip):
            continue
        for pattern, repl in rules:
            if (match := pattern.fullmatch(key)) is not None:
                out[match.expand(repl)] = value
                break
        else:
            unknown.append(key)
    if unknown:
        raise _unknown(unknown, layout)
    return out


def convert_timm_convnext_state_dict(state_dict: dict) -> dict:
    """A state dict of timm's ConvNeXt (``timm.create_model("convnext_tiny")``
    and the other sizes) renamed to :class:`ConvNeXt`'s: ``stem`` and each
    stage's ``downsample`` -> ``downsample_layers``, ``blocks.j.conv_dw`` /
    ``mlp.fc1`` / ``mlp.fc2`` -> ``j.dwconv`` / ``pwconv1`` / ``pwconv2``,
    ``head.norm`` -> ``norm``; the classifier (``head.fc``) is left out and
    1x1-convolution MLP weights (timm's ``conv_mlp``) become linear ones. Any
    other key (timm's ``norm_pre`` of the head-norm-first variants, which
    normalise before pooling) is refused in one line."""
    out = _renamed(state_dict, _TIMM_NAMES, True, "timm", skip="head.fc.")
    conv_mlp = [k for k, v in out.items() if ".pwconv" in k and v.dim() == 4]  # weights
    return out | {k: out[k].flatten(1) for k in conv_mlp}


def convert_dinov3_convnext_state_dict(state_dict: dict) -> dict:
    """A state dict of DINOv3's ConvNeXt (``dinov3_convnext_tiny`` and the
    other sizes of its hub) as :class:`ConvNeXt`'s: the names are the same;
    ``norms.3`` (DINOv3's alias of ``norm`` for its intermediate layers) is
    left out, or taken as ``norm`` where ``norm`` is absent. Any other key is
    refused in one line."""
    out, unknown = {}, []
    for key, value in state_dict.items():
        if key.startswith("norms.3."):
            alias = "norm." + key[len("norms.3.") :]
            if alias not in state_dict:
                out[alias] = value
        elif _OURS.fullmatch(key):
            out[key] = value
        else:
            unknown.append(key)
    if unknown:
        raise _unknown(unknown, "DINOv3")
    return out


def convert_hf_convnext_state_dict(state_dict: dict) -> dict:
    """A state dict of transformers' ``ConvNextModel`` (or of
    ``ConvNextForImageClassification``, whose ``convnext.`` prefix is
    dropped with its ``classifier``) renamed to :class:`ConvNeXt`'s. Any
    other key is refused in one line."""
    sd = {k.removeprefix("convnext."): v for k, v in state_dict.items()}
    return _renamed(sd, _HF_NAMES, True, "Hugging Face", skip="classifier.")


def convert_convnext_state_dict(state_dict: dict) -> dict:
    """:class:`ConvNeXt`'s state dict from timm's, Hugging Face's, DINOv3's
    or its own (told apart by timm's ``stem.0.weight`` and Hugging Face's
    ``embeddings.patch_embeddings.weight``)."""
    if "stem.0.weight" in state_dict:
        return convert_timm_convnext_state_dict(state_dict)
    if any(k.endswith("embeddings.patch_embeddings.weight") for k in state_dict):
        return convert_hf_convnext_state_dict(state_dict)
    return convert_dinov3_convnext_state_dict(state_dict)


def convnext_shape(state_dict: dict) -> dict:
    """The ``depths``, ``dims`` and ``in_chans`` of :class:`ConvNeXt`'s
    ``state_dict``, and whether its blocks have a LayerScale (``layer_scale``)."""
    dims = [state_dict[f"stages.{i}.0.dwconv.weight"].shape[0] for i in range(4)]
    blocks = {tuple(k.split(".")[1:3]) for k in state_dict if k.startswith("stages.")}
    depths = [sum(1 for s, _ in blocks if s == str(i)) for i in range(4)]
    stem = state_dict["downsample_layers.0.0.weight"]
    return dict(
        depths=depths,
        dims=dims,
        in_chans=stem.shape[1],
        layer_scale="stages.0.0.gamma" in state_dict,
    )


def to_timm_convnext_state_dict(state_dict: dict) -> dict:
    """:class:`ConvNeXt`'s ``state_dict`` in timm's names: what
    ``timm.create_model("convnext_tiny", num_classes=0)`` (or the size's
    builder) loads; its pooled and normed feature is this model's."""
    return _renamed(state_dict, _TIMM_NAMES, False, "dino_opt")


def to_hf_convnext_state_dict(state_dict: dict) -> dict:
    """:class:`ConvNeXt`'s ``state_dict`` in the names of Hugging Face's
    ``ConvNextModel`` (configured by :func:`hf_convnext_config`), whose
    ``pooler_output`` is this model's pooled feature."""
    return _renamed(state_dict, _HF_NAMES, False, "dino_opt")


def hf_convnext_config(state_dict: dict, image_size: int = 224) -> dict:
    """The ``config.json`` of Hugging Face's ``ConvNextModel`` for
    :class:`ConvNeXt`'s ``state_dict``: its depths and widths, every
    LayerNorm's epsilon (1e-6, the final one's too) and exact GELU."""
    shape = convnext_shape(state_dict)
    return {
        "architectures": ["ConvNextModel"],
        "model_type": "convnext",
        "depths": shape["depths"],
        "hidden_sizes": shape["dims"],
        "num_stages": 4,
        "num_channels": shape["in_chans"],
        "patch_size": 4,
        "hidden_act": "gelu",
        "layer_norm_eps": _EPS,
        "layer_scale_init_value": 1e-6 if shape["layer_scale"] else 0.0,
        "drop_path_rate": 0.0,
        "image_size": image_size,
    }
