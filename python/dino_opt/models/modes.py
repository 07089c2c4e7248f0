"""A network's mode for a while: evaluation mode inside a ``with`` block,
the mode of each of its modules (training or not) restored after, whatever
happens inside."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn

__all__ = ["eval_mode"]


@contextlib.contextmanager
def eval_mode(module: nn.Module) -> Iterator[nn.Module]:
    """``module`` in eval mode (BatchNorm from its running statistics, no
    dropout, no layer skipped at random) inside the block; on the way out,
    also when the block raises, each of its modules gets back the mode it
    had (a BatchNorm kept in eval mode inside a training network stays so)."""
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        yield module
    finally:
        for m, training in modes:
            m.training = training
