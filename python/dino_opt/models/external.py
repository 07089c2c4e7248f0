"""A network of the user's own as a student backbone: a timm model by name
(``timm:NAME``), a torchvision model (``torchvision:NAME``) or the module a
function returns (``package.module:function``), read as a feature map or as
tokens (:class:`ExternalBackbone`).

What the network gives is found once, when it is built, from one forward of
a 224 x 224 image (on the device its parameters are on, so a network built
on the meta device is probed there, without compute): a feature map
``[B, C, h, w]`` (its global average is the image's feature, its cells the
patches) or tokens ``[B, N, C]`` (the first is the class token when the
network has one: timm's ``num_prefix_tokens``, or one more token than a
square grid). Anything else (pooled features only, a tuple, a dict) is a
one-line error naming what it got, before any training starts.

Parameters the reading does not reach (a torchvision classifier, which the
features skip) are frozen: found by a forward and backward of the probe on
the meta device, they would get no gradient, which DistributedDataParallel
refuses; they stay in the network's state dict, so its own class loads it.
"""

from __future__ import annotations

import difflib
import importlib
import math

import torch
from torch import nn
from torch.func import functional_call

from .channels import input_channels, set_input_channels
from .modes import eval_mode
from .tokens import resnet_map
from .vit import resize_pos_embed

__all__ = ["PROBE_SIZE", "ExternalBackbone", "build_external", "unreached_parameters"]

#: The side of the image the network is probed with.
PROBE_SIZE = 224

# How a torchvision model's output is read, by what it has (the first that fits).
_TORCHVISION_READERS = (
    ("resnet", ("conv1", "layer4")),
    ("swin", ("features", "norm", "permute")),
    ("features", ("features",)),
    ("regnet", ("stem", "trunk_output")),
    ("vit", ("conv_proj", "encoder", "class_token")),
    ("layers", ("layers",)),
    ("shufflenet", ("stage2", "conv5")),
)


def _swin_map(net: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A torchvision Swin's last stage, normalised, as [B, C, h, w] (its
    stages run channels-last)."""
    return net.permute(net.norm(net.features(x)))


def _shufflenet_map(net: nn.Module, x: torch.Tensor) -> torch.Tensor:
    x = net.maxpool(net.conv1(x))
    return net.conv5(net.stage4(net.stage3(net.stage2(x))))


def _vit_tokens(net: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A torchvision ViT's tokens [B, 1 + h * w, C] after its last norm, as
    its own forward gives them at its image size; at any other size its
    position table is resized to the grid (bicubic, as DINO's ViT does)."""
    x = net.conv_proj(x)
    grid = tuple(x.shape[-2:])
    x = torch.cat([net.class_token.expand(x.shape[0], -1, -1), x.flatten(2).transpose(1, 2)], 1)
    encoder = net.encoder
    pos = resize_pos_embed(encoder.pos_embedding, grid)
    return encoder.ln(encoder.layers(encoder.dropout(x + pos)))


_READERS = {
    "resnet": resnet_map,
    "swin": _swin_map,
    "features": lambda net, x: net.features(x),
    "regnet": lambda net, x: net.trunk_output(net.stem(x)),
    "vit": _vit_tokens,
    "layers": lambda net, x: net.layers(x),
    "shufflenet": _shufflenet_map,
}


def _read(net: nn.Module, reader: str, images: torch.Tensor):
    """What ``net`` gives for ``images`` as ``reader`` reads it: one of
    :data:`_READERS`, or the method of that name."""
    read = _READERS.get(reader)
    return read(net, images) if read is not None else getattr(net, reader)(images)


class _Reading(nn.Module):
    """``net`` read as ``reader``: a module whose forward is the reading."""

    def __init__(self, net: nn.Module, reader: str):
        super().__init__()
        self.net = net
        self.reader = reader

    def forward(self, images: torch.Tensor):
        return _read(self.net, self.reader, images)


