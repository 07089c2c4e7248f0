"""Vision Transformer as used by DINO (Caron et al., 2021; Dosovitskiy et al., 2021).

Pre-norm transformer blocks over a CLS token and non-overlapping patch tokens,
learned position embeddings (interpolated bicubically for other input sizes, so
that 96x96 local crops go through the same network as 224x224 global crops),
stochastic depth with a linear schedule over the blocks, and a final LayerNorm.
The forward pass returns the normalised CLS token.

Attention goes through ``torch.nn.functional.scaled_dot_product_attention``,
which dispatches to flash / memory-efficient kernels on GPUs. Blocks can be
gradient-checkpointed (``set_grad_checkpointing``) to trade compute for memory.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = [
    "Attention",
    "Block",
    "DropPath",
    "Mlp",
    "PatchEmbed",
    "VisionTransformer",
    "drop_path",
    "pos_embed_grid",
    "resize_pos_embed",
    "vit_base",
    "vit_small",
    "vit_tiny",
]


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


class DropPath(nn.Module):
    """Module form of :func:`drop_path` (active in training mode only)."""

    def __init__(self, p: float = 0.0) -> None:
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"DropPath: p must be in [0, 1), got {p!r}")
        self.p = float(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return drop_path(x, self.p, self.training)

    def extra_repr(self) -> str:
        return f"p={self.p}"


class Mlp(nn.Module):
    """Two-layer feed-forward network of a transformer block: Linear-GELU-Linear."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden_dim)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden_dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Attention(nn.Module):
    """Multi-head self-attention with a fused qkv projection (with bias)."""

    def __init__(self, dim: int, num_heads: int, qkv_bias: bool = True) -> None:
        super().__init__()
        if dim % num_heads != 0:
            raise ValueError(f"Attention: dim {dim} is not divisible by num_heads {num_heads}")
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim**-0.5
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, n, c = x.shape
        # (B, N, 3*C) -> (3, B, heads, N, head_dim)
        qkv = self.qkv(x).reshape(b, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        return qkv[0], qkv[1], qkv[2]

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


class Block(nn.Module):
    """Pre-norm transformer block: ``x + DP(Attn(LN(x)))`` then ``x + DP(MLP(LN(x)))``."""

    def __init__(
        self,
        dim: int,
        num_heads: int,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        drop_path: float = 0.0,
        norm_eps: float = 1e-6,
    ) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=norm_eps)
        self.attn = Attention(dim, num_heads, qkv_bias=qkv_bias)
        self.drop_path = DropPath(drop_path)
        self.norm2 = nn.LayerNorm(dim, eps=norm_eps)
        self.mlp = Mlp(dim, int(dim * mlp_ratio))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop_path(self.attn(self.norm1(x)))
        return x + self.drop_path(self.mlp(self.norm2(x)))


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


