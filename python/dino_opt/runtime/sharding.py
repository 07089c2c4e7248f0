"""FSDP2 on the student and the teacher (``distributed.strategy: fsdp``).

:func:`shard_model` applies torch's ``fully_shard`` to each transformer block
of a multi-crop network, then to each head, then to the network itself (which
holds the patch embedding, the tokens and the last norm), so that every rank
keeps 1/world of the parameters, gradients and optimizer state and gathers one
block at a time. The parameters become ``DTensor`` shards (the fused EMA
updates the teacher's local shards from the student's, which line up
because both networks are sharded the same way); a reduction over them comes
back as a replicated ``DTensor`` (:func:`replicated` makes it a plain tensor:
the gradient norm). :func:`fsdp_no_sync` is the accumulation counterpart of
DistributedDataParallel's ``no_sync``. :func:`shard_frozen_backbone` shards a
frozen copy of the teacher's backbone (the dinov3 recipe's Gram teacher) as
the teacher's backbone is, so that their local shards line up too.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    FSDPModule,
    MixedPrecisionPolicy,
    fully_shard,
    register_fsdp_forward_method,
)
from torch.distributed.tensor import DTensor

__all__ = [
    "FSDPModule",
    "fsdp_no_sync",
    "is_sharded",
    "mixed_precision_policy",
    "replicated",
    "shard_frozen_backbone",
    "shard_model",
]

# Methods other than forward that the job calls on a sharded network: they
# must gather the parameters as forward does.
_FORWARD_METHODS = ("forward_backbone",)
# Those it calls on a sharded frozen backbone (the Gram teacher's patch tokens).
_BACKBONE_FORWARD_METHODS = ("forward_features",)


def is_sharded(module: nn.Module) -> bool:
    """Whether ``module`` went through ``fully_shard``."""
    return isinstance(module, FSDPModule)


def replicated(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor of a reduction's result: a ``DTensor`` made whole (a
    gradient norm over shards comes back replicated, so this needs no
    communication), any other tensor unchanged."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def mixed_precision_policy(param_dtype: torch.dtype | None) -> MixedPrecisionPolicy:
    """Parameters gathered in ``param_dtype`` (bf16 from the config's
    precision; None: as stored, float32), gradients reduced in float32."""
    if param_dtype is None:
        return MixedPrecisionPolicy()
    if param_dtype != torch.bfloat16:
        raise ValueError(
            f"distributed.strategy=fsdp supports hardware.precision bf16 or fp32, not "
            f"{param_dtype} (fp16's gradient scaler does not reduce its overflow check over shards)"
        )
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _blocks(model: nn.Module) -> list[nn.Module]:
    blocks = getattr(getattr(model, "backbone", None), "blocks", None)
    if not isinstance(blocks, nn.ModuleList) or len(blocks) == 0:
        backbone = type(getattr(model, "backbone", model)).__name__
        raise ValueError(
            f"distributed.strategy=fsdp shards a ViT backbone block by block; {backbone} has no "
            "transformer blocks (use distributed.strategy=ddp for a ResNet)"
        )
    return list(blocks)


def shard_model(
    model: nn.Module,
    param_dtype: torch.dtype | None = None,
    *,
    reshard_after_forward: bool = True,
    mesh: DeviceMesh | None = None,
) -> nn.Module:
    """``fully_shard`` on each of ``model.backbone.blocks``, each other child
    with parameters (the heads), then ``model`` (in place; returned), over
    ``mesh``'s ranks (default: all of them). A
    model of several networks trained together (``members``, a ModuleDict:
    a distillation's students) has each member sharded so, then the whole.
    The process group must be up. ``reshard_after_forward`` applies to the
    blocks and heads; the root follows it too, so that a network used only
    forward (the teacher) holds no gathered parameters between steps."""
    policy = mixed_precision_policy(param_dtype)
    options = dict(mp_policy=policy, reshard_after_forward=reshard_after_forward, mesh=mesh)
    members = getattr(model, "members", None)
    if isinstance(members, nn.ModuleDict):
        for member in members.values():
            _shard_units(member, options)
            fully_shard(member, **options)
    else:
        _shard_units(model, options)
    fully_shard(model, **options)
    for method in _FORWARD_METHODS:
        if hasattr(model, method):
            register_fsdp_forward_method(model, method)
    return model


def _shard_units(model: nn.Module, options: dict) -> None:
    """``fully_shard`` on each block of ``model``'s backbone and each other
    child with parameters (its heads)."""
    for block in _blocks(model):
        fully_shard(block, **options)
    for name, child in model.named_children():
        if name != "backbone" and any(True for _ in child.parameters()):
            fully_shard(child, **options)


def shard_frozen_backbone(backbone: nn.Module, param_dtype: torch.dtype | None = None) -> nn.Module:
    """``fully_shard`` on each of ``backbone.blocks``, then on ``backbone``
    (in place; returned): a frozen copy of the teacher's backbone, sharded as
    :func:`shard_model` shards the teacher's (the same units' parameters, the
    same placements, the same mixed precision), so that copying the
    teacher's weights into it is a copy of local shards. It runs forward
    only, so every unit, the root too, frees its gathered parameters after
    each forward; ``forward_features`` gathers them as ``forward`` does."""
    blocks = getattr(backbone, "blocks", None)
    if not isinstance(blocks, nn.ModuleList) or len(blocks) == 0:
        raise ValueError(
            f"distributed.strategy=fsdp shards a ViT backbone block by block; "
            f"{type(backbone).__name__} has no transformer blocks"
        )
    options = dict(mp_policy=mixed_precision_policy(param_dtype), reshard_after_forward=True)
    for block in blocks:
        fully_shard(block, **options)
    fully_shard(backbone, **options)
    for method in _BACKBONE_FORWARD_METHODS:
        if hasattr(backbone, method):
            register_fsdp_forward_method(backbone, method)
    return backbone


@contextlib.contextmanager
def fsdp_no_sync(module: FSDPModule):
    """Backward passes that accumulate gradients on every rank without
    reduce-scattering them, and keep the gathered parameters for the next
    micro-batch instead of resharding after each (the step's last backward,
    outside this context, reduces and reshards)."""
    module.set_requires_gradient_sync(False)
    module.set_reshard_after_backward(False)
    try:
        yield
    finally:
        module.set_requires_gradient_sync(True)
        module.set_reshard_after_backward(True)
