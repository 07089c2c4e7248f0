"""The layers of the Vision Transformer: stochastic depth (mask and subset
forms), the feed-forward networks (GELU MLP and SwiGLU), LayerScale,
self-attention, the pre-norm block (with its activation checkpointing) and
the patch embedding. Attention and the block take a batch (B, N, C) or the
packed rows of several crop sizes.

Packed crops: a ViT's token-wise layers (norms, the feed-forward network,
the q/k/v and output projections, LayerScale, the residual adds) do not
care which image a token belongs to, so the global and the local crops of a
step go through them together, as one (rows, channels) matrix: one matrix
product per layer instead of one per crop size. Only attention needs the
crops apart; it reads each crop size's rows as a (batch, tokens, channels)
view of the stream. A :data:`Layout` says how the rows are laid out: the
(batch, tokens) of each crop size, in order; it is made of Python ints, so
that a compiled block keeps one graph per layout.

Parameter names follow DINO (v1) and DINOv2, so that their checkpoints load
as they are: ``norm1``, ``attn.qkv``, ``attn.proj``, ``ls1.gamma``,
``norm2``, ``mlp.fc1`` / ``mlp.fc2`` (GELU MLP) or ``mlp.w12`` / ``mlp.w3``
(SwiGLU), ``ls2.gamma``; ``patch_embed.proj``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

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
    "Layout",
    "Mlp",
    "PatchEmbed",
    "SwiGLUFFN",
    "autocast_stream",
    "drop_path",
    "kept_rows",
    "kept_samples",
    "pack",
    "recompute_flops_per_byte",
    "residual_subset",
    "selective_checkpoint_contexts",
    "swiglu_hidden_dim",
    "unpack",
]

#: (batch, tokens) of each crop size in a packed stream, in order.
Layout = tuple[tuple[int, int], ...]


def autocast_stream(x: torch.Tensor) -> torch.Tensor:
    """The residual stream ``x`` in bfloat16 where bfloat16 autocast is on
    for its device (unchanged otherwise): the blocks' norms, adds and
    LayerScale then run on half the bytes, and no layer converts its input
    to float32 and back. Float16 autocast keeps a float32 stream (its range
    is too narrow for the residual sums)."""
    device = x.device.type
    if torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) == torch.bfloat16:
        return x.to(torch.bfloat16)
    return x


def pack(tokens: Sequence[torch.Tensor]) -> tuple[torch.Tensor, Layout]:
    """Token batches (B_i, N_i, C) as one stream (sum of B_i N_i, C) and its
    layout (a view, not a copy, for a single batch)."""
    if len(tokens) == 0:
        raise ValueError("pack: no token batches given")
    layout = tuple((int(t.shape[0]), int(t.shape[1])) for t in tokens)
    if len(tokens) == 1:
        return tokens[0].flatten(0, 1), layout
    return torch.cat([t.flatten(0, 1) for t in tokens]), layout


def unpack(rows: torch.Tensor, layout: Layout) -> list[torch.Tensor]:
    """The (B_i, N_i, C) views of a packed stream ``rows``."""
    parts = rows.split([b * n for b, n in layout]) if len(layout) > 1 else (rows,)
    return [part.view(b, n, rows.shape[-1]) for part, (b, n) in zip(parts, layout, strict=True)]


def kept_rows(
    samples: Sequence[torch.Tensor | None], layout: Layout, device: torch.device
) -> torch.Tensor:
    """The rows of a packed stream that hold the samples ``samples[i]`` of
    crop size ``i`` (None: all of them), in that order: what a subset drop
    path gathers, runs its branch on and adds back."""
    rows, offset = [], 0
    for index, (b, n) in zip(samples, layout, strict=True):
        if index is None:
            rows.append(torch.arange(offset, offset + b * n, device=device))
        else:
            tokens = torch.arange(n, device=device)
            rows.append((index.unsqueeze(1) * n + tokens + offset).flatten())
        offset += b * n
    return rows[0] if len(rows) == 1 else torch.cat(rows)


#: The feed-forward kinds a block takes. ``swiglu`` and ``swiglufused`` are
#: the same network (DINOv2 maps both to its fused SwiGLU and its hidden size).
FFN_LAYERS = ("mlp", "swiglu", "swiglufused")

#: Activation checkpointing of a block (``Block.checkpointing``): ``none``
#: keeps every activation its backward needs; ``full`` keeps only the block's
#: input and recomputes the block in the backward pass; ``selective`` keeps
#: the outputs of the matrix products (linear layers) and of attention whose
#: recomputation costs at least the block's ``recompute_threshold`` FLOPs
#: per byte kept (0: all of them), and recomputes the cheap rest (norms,
#: GELU/SiLU, LayerScale, drop path, adds).
CHECKPOINT_POLICIES = ("none", "full", "selective")

_MATMULS = frozenset(
    getattr(torch.ops.aten, name).default for name in ("mm", "addmm", "bmm", "baddbmm")
)
# What scaled_dot_product_attention lowers to below autograd, on every device
# (the math attention of float64 and of masks lowers to bmm and softmax).
_ATTENTION = frozenset(
    getattr(torch.ops.aten, name).default
    for name in (
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_fused_attention_overrideable",
    )
    if hasattr(torch.ops.aten, name)
)


def recompute_flops_per_byte(op, *args) -> float | None:
    """What recomputing ``op``'s output costs per byte of it kept: a matrix
    product's ``2 K / s`` (K its reduction's length, s the bytes of a value:
    2 M N K FLOPs for M N values); attention's ``4 Nk d / (d s + 4)`` per
    head and query (its two products over Nk keys, for the output row and
    its float32 log-sum-exp). None for every other operator (elementwise,
    norms: a few FLOPs a value, always recomputed by ``selective``)."""
    if op in _MATMULS:
        a = (
            args[1]
            if op in (torch.ops.aten.addmm.default, torch.ops.aten.baddbmm.default)
            else args[0]
        )
        return 2.0 * a.shape[-1] / a.element_size()
    if op in _ATTENTION:
        q, k = args[0], args[1]
        d = q.shape[-1]
        return 4.0 * k.shape[-2] * d / (d * q.element_size() + 4)
    return None


def _keep_intensive(
    threshold: float, unread: frozenset, ctx, op, *args, **kwargs
) -> CheckpointPolicy:
    cost = recompute_flops_per_byte(op, *args)
    if cost is None or cost < threshold:
        return CheckpointPolicy.PREFER_RECOMPUTE
    if threshold > 0 and op in _MATMULS and (args[-2].shape[-1], args[-1].shape[-1]) in unread:
        return CheckpointPolicy.PREFER_RECOMPUTE  # kept, it would save no recomputation
    return CheckpointPolicy.MUST_SAVE


def selective_checkpoint_contexts(threshold: float = 0.0, unread: frozenset = frozenset()):
    """The context pair of torch's selective activation checkpointing
    (``checkpoint(..., context_fn=...)``). At ``threshold`` 0 it keeps every
    matrix product's and attention's output; above, those whose
    recomputation costs at least ``threshold`` FLOPs per byte kept
    (:func:`recompute_flops_per_byte`) and that the backward reads: not the
    products of input and output widths in ``unread`` (a block's last
    feed-forward layer without LayerScale, whose output only the residual
    add takes). It recomputes the rest."""
    policy = functools.partial(_keep_intensive, threshold, frozenset(unread))
    return create_selective_checkpoint_contexts(policy)


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

    def add(self, x: torch.Tensor, branch: Callable, layout: Layout | None = None) -> torch.Tensor:
        """``x + DropPath(branch(x))`` computed on the kept samples only
        (:func:`kept_samples`, drawn by ``randperm``): the dropped samples'
        branch is never run. ``x + branch(x)`` in eval mode, at ``p == 0``, or
        where the count keeps every sample. With a ``layout``, ``x`` is the
        packed rows of several crop sizes, each drawn on its own, and the
        branch is called as ``branch(rows, layout_of_rows)``."""
        if layout is None:
            b = x.shape[0]
            kept = kept_samples(b, self.p)
            if not self.training or self.p == 0.0 or kept == b:
                return x + branch(x)
            return residual_subset(x, branch, torch.randperm(b, device=x.device)[:kept])
        sizes = [b for b, _ in layout]
        kept = [kept_samples(b, self.p) for b in sizes]
        if not self.training or self.p == 0.0 or kept == sizes:
            return x + branch(x, layout)
        draws = [
            None if k == b else torch.randperm(b, device=x.device)[:k]
            for k, b in zip(kept, sizes, strict=True)
        ]
        rows = kept_rows(draws, layout, x.device)
        out = branch(
            x.index_select(0, rows), tuple((k, n) for k, (_, n) in zip(kept, layout, strict=True))
        )
        scales = [b / k for k, b in zip(kept, sizes, strict=True)]
        if len(set(scales)) == 1:
            return torch.index_add(x, 0, rows, out.to(x.dtype), alpha=scales[0])
        # each crop size's kept rows scaled by its own batch / kept
        scale = torch.cat(
            [
                torch.full((k * n, 1), a, dtype=x.dtype, device=x.device)
                for a, k, (_, n) in zip(scales, kept, layout, strict=True)
            ]
        )
        return torch.index_add(x, 0, rows, out.to(x.dtype) * scale)

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
        # in the stream's dtype: a bfloat16 stream stays bfloat16
        return x * self.gamma.to(x.dtype)

    def extra_repr(self) -> str:
        return f"init_values={self.init_values}"


#: The largest score matrix (bytes) the CPU's bfloat16 attention forms; past
#: it, the flash kernel, which never forms it.
CPU_SCORES_BYTES = 256 * 2**20


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``scaled_dot_product_attention(q, k, v)``. On the CPU in bfloat16 or
    float16 as two matrix products in that dtype around a softmax (whose
    kernel accumulates in float32): they run at the CPU's bfloat16 rate,
    where its flash kernel and the math backend (which computes in float32)
    do not (docs/training.md, "The step"); only up to
    :data:`CPU_SCORES_BYTES` of scores."""
    half = q.dtype in (torch.bfloat16, torch.float16)
    if half and q.device.type == "cpu":
        scores = q.shape[:-1].numel() * k.shape[-2] * q.element_size()
        if scores <= CPU_SCORES_BYTES:
            weights = torch.softmax((q * q.shape[-1] ** -0.5) @ k.transpose(-2, -1), dim=-1)
            return weights @ v
    return F.scaled_dot_product_attention(q, k, v)


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
        # (B, N, 3*C) -> (3, B, heads, N, head_dim); unbind, not indexing: one
        # stack in backward instead of three zero-filled selects added up
        b, n, _ = x.shape
        qkv = x.reshape(b, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        return qkv.unbind(0)

    def rotate(
        self, q: torch.Tensor, k: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Queries and keys as attention compares them (this attention has
        no position rotation; :class:`~dino_opt.models.vit_dinov3.RopeAttention` has)."""
        if rope is not None:
            raise ValueError(f"{type(self).__name__} takes no RoPE")
        return q, k

    def forward(self, x: torch.Tensor, rope=None, layout: Layout | None = None) -> torch.Tensor:
        """Attention over a batch ``x`` (B, N, C) (``rope``: its RoPE or None),
        or over the packed rows ``x`` (T, C) of ``layout`` (``rope``: one per
        crop size, or None): the projections run on all rows at once,
        attention within each crop size."""
        if layout is None:
            b, n, c = x.shape
            return self.forward(x.flatten(0, 1), (rope,), ((b, n),)).view(b, n, c)
        ropes = (None,) * len(layout) if rope is None else rope
        outs = []
        for part, r in zip(unpack(self.qkv(x), layout), ropes, strict=True):
            b, n, _ = part.shape
            q, k, v = self._qkv(part)
            q, k = self.rotate(q, k, r)
            out = attend(q, k, v)
            outs.append(out.transpose(1, 2).reshape(b * n, -1))
        return self.proj(outs[0] if len(outs) == 1 else torch.cat(outs))

    def attention_weights(self, x: torch.Tensor, rope=None) -> torch.Tensor:
        """The softmax attention matrix, shape (B, heads, N, N), computed explicitly
        (the fused kernels never materialise it)."""
        q, k, _ = self._qkv(self.qkv(x))
        q, k = self.rotate(q, k, rope)
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
        self.recompute_threshold = 0.0  # selective: FLOPs per byte an output must cost to be kept

    def forward(self, x: torch.Tensor, rope=None, layout: Layout | None = None) -> torch.Tensor:
        """The block over a batch (B, N, C), or over the packed rows (T, C) of
        ``layout`` (``rope``: as :meth:`Attention.forward` takes it)."""
        if self.checkpointing == "none" or not (self.training and torch.is_grad_enabled()):
            return self.residuals(x, rope, layout)
        if self.checkpointing == "selective":
            return checkpoint(
                self.residuals,
                x,
                rope,
                layout,
                use_reentrant=False,
                context_fn=functools.partial(
                    selective_checkpoint_contexts, self.recompute_threshold, self._unread_outputs()
                ),
            )
        return checkpoint(self.residuals, x, rope, layout, use_reentrant=False)

    def _unread_outputs(self) -> frozenset:
        """(input, output) widths of the matrix products whose outputs the
        backward does not read: the feed-forward network's last layer,
        unless LayerScale (whose weight's gradient needs it) follows."""
        if not isinstance(self.ls2, nn.Identity):
            return frozenset()
        last = self.mlp.w3 if isinstance(self.mlp, SwiGLUFFN) else self.mlp.fc2
        return frozenset({(last.in_features, last.out_features)})

    def residuals(self, x: torch.Tensor, rope=None, layout: Layout | None = None) -> torch.Tensor:
        """The block without checkpointing: attention, then feed-forward
        residual, on packed rows (a batch is the rows of one crop size)."""
        if layout is None:
            b, n, c = x.shape
            rope = None if rope is None else (rope,)
            return self.residuals(x.flatten(0, 1), rope, ((b, n),)).view(b, n, c)

        def attention(t: torch.Tensor, lay: Layout) -> torch.Tensor:
            return self.ls1(self.attn(self.norm1(t), rope, lay))

        x = self.drop_path.add(x, attention, layout)
        return self.drop_path.add(x, lambda t, _: self.ls2(self.mlp(self.norm2(t))), layout)

    def extra_repr(self) -> str:
        if self.checkpointing == "selective" and self.recompute_threshold:
            return f"checkpointing=selective, recompute_threshold={self.recompute_threshold:g}"
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
