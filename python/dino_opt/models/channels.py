"""Networks for images of other than 3 channels (``model.in_channels``).

The ViTs, DINOv3's ViTs and the ConvNeXts take ``in_chans`` themselves; a
ResNet, a torchvision network or a network of the user's own gets its first
3-channel convolution replaced by one of ``in_chans`` channels
(:func:`set_input_channels`); timm networks are made with timm's own
``in_chans``. Released RGB weights start such a network through
:func:`adapt_input_weight`, timm's rule (``timm.models.adapt_input_conv``):
one channel takes the sum of the R, G and B filters (the RGB network's
response to a grey image given as R = G = B); N channels take the RGB
filters repeated (R, G, B, R, ...) and scaled by 3 / N, so that an image
whose channels are equal gives the RGB network's response.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["adapt_input_weight", "adapt_input_weights", "input_channels", "set_input_channels"]


def adapt_input_weight(weight: torch.Tensor, in_chans: int) -> torch.Tensor:
    """An RGB input filter bank ``[O, 3, kh, kw]`` for ``in_chans`` channels
    (timm's rule: summed for 1, repeated and scaled by 3 / N otherwise), in
    the weight's dtype, computed in float32."""
    if weight.dim() != 4 or weight.shape[1] != 3:
        raise ValueError(f"an RGB input filter bank is [O, 3, kh, kw], got {list(weight.shape)}")
    if in_chans < 1:
        raise ValueError(f"in_chans must be >= 1, got {in_chans}")
    w = weight.float()
    if in_chans == 1:
        w = w.sum(dim=1, keepdim=True)
    elif in_chans != 3:
        repeat = -(-in_chans // 3)
        w = w.repeat(1, repeat, 1, 1)[:, :in_chans] * (3.0 / in_chans)
    return w.to(weight.dtype)


def adapt_input_weights(sd: dict, module: nn.Module, notes: list[str]) -> dict:
    """``sd`` with every RGB input filter bank (a 4-D weight of 3 input
    channels where ``module`` has one of another count under the same name)
    adapted to the module's channels, and a note saying so."""
    mine = module.state_dict()
    out = dict(sd)
    for key, value in sd.items():
        target = mine.get(key)
        if (
            target is not None
            and torch.is_tensor(value)
            and value.dim() == 4
            and target.dim() == 4
            and value.shape[1] == 3
            and target.shape[1] != 3
            and value.shape[0] == target.shape[0]
            and value.shape[2:] == target.shape[2:]
        ):
            n = target.shape[1]
            out[key] = adapt_input_weight(value, n)
            rule = "summed over R, G, B" if n == 1 else f"repeated and scaled by 3/{n}"
            notes.append(f"{key}: RGB filters adapted to {n} channel(s) ({rule}, as timm does)")
    return out


def _first_rgb_conv(net: nn.Module) -> tuple[nn.Module, str, nn.Conv2d] | None:
    for name, module in net.named_modules():
        if isinstance(module, nn.Conv2d) and module.in_channels == 3:
            parent_name, _, attr = name.rpartition(".")
            return net.get_submodule(parent_name) if parent_name else net, attr, module
    return None


def set_input_channels(net: nn.Module, in_chans: int, name: str) -> nn.Module:
    """``net`` with its first 3-channel ``Conv2d`` replaced by one taking
    ``in_chans`` channels (same shape otherwise, freshly initialised);
    unchanged for 3. ValueError naming ``name`` when it has no such layer."""
    if in_chans == 3:
        return net
    found = _first_rgb_conv(net)
    if found is None:
        raise ValueError(f"{name}: no 3-channel Conv2d to take {in_chans} channels")
    parent, attr, conv = found
    setattr(
        parent,
        attr,
        nn.Conv2d(
            in_chans,
            conv.out_channels,
            conv.kernel_size,
            conv.stride,
            conv.padding,
            conv.dilation,
            conv.groups if conv.groups == 1 else in_chans,
            conv.bias is not None,
            conv.padding_mode,
        ),
    )
    return net


def input_channels(net: nn.Module) -> int:
    """The channels ``net`` takes: its ``in_chans`` where it says, else its
    first convolution's input channels (3 when it has none)."""
    for owner in (net, getattr(net, "net", None)):
        chans = getattr(owner, "in_chans", None)
        if isinstance(chans, int):
            return chans
    for module in net.modules():
        if isinstance(module, nn.Conv2d):
            return module.in_channels
    return 3
