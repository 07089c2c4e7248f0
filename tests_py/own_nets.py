"""Networks of a user's own, named by the distillation tests as
``own_nets:FUNCTION`` students (``package.module:function``)."""

import os
from pathlib import Path

import torch
from torch import nn


def small_cnn() -> nn.Module:
    """A two-convolution network whose forward gives a stride-8 feature map."""
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, stride=2, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.Conv2d(16, 24, 3, stride=4, padding=1),
        nn.ReLU(),
    )


def pooled() -> nn.Module:
    """A network that gives pooled features only ([B, C]): nothing per patch."""
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten())


def two_outputs() -> nn.Module:
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 8, 3)

        def forward(self, x):
            y = self.conv(x)
            return y, y

    return Two()


def not_a_module():
    return torch.zeros(3)


def fails():
    raise RuntimeError("no weights here")


def noted_cnn() -> nn.Module:
    """:func:`small_cnn`, its call noted: the file ``$OWN_NETS_NOTE`` is created."""
    Path(os.environ["OWN_NETS_NOTE"]).touch()
    return small_cnn()