def unreached_parameters(net: nn.Module, reader: str) -> list[str]:
    """The trainable parameters of ``net`` that its reading as ``reader``
    does not reach, from one forward and backward of a probe image: on the
    meta device (no compute, whatever device ``net`` is on), or, where the
    network has an operator without a meta kernel, on its own parameters'
    device (one small image; autograd.grad leaves their ``.grad`` alone).
    A network that runs neither way is refused in one line: nothing frozen
    would make a distributed run fail later, far from the cause."""
    trainable = {f"net.{k}": p for k, p in net.named_parameters() if p.requires_grad}
    try:
        params = {
            k: torch.empty_like(p, device="meta").requires_grad_() for k, p in trainable.items()
        }
        buffers = {f"net.{k}": torch.empty_like(b, device="meta") for k, b in net.named_buffers()}
        grads = _probe_grads(net, reader, params, buffers, "meta")
    except (RuntimeError, NotImplementedError):  # an operator without a meta kernel
        device = next(iter(trainable.values())).device if trainable else torch.device("cpu")
        try:
            copies = {f"net.{k}": b.clone() for k, b in net.named_buffers()}  # stats untouched
            grads = _probe_grads(net, reader, trainable, copies, device)
        except (RuntimeError, NotImplementedError, ValueError, TypeError) as e:
            raise ValueError(
                f"{type(net).__name__}: one forward and backward of a {PROBE_SIZE} x "
                f"{PROBE_SIZE} image through its {reader} failed, so the parameters "
                f"it does not use cannot be found ({type(e).__name__}: {e})"
            ) from None
    return [k.removeprefix("net.") for k, g in zip(trainable, grads, strict=True) if g is None]


def _probe_grads(net: nn.Module, reader: str, params: dict, buffers: dict, device) -> tuple:
    probe = torch.zeros(1, input_channels(net), PROBE_SIZE, PROBE_SIZE, device=device)
    out = functional_call(_Reading(net, reader), {**params, **buffers}, (probe,))
    return torch.autograd.grad(out.float().sum(), list(params.values()), allow_unused=True)


