"""A network's mode for a while, restored after whatever happens inside a
``with`` block: evaluation mode (:func:`eval_mode`), or training mode
whose BatchNorm layers leave their running statistics as they are
(:func:`running_stats_kept`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn

__all__ = ["eval_mode", "running_stats_kept"]

_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


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


@contextlib.contextmanager
def running_stats_kept(module: nn.Module) -> Iterator[nn.Module]:
    """``module`` as it is, except that its BatchNorm layers do not update
    their running statistics inside the block (their momentum 0: a forward
    in training mode still normalises by the batch's statistics); each
    layer's momentum restored after, also when the block raises. For a
    pass over inputs the running statistics must not describe (DINO's local
    crops, when a network is evaluated at the global crops' size)."""
    norms = [m for m in module.modules() if isinstance(m, _BATCH_NORMS)]
    momenta = [m.momentum for m in norms]
    for m in norms:
        m.momentum = 0.0
    try:
        yield module
    finally:
        for m, momentum in zip(norms, momenta, strict=True):
            m.momentum = momentum
