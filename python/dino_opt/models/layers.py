"""The layers of the Vision Transformer: stochastic depth (mask and subset
forms), the feed-forward networks (GELU MLP and SwiGLU), LayerScale,
self-attention, the pre-norm block (with its activation checkpointing) and
the patch embedding.

Parameter names follow DINO (v1) and DINOv2, so that their checkpoints load
as they are: ``norm1``, ``attn.qkv``, ``attn.proj``, ``ls1.gamma``,
``norm2``, ``mlp.fc1`` / ``mlp.fc2`` (GELU MLP) or ``mlp.w12`` / ``mlp.w3``
(SwiGLU), ``ls2.gamma``; ``patch_embed.proj``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

__all__ = [
    "CHECKPOINT_POLICIES",
    "FFN_LAYERS",
    "Attention",
    "Block",
    "DropPath",
    "LayerScale",
    "Mlp",
    "PatchEmbed",
    "SwiGLUFFN",
    "drop_path",
    "kept_samples",
    "residual_subset",
    "selective_checkpoint_contexts",
    "swiglu_hidden_dim",
]

#: The feed-forward kinds a block takes. ``swiglu`` and ``swiglufused`` are
#: the same network (DINOv2 maps both to its fused SwiGLU and its hidden size).
FFN_LAYERS = ("mlp", "swiglu", "swiglufused")

#: Activation checkpointing of a block (``Block.checkpointing``): ``none``
#: keeps every activation its backward needs; ``full`` keeps only the block's
#: input and recomputes the block in the backward pass; ``selective`` keeps
#: the outputs of the matrix products (linear layers) and of attention, and
#: recomputes the cheap rest (norms, GELU/SiLU, LayerScale, drop path, adds).
CHECKPOINT_POLICIES = ("none", "full", "selective")

# The operators whose outputs selective checkpointing keeps: what a linear
# layer and scaled_dot_product_attention lower to below autograd, on every
# device (the math attention of float64 and of masks lowers to bmm and softmax).
_SAVED_OPS = frozenset(
    getattr(torch.ops.aten, name).default
    for name in ("mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_flash_attention",
                 "_scaled_dot_product_flash_attention_for_cpu",
                 "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
                 "_scaled_dot_product_fused_attention_overrideable")
    if hasattr(torch.ops.aten, name)
)  # fmt: skip


def _keep_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def selective_checkpoint_contexts():
    """The context pair of torch's selective activation checkpointing
    (``checkpoint(..., context_fn=selective_checkpoint_contexts)``) that keeps
    the matrix products' and attention's outputs and recomputes the rest."""
    return create_selective_checkpoint_contexts(_keep_matmuls)


def drop_path(x: torch.Tensor, p: float = 0.0, training: bool = False) -> torch.Tensor:
    """Stochastic depth: zero the residual branch ``x`` of whole samples with
    probability ``p`` and scale the kept ones by ``1 / (1 - p)`` so that the
    expectation is unchanged. Identity when ``p == 0`` or not ``training``."""
    if p == 0.0 or not training:
        return x
    keep = 1.0 - p
    # One Bernoulli draw per sample, broadcast over tokens and channels.
    mask = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep)
    return x * mask.div_(keep)


def kept_samples(batch: int, p: float) -> int:
    """How many of ``batch`` samples a subset drop-path keeps: ``batch * (1 - p)``
    rounded down, at least one (DINOv3's count: a fixed number, so that the
    shapes, and a compiled graph, do not change from step to step)."""
    return max(int(batch * (1.0 - p)), 1)


def residual_subset(
    x: torch.Tensor, branch: Callable[[torch.Tensor], torch.Tensor], index: torch.Tensor
) -> torch.Tensor:
    """``x + branch`` on the samples ``index`` only, scaled by ``batch / len(index)``:
    stochastic depth computed on the kept samples, equal to the mask form
    (``x + branch(x) * mask * batch / kept``) for the same draw."""
    out = branch(x.index_select(0, index))
    return torch.index_add(x, 0, index, out.to(x.dtype), alpha=x.shape[0] / index.numel())


class DropPath(nn.Module):
    """Module form of :func:`drop_path` (active in training mode only);
    :meth:`add` is the subset form the ViT blocks use."""

    def __init__(self, p: float = 0.0) -> None:
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"DropPath: p must be in [0, 1), got {p!r}")
        self.p = float(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return drop_path(x, self.p, self.training)

    def add(self, x: torch.Tensor, branch: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """``x + DropPath(branch(x))`` computed on the kept samples only
        (:func:`kept_samples`, drawn by ``randperm``): the dropped samples'
        branch is never run. ``x + branch(x)`` in eval mode, at ``p == 0``, or
        where the count keeps every sample."""
        b = x.shape[0]
        kept = kept_samples(b, self.p)
        if not self.training or self.p == 0.0 or kept == b:
            return x + branch(x)
        return residual_subset(x, branch, torch.randperm(b, device=x.device)[:kept])

    def extra_repr(self) -> str:
        return f"p={self.p}"


class Mlp(nn.Module):
    """Two-layer feed-forward network of a transformer block: Linear-GELU-Linear."""

    def __init__(self, dim: int, hidden_dim: int, bias: bool = True) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden_dim, bias=bias)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden_dim, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def swiglu_hidden_dim(mlp_hidden: int) -> int:
    """DINOv2's SwiGLU width for a block whose GELU MLP would be ``mlp_hidden``
    wide: two thirds of it, rounded up to a multiple of 8 (so the parameter
    count stays that of the MLP). ViT-g: 6144 -> 4096."""
    return (int(mlp_hidden * 2 / 3) + 7) // 8 * 8


class SwiGLUFFN(nn.Module):
    """SwiGLU feed-forward network: ``w3(silu(a) * b)`` where ``(a, b)`` are
    the two halves of ``w12(x)`` (one fused projection, as DINOv2 stores it)."""

    def __init__(self, dim: int, hidden_dim: int, bias: bool = True) -> None:
        super().__init__()
        self.w12 = nn.Linear(dim, 2 * hidden_dim, bias=bias)
        self.w3 = nn.Linear(hidden_dim, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.w12(x).chunk(2, dim=-1)
        return self.w3(F.silu(a) * b)


class LayerScale(nn.Module):
    """Per-channel scale ``gamma`` of a residual branch (CaiT), initialised to
    ``init_values`` (DINOv2 trains with 1e-5)."""

    def __init__(self, dim: int, init_values: float = 1e-5) -> None:
        super().__init__()
        self.init_values = float(init_values)
        self.gamma = nn.Parameter(torch.full((dim,), self.init_values))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gamma

    def extra_repr(self) -> str:
        return f"init_values={self.init_values}"


class Attention(nn.Module):
    """Multi-head self-attention with a fused qkv projection, through
    ``scaled_dot_product_attention`` (flash / memory-efficient kernels on GPUs)."""

    def __init__(
        self, dim: int, num_heads: int, qkv_bias: bool = True, proj_bias: bool = True
    ) -> None:
        super().__init__()
        if dim % num_heads != 0:
            raise ValueError(f"Attention: dim {dim} is not divisible by num_heads {num_heads}")
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim**-0.5
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim, bias=proj_bias)

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, n, c = x.shape
        # (B, N, 3*C) -> (3, B, heads, N, head_dim); unbind, not indexing: one
        # stack in backward instead of three zero-filled selects added up
        qkv = self.qkv(x).reshape(b, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        return qkv.unbind(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        q, k, v = self._qkv(x)
        out = F.scaled_dot_product_attention(q, k, v)
        return self.proj(out.transpose(1, 2).reshape(b, n, c))

    def attention_weights(self, x: torch.Tensor) -> torch.Tensor:
        """The softmax attention matrix, shape (B, heads, N, N), computed explicitly
        (the fused kernels never materialise it)."""
        q, k, _ = self._qkv(x)
        return ((q * self.scale) @ k.transpose(-2, -1)).softmax(dim=-1)


def _ffn(kind: str, dim: int, mlp_ratio: float, bias: bool) -> nn.Module:
    hidden = int(dim * mlp_ratio)
    if kind == "mlp":
        return Mlp(dim, hidden, bias=bias)
    if kind in ("swiglu", "swiglufused"):
        return SwiGLUFFN(dim, swiglu_hidden_dim(hidden), bias=bias)
    raise ValueError(f"ffn_layer must be one of {', '.join(FFN_LAYERS)}, got {kind!r}")


class Block(nn.Module):
    """Pre-norm transformer block: ``x + DP(LS1(Attn(LN(x))))`` then
    ``x + DP(LS2(FFN(LN(x))))``; LayerScale (``ls1``, ``ls2``) only when
    ``init_values`` is set (identities otherwise, as in DINO v1).

    ``checkpointing`` (one of :data:`CHECKPOINT_POLICIES`, ``none`` by
    default) checkpoints the block's own forward while training with autograd
    on, through torch's non-reentrant checkpoint: it restores the RNG state for
    the recomputation, so drop path draws the same masks. Being inside the
    block's ``forward``, it is inside whatever wraps the block's call
    (``torch.compile`` of the block, FSDP's hooks)."""

    def __init__(
        self,
        dim: int,
        num_heads: int,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        drop_path: float = 0.0,
        norm_eps: float = 1e-6,
        *,
        proj_bias: bool = True,
        ffn_bias: bool = True,
        ffn_layer: str = "mlp",
        init_values: float | None = None,
    ) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=norm_eps)
        self.attn = Attention(dim, num_heads, qkv_bias=qkv_bias, proj_bias=proj_bias)
        self.ls1 = LayerScale(dim, init_values) if init_values else nn.Identity()
        self.drop_path = DropPath(drop_path)
        self.norm2 = nn.LayerNorm(dim, eps=norm_eps)
        self.mlp = _ffn(ffn_layer, dim, mlp_ratio, ffn_bias)
        self.ls2 = LayerScale(dim, init_values) if init_values else nn.Identity()
        self.checkpointing = "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpointing == "none" or not (self.training and torch.is_grad_enabled()):
            return self._forward(x)
        if self.checkpointing == "selective":
            return checkpoint(self._forward, x, use_reentrant=False,
                              context_fn=selective_checkpoint_contexts)  # fmt: skip
        return checkpoint(self._forward, x, use_reentrant=False)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.drop_path.add(x, lambda t: self.ls1(self.attn(self.norm1(t))))
        return self.drop_path.add(x, lambda t: self.ls2(self.mlp(self.norm2(t))))

    def extra_repr(self) -> str:
        return "" if self.checkpointing == "none" else f"checkpointing={self.checkpointing}"


class PatchEmbed(nn.Module):
    """Non-overlapping ``patch_size`` x ``patch_size`` patches projected to ``embed_dim``
    by a strided convolution; returns tokens of shape (B, num_patches, embed_dim)."""

    def __init__(
        self, img_size: int = 224, patch_size: int = 16, in_chans: int = 3, embed_dim: int = 768
    ) -> None:
        super().__init__()
        self.img_size = img_size
        self.patch_size = patch_size
        self.num_patches = (img_size // patch_size) ** 2
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).flatten(2).transpose(1, 2)