def _close(name: str, known: list[str]) -> str:
    close = difflib.get_close_matches(name, known, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _timm(name: str, in_chans: int = 3) -> tuple[nn.Module, str]:
    try:
        import timm
    except ImportError:
        raise ImportError(
            f"timm:{name} needs timm, which is not installed (pip install timm, or dino-opt[timm])"
        ) from None

    if not timm.is_model(name):
        raise ValueError(
            f"timm:{name}: timm {timm.__version__} has no model {name!r}"
            f"{_close(name, timm.list_models())}"
        )
    try:  # a ViT takes any image size with dynamic_img_size; a CNN has no such argument
        net = timm.create_model(
            name, pretrained=False, num_classes=0, in_chans=in_chans, dynamic_img_size=True
        )
    except TypeError:
        net = timm.create_model(name, pretrained=False, num_classes=0, in_chans=in_chans)
    return net, "forward_features"


def _torchvision(name: str) -> tuple[nn.Module, str]:
    try:
        import torchvision.models as tvm
    except ImportError:
        raise ImportError(
            f"torchvision:{name} needs torchvision, which is not installed "
            "(pip install torchvision)"
        ) from None

    known = tvm.list_models()
    if name not in known:
        raise ValueError(
            f"torchvision:{name}: torchvision has no model {name!r}{_close(name, known)}"
        )
    net = tvm.get_model(name, weights=None)
    for reader, needs in _TORCHVISION_READERS:
        if all(hasattr(net, n) for n in needs):
            return net, reader
    raise ValueError(
        f"torchvision:{name}: no feature map to read (it has none of layer4, features or "
        "trunk_output); wrap it in a function that returns a module whose forward gives one, "
        "and name that (package.module:function)"
    )


def _callable(name: str) -> tuple[nn.Module, str]:
    module_name, _, function = name.partition(":")
    if not module_name or not function:
        raise ValueError(f"{name!r} is not timm:NAME, torchvision:NAME or package.module:function")
    try:
        make = getattr(importlib.import_module(module_name), function)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{name}: cannot import it ({type(e).__name__}: {e})") from None
    try:
        net = make()
    except Exception as e:  # the user's code: any failure is reported in one line
        raise ValueError(f"{name}: calling {function}() failed ({type(e).__name__}: {e})") from None
    if not isinstance(net, nn.Module):
        raise ValueError(
            f"{name}: {function}() returned a {type(net).__name__}, not a torch.nn.Module"
        )
    return net, "forward_features" if hasattr(net, "forward_features") else "forward"


def _network(name: str, in_chans: int = 3) -> tuple[nn.Module, str]:
    """The network ``name`` names, taking ``in_chans`` channels (timm's own
    option; elsewhere its first 3-channel convolution replaced), and how its
    features are read (its spelling is the config's to check)."""
    source, _, what = name.partition(":")
    if source == "timm":
        return _timm(what, in_chans)
    net, reader = _torchvision(what) if source == "torchvision" else _callable(name)
    return set_input_channels(net, in_chans, name), reader


def _describe(out) -> str:
    if torch.is_tensor(out):
        return f"a tensor of shape {list(out.shape)}"
    if isinstance(out, (tuple, list)):
        return f"a {type(out).__name__} of {len(out)}"
    if isinstance(out, dict):
        return f"a dict of {sorted(out)}"
    return f"a {type(out).__name__}"


def _prefix_tokens(net: nn.Module, n: int) -> int | None:
    """The tokens before the patches of ``n`` tokens of a 224-pixel image."""
    own = getattr(net, "num_prefix_tokens", None)
    if isinstance(own, int):
        return own
    for prefix in (0, 1):
        if math.isqrt(n - prefix) ** 2 == n - prefix:
            return prefix
    return None


class ExternalBackbone(nn.Module):
    """A user's network ``net`` (built from ``name``) as a backbone:
    :meth:`forward_features` gives the ViTs' keys (``x_norm_clstoken``
    ``[B, C]``, ``x_norm_patchtokens`` ``[B, h * w, C]``), ``forward`` the
    image's feature ``[B, C]`` (the class token, or the map's or the
    patches' average); ``embed_dim`` is ``C``. Its state dict is ``net``'s
    under ``net.``. ValueError naming ``name`` when the network's output
    cannot be read so."""

    def __init__(self, net: nn.Module, name: str, reader: str):
        super().__init__()
        self.net = net
        self.name = name
        self.reader = reader
        self.prefix = 0
        #: the channels of its images (its first convolution's)
        self.in_chans = input_channels(net)
        self.embed_dim = self._probe()
        #: the parameters the reading does not reach, frozen (the module's docstring)
        self.unreached = self._freeze_unreached()

    def _raw(self, images: torch.Tensor):
        return _read(self.net, self.reader, images)

    def _probe(self) -> int:
        param = next(iter(self.net.parameters()), None)
        device = param.device if param is not None else torch.device("cpu")
        try:
            with eval_mode(self.net), torch.no_grad():
                probe = torch.zeros(1, self.in_chans, PROBE_SIZE, PROBE_SIZE, device=device)
                out = self._raw(probe)
        except Exception as e:  # the user's network: any failure is one line
            raise ValueError(
                f"{self.name}: its forward failed on a {PROBE_SIZE} x {PROBE_SIZE} "
                f"image ({type(e).__name__}: {e})"
            ) from None
        return self._width(out)

    def _freeze_unreached(self) -> list[str]:
        with eval_mode(self.net):
            names = unreached_parameters(self.net, self.reader)
        for name in names:
            self.net.get_parameter(name).requires_grad_(False)
        return names

    def _width(self, out) -> int:
        if torch.is_tensor(out) and out.dim() == 4:
            return int(out.shape[1])
        if torch.is_tensor(out) and out.dim() == 3:
            prefix = _prefix_tokens(self.net, out.shape[1])
            if prefix is not None:
                self.prefix = prefix
                return int(out.shape[2])
        raise ValueError(
            f"{self.name}: its {self.reader} gives {_describe(out)} for a {PROBE_SIZE} x "
            f"{PROBE_SIZE} image; a student must give a feature map [B, C, H, W] or tokens "
            "[B, N, C] (a square grid, after any class token)"
        )

    def forward_features(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self._raw(images)
        if out.dim() == 4:
            patches = out.flatten(2).transpose(1, 2)
            return {"x_norm_clstoken": out.mean((-2, -1)), "x_norm_patchtokens": patches}
        patches = out[:, self.prefix :]
        cls = out[:, 0] if self.prefix else patches.mean(1)
        return {"x_norm_clstoken": cls, "x_norm_patchtokens": patches}

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.forward_features(images)["x_norm_clstoken"]


def build_external(name: str, in_chans: int = 3) -> ExternalBackbone:
    """The network ``name`` names (``timm:NAME``, ``torchvision:NAME`` or
    ``package.module:function``), randomly initialised, for images of
    ``in_chans`` channels, as an :class:`ExternalBackbone`; ValueError in one
    line naming it when it does not exist, cannot be made or gives nothing a
    student can learn from."""
    net, reader = _network(name, in_chans)
    return ExternalBackbone(net, name, reader)
