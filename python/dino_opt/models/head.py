"""The DINO projection head: an MLP to a bottleneck, L2 normalisation, then a
weight-normalised linear layer (no bias) to ``out_dim`` prototypes."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["DINOHead", "WeightNormLinear"]


class WeightNormLinear(nn.Module):
    """Linear layer without bias whose weight is ``g * v / ||v||`` row by row
    (weight normalisation, Salimans & Kingma 2016) with explicit parameters
    ``weight_g`` (out, 1) and ``weight_v`` (out, in).

    The names and shapes are those ``torch.nn.utils.weight_norm`` gives, so the
    state dict loads from and into original DINO checkpoints; being plain
    parameters they also go through deepcopy, EMA updates and optimisers as is.

    With fewer input rows than ``in_features`` the forward scales the outputs
    by ``g / ||v||`` instead of forming the normalised weight: the same map,
    with elementwise work over rows x out instead of out x in, forward and
    backward (at DINO's 65,536 outputs and a few hundred rows per step on a
    CPU, the normalised weight was a tenth of the step). ``scale_outputs =
    False`` always forms the weight, as ``torch.nn.utils.weight_norm`` does.

    ``frozen`` (set by the trainer in the epochs DINO keeps the last layer
    frozen): the forward reads the weights detached, so the backward computes
    no gradient for them; the outputs and the inputs' gradient are unchanged.
    """

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight_g = nn.Parameter(torch.ones(out_features, 1))
        self.weight_v = nn.Parameter(torch.empty(out_features, in_features))
        nn.init.trunc_normal_(self.weight_v, std=0.02)
        self.scale_outputs = True
        self.frozen = False

    @property
    def weight(self) -> torch.Tensor:
        """The effective weight ``g * v / ||v||`` (out, in)."""
        return _normalised(self.weight_g, self.weight_v)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, v = self.weight_g, self.weight_v
        if self.frozen:
            g, v = g.detach(), v.detach()
        if self.scale_outputs and x.numel() < self.in_features**2:  # fewer rows than inputs
            return F.linear(x, v) * (g.squeeze(1) / v.norm(dim=1))
        return F.linear(x, _normalised(g, v))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias=False"


class DINOHead(nn.Module):
    """DINO projection head.

    ``nlayers`` linear layers (in -> hidden -> ... -> bottleneck) with GELU between
    them (and BatchNorm before each GELU if ``use_bn``), L2 normalisation of the
    bottleneck, then ``last_layer``: a weight-normalised linear map to ``out_dim``
    without bias. With ``norm_last_layer`` the norms ``weight_g`` stay fixed at 1
    (not trained), so every prototype has unit norm, which DINO uses for stability
    with ViTs. The trainer freezes ``last_layer`` during the first epoch (``frozen``).
    """

    def __init__(
        self,
        in_dim: int,
        out_dim: int = 65536,
        use_bn: bool = False,
        norm_last_layer: bool = True,
        nlayers: int = 3,
        hidden_dim: int = 2048,
        bottleneck_dim: int = 256,
    ) -> None:
        super().__init__()
        if nlayers < 1:
            raise ValueError(f"DINOHead: nlayers must be >= 1, got {nlayers}")
        dims = [in_dim] + [hidden_dim] * (nlayers - 1) + [bottleneck_dim]
        layers: list[nn.Module] = []
        for i, (a, b) in enumerate(zip(dims[:-1], dims[1:], strict=True)):
            layers.append(nn.Linear(a, b))
            if i < nlayers - 1:  # no activation after the bottleneck projection
                if use_bn:
                    layers.append(nn.BatchNorm1d(b))
                layers.append(nn.GELU())
        self.mlp = layers[0] if len(layers) == 1 else nn.Sequential(*layers)
        self.apply(_init_weights)

        self.last_layer = WeightNormLinear(bottleneck_dim, out_dim)
        self.norm_last_layer = norm_last_layer
        if norm_last_layer:
            self.last_layer.weight_g.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.mlp(x)
        x = F.normalize(x, dim=-1, p=2)
        return self.last_layer(x)


def _normalised(g: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return g * (v / v.norm(dim=1, keepdim=True))


def _init_weights(m: nn.Module) -> None:
    if isinstance(m, nn.Linear):
        nn.init.trunc_normal_(m.weight, std=0.02)
        if m.bias is not None:
            nn.init.zeros_(m.bias)