class VisionTransformer(nn.Module):
    """DINO's Vision Transformer backbone; ``forward`` returns the CLS feature (B, embed_dim).

    Args:
        img_size: side of the images the position table is made for (224).
        patch_size: patch side (16 or 8 in DINO).
        in_chans: input channels.
        embed_dim, depth, num_heads, mlp_ratio, qkv_bias: the transformer's shape.
        drop_path_rate: stochastic depth rate of the last block; block ``i`` uses
            ``drop_path_rate * i / (depth - 1)`` (linear schedule from 0).
        norm_eps: LayerNorm epsilon (1e-6 as in DINO).
    """

    def __init__(
        self,
        img_size: int = 224,
        patch_size: int = 16,
        in_chans: int = 3,
        embed_dim: int = 768,
        depth: int = 12,
        num_heads: int = 12,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        drop_path_rate: float = 0.0,
        norm_eps: float = 1e-6,
    ) -> None:
        super().__init__()
        self.embed_dim = self.num_features = embed_dim
        self.patch_size = patch_size
        self.depth = depth
        self.drop_path_rate = float(drop_path_rate)
        self.grad_checkpointing = False

        self.patch_embed = PatchEmbed(img_size, patch_size, in_chans, embed_dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, self.patch_embed.num_patches + 1, embed_dim))
        # Plain Python (not torch.linspace) so that construction works on the meta device.
        rates = [drop_path_rate * i / max(depth - 1, 1) for i in range(depth)]
        self.blocks = nn.ModuleList(
            Block(embed_dim, num_heads, mlp_ratio, qkv_bias, drop_path=r, norm_eps=norm_eps)
            for r in rates
        )
        self.norm = nn.LayerNorm(embed_dim, eps=norm_eps)

        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        nn.init.trunc_normal_(self.cls_token, std=0.02)
        self.apply(_init_weights)

    def set_grad_checkpointing(self, enable: bool = True) -> VisionTransformer:
        """Recompute each block's activations in the backward pass instead of storing
        them (only while training with autograd on). Returns ``self``."""
        self.grad_checkpointing = bool(enable)
        return self

    def interpolate_pos_encoding(self, x: torch.Tensor, h: int, w: int) -> torch.Tensor:
        """Position embeddings for an ``h`` x ``w`` image whose tokens (CLS + patches) are ``x``
        (B, 1 + n, C): the learned table itself at the native grid, otherwise the
        patch part resized bicubically to the new grid (the CLS entry is kept)."""
        npatch = x.shape[1] - 1
        gh, gw = h // self.patch_size, w // self.patch_size
        if npatch == self.pos_embed.shape[1] - 1 and (gh, gw) == pos_embed_grid(self.pos_embed):
            return self.pos_embed
        return resize_pos_embed(self.pos_embed, (gh, gw))

    def prepare_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """Images (B, C, H, W) -> CLS + patch tokens with position embeddings (B, 1 + n, C)."""
        b, _, h, w = x.shape
        x = self.patch_embed(x)
        # cat promotes to the wider dtype, so under autocast the residual stream is fp32.
        x = torch.cat((self.cls_token.expand(b, -1, -1), x), dim=1)
        return x + self.interpolate_pos_encoding(x, h, w)

    def _run_block(self, block: Block, x: torch.Tensor) -> torch.Tensor:
        if self.grad_checkpointing and self.training and torch.is_grad_enabled():
            # Non-reentrant checkpointing restores the RNG state, so drop_path draws
            # the same mask in the recomputation.
            return checkpoint(block, x, use_reentrant=False)
        return block(x)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """All tokens after the final norm, shape (B, 1 + n, embed_dim)."""
        x = self.prepare_tokens(x)
        for block in self.blocks:
            x = self._run_block(block, x)
        return self.norm(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_features(x)[:, 0]

    def get_intermediate_layers(self, x: torch.Tensor, n: int = 1) -> list[torch.Tensor]:
        """Outputs (all tokens, after the final norm) of the last ``n`` blocks."""
        if not 1 <= n <= len(self.blocks):
            raise ValueError(f"get_intermediate_layers: n must be in [1, {len(self.blocks)}]")
        x = self.prepare_tokens(x)
        out = []
        for i, block in enumerate(self.blocks):
            x = self._run_block(block, x)
            if i >= len(self.blocks) - n:
                out.append(self.norm(x))
        return out

    def get_last_selfattention(self, x: torch.Tensor) -> torch.Tensor:
        """Attention weights of the last block, shape (B, heads, 1 + n, 1 + n)."""
        x = self.prepare_tokens(x)
        for block in self.blocks[:-1]:
            x = self._run_block(block, x)
        last = self.blocks[-1]
        return last.attn.attention_weights(last.norm1(x))


def pos_embed_grid(pos_embed: torch.Tensor) -> tuple[int, int]:
    """The (square) patch grid of a position table (1, 1 + g * g, C)."""
    g = math.isqrt(pos_embed.shape[1] - 1)
    if g * g != pos_embed.shape[1] - 1:
        raise ValueError(
            f"a position table of {pos_embed.shape[1] - 1} patches is not a square grid"
        )
    return g, g


def resize_pos_embed(pos_embed: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """A position table (1, 1 + n, C) for a ``grid`` of (rows, cols) patches:
    the CLS entry kept, the patch entries resized bicubically (no antialias,
    align_corners False). What the ViT does for inputs of another size, so a
    table exported at that size gives the same features."""
    g, _ = pos_embed_grid(pos_embed)
    if tuple(grid) == (g, g):
        return pos_embed
    cls_pos = pos_embed[:, :1]
    patch_pos = pos_embed[:, 1:].reshape(1, g, g, -1).permute(0, 3, 1, 2)
    patch_pos = F.interpolate(patch_pos, size=tuple(grid), mode="bicubic", align_corners=False)
    patch_pos = patch_pos.permute(0, 2, 3, 1).reshape(1, grid[0] * grid[1], -1)
    return torch.cat((cls_pos, patch_pos), dim=1)


def _init_weights(m: nn.Module) -> None:
    # DINO: truncated normal (std 0.02) linear weights, zero biases, unit LayerNorm;
    # the patch convolution keeps PyTorch's default init.
    if isinstance(m, nn.Linear):
        nn.init.trunc_normal_(m.weight, std=0.02)
        if m.bias is not None:
            nn.init.zeros_(m.bias)
    elif isinstance(m, nn.LayerNorm):
        nn.init.ones_(m.weight)
        nn.init.zeros_(m.bias)


def vit_tiny(patch_size: int = 16, **kwargs) -> VisionTransformer:
    """ViT-Tiny: embed 192, depth 12, 3 heads (5.5M parameters at patch 16)."""
    return VisionTransformer(
        patch_size=patch_size, embed_dim=192, depth=12, num_heads=3, mlp_ratio=4.0, **kwargs
    )


def vit_small(patch_size: int = 16, **kwargs) -> VisionTransformer:
    """ViT-Small: embed 384, depth 12, 6 heads (21.7M parameters at patch 16)."""
    return VisionTransformer(
        patch_size=patch_size, embed_dim=384, depth=12, num_heads=6, mlp_ratio=4.0, **kwargs
    )


def vit_base(patch_size: int = 16, **kwargs) -> VisionTransformer:
    """ViT-Base: embed 768, depth 12, 12 heads (85.8M parameters at patch 16)."""
    return VisionTransformer(
        patch_size=patch_size, embed_dim=768, depth=12, num_heads=12, mlp_ratio=4.0, **kwargs
    )
