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
"""

from __future__ import annotations

import difflib
import importlib
import math

import torch
from torch import nn

from .tokens import resnet_map

__all__ = ["PROBE_SIZE", "ExternalBackbone", "build_external"]

#: The side of the image the network is probed with.
PROBE_SIZE = 224

# How a torchvision model's last feature map is read, by what it has.
_TORCHVISION_READERS = (("resnet", ("conv1", "layer4")), ("features", ("features",)),
                        ("regnet", ("stem", "trunk_output")))  # fmt: skip


def _close(name: str, known: list[str]) -> str:
    close = difflib.get_close_matches(name, known, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _timm(name: str) -> tuple[nn.Module, str]:
    try:
        import timm
    except ImportError:
        raise ImportError(f"timm:{name} needs timm, which is not installed "
                          "(pip install timm, or dino-opt[timm])") from None  # fmt: skip

    if not timm.is_model(name):
        raise ValueError(f"timm:{name}: timm {timm.__version__} has no model {name!r}"
                         f"{_close(name, timm.list_models())}")  # fmt: skip
    try:  # a ViT takes any image size with dynamic_img_size; a CNN has no such argument
        net = timm.create_model(name, pretrained=False, num_classes=0, dynamic_img_size=True)
    except TypeError:
        net = timm.create_model(name, pretrained=False, num_classes=0)
    return net, "forward_features"


def _torchvision(name: str) -> tuple[nn.Module, str]:
    try:
        import torchvision.models as tvm
    except ImportError:
        raise ImportError(f"torchvision:{name} needs torchvision, which is not installed "
                          "(pip install torchvision)") from None  # fmt: skip

    known = tvm.list_models()
    if name not in known:
        raise ValueError(f"torchvision:{name}: torchvision has no model {name!r}"
                         f"{_close(name, known)}")  # fmt: skip
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
        raise ValueError(f"{name}: {function}() returned a {type(net).__name__}, not a "
                         "torch.nn.Module")  # fmt: skip
    return net, "forward_features" if hasattr(net, "forward_features") else "forward"


def _network(name: str) -> tuple[nn.Module, str]:
    """The network ``name`` names and how its features are read (its
    spelling is the config's to check)."""
    source, _, what = name.partition(":")
    if source == "timm":
        return _timm(what)
    if source == "torchvision":
        return _torchvision(what)
    return _callable(name)


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
        self.embed_dim = self._probe()

    def _raw(self, images: torch.Tensor):
        n, r = self.net, self.reader
        if r == "resnet":
            return resnet_map(n, images)
        if r == "features":
            return n.features(images)
        if r == "regnet":
            return n.trunk_output(n.stem(images))
        return getattr(n, r)(images)

    def _probe(self) -> int:
        param = next(iter(self.net.parameters()), None)
        device = param.device if param is not None else torch.device("cpu")
        was_training = self.net.training
        self.net.eval()  # one image: BatchNorm from its running statistics
        try:
            with torch.no_grad():
                out = self._raw(torch.zeros(1, 3, PROBE_SIZE, PROBE_SIZE, device=device))
        except Exception as e:  # the user's network: any failure is one line
            raise ValueError(f"{self.name}: its forward failed on a {PROBE_SIZE} x {PROBE_SIZE} "
                             f"image ({type(e).__name__}: {e})") from None  # fmt: skip
        finally:
            self.net.train(was_training)
        return self._width(out)

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


def build_external(name: str) -> ExternalBackbone:
    """The network ``name`` names (``timm:NAME``, ``torchvision:NAME`` or
    ``package.module:function``), randomly initialised, as an
    :class:`ExternalBackbone`; ValueError in one line naming it when it does
    not exist, cannot be made or gives nothing a student can learn from."""
    net, reader = _network(name)
    return ExternalBackbone(net, name, reader)
