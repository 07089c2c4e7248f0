"""Vision Transformer of DINO (Caron et al., 2021) and DINOv2 (Oquab et al., 2023).

Pre-norm transformer blocks over a CLS token, optional register tokens
(Darcet et al., 2023) and non-overlapping patch tokens, learned position
embeddings for the CLS and patch tokens (resized bicubically for other input
sizes, so that 96x96 local crops go through the same network as 224x224
global crops), stochastic depth, and a final LayerNorm. The DINOv2 options
are off by default, which gives DINO's ViT exactly: LayerScale, SwiGLU
feed-forward layers, register tokens, a mask token for masked patches, bias
switches, uniform stochastic depth and DINOv2's position interpolation
(offset and anti-aliasing). State-dict names are DINO's and DINOv2's.

``forward`` returns the normalised CLS token (B, embed_dim) of a batch or of
a list of crops; ``forward_features`` returns DINOv2's dict of outputs. A
list of crops of several sizes goes through the blocks in one pass, packed
(:mod:`dino_opt.models.layers`): the token-wise layers on all crops'
tokens at once, attention within each crop size.

Attention goes through ``torch.nn.functional.scaled_dot_product_attention``,
which dispatches to flash / memory-efficient kernels on GPUs. Blocks can be
checkpointed, fully or selectively, every block or every n-th
(``set_activation_checkpointing``), to trade compute for memory, and
compiled one by one (:func:`apply_block_options`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .layers import (
    CHECKPOINT_POLICIES,
    FFN_LAYERS,
    Attention,
    Block,
    DropPath,
    LayerScale,
    Mlp,
    PatchEmbed,
    SwiGLUFFN,
    autocast_stream,
    drop_path,
    pack,
    swiglu_hidden_dim,
    unpack,
)
from .wrapper import MultiCropWrapper

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
    "VisionTransformer",
    "apply_block_options",
    "drop_path",
    "pos_embed_grid",
    "resize_pos_embed",
    "swiglu_hidden_dim",
    "vit_base",
    "vit_giant2",
    "vit_large",
    "vit_small",
    "vit_tiny",
]


class VisionTransformer(nn.Module):
    """DINO's and DINOv2's Vision Transformer backbone; ``forward`` returns the
    normalised CLS feature (B, embed_dim), of a batch or of a list of crops
    (``packs_crops``: every size in one pass).

    Args:
        img_size: side of the images the position table is made for (224;
            518 for the published DINOv2 weights).
        patch_size: patch side (16 or 8 in DINO, 14 in DINOv2).
        in_chans: input channels.
        embed_dim, depth, num_heads, mlp_ratio: the transformer's shape.
        qkv_bias, proj_bias, ffn_bias: biases of the qkv projection, of the
            attention's output projection and of the feed-forward layers.
        drop_path_rate: stochastic depth rate; block ``i`` uses
            ``drop_path_rate * i / (depth - 1)`` (linear ramp from 0), or
            ``drop_path_rate`` in every block with ``drop_path_uniform``.
        norm_eps: LayerNorm epsilon (1e-6 as in DINO and DINOv2).
        ffn_layer: ``"mlp"`` (GELU MLP, ``mlp.fc1`` / ``mlp.fc2``) or
            ``"swiglu"`` / ``"swiglufused"`` (SwiGLU of DINOv2's width,
            ``mlp.w12`` / ``mlp.w3``).
        layerscale_init: initial LayerScale value (DINOv2: 1e-5); None or 0:
            no LayerScale. ``init_values`` is DINOv2's name for it.
        num_register_tokens: register tokens, placed after the CLS token
            (DINOv2 with registers: 4); they take no position embedding and
            are left out of the outputs.
        use_mask_token: a learned ``mask_token`` that replaces the embeddings
            of masked patches (``forward_features(x, masks)``, iBOT).
        interpolate_offset: DINOv2's position-interpolation offset (0.1 in
            its published ViTs without registers): the table is resized by
            the scale factor ``(grid + offset) / native grid``; 0 (DINO and
            the default): resized to the grid's size.
        interpolate_antialias: anti-aliased bicubic resizing (DINOv2 with
            registers).
    """

    #: ``forward`` and ``forward_features_list`` run a list of crops of
    #: several sizes in one packed pass (the multi-crop wrappers rely on it).
    packs_crops = True

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
        *,
        proj_bias: bool = True,
        ffn_bias: bool = True,
        ffn_layer: str = "mlp",
        layerscale_init: float | None = None,
        init_values: float | None = None,
        num_register_tokens: int = 0,
        use_mask_token: bool = False,
        drop_path_uniform: bool = False,
        interpolate_offset: float = 0.0,
        interpolate_antialias: bool = False,
    ) -> None:
        super().__init__()
        layerscale_init = _layerscale(layerscale_init, init_values)
        if num_register_tokens < 0:
            raise ValueError(f"num_register_tokens must be >= 0, got {num_register_tokens}")
        self.embed_dim = self.num_features = embed_dim
        self.patch_size = patch_size
        self.img_size = img_size
        self.depth = self.n_blocks = depth
        self.chunked_blocks = False  # DINOv2's attribute: the blocks are one flat list
        self.num_heads = num_heads
        self.ffn_layer = ffn_layer
        self.layerscale_init = layerscale_init
        self.num_register_tokens = int(num_register_tokens)
        self.drop_path_rate = float(drop_path_rate)
        self.drop_path_uniform = bool(drop_path_uniform)
        self.interpolate_offset = float(interpolate_offset)
        self.interpolate_antialias = bool(interpolate_antialias)

        self.patch_embed = PatchEmbed(img_size, patch_size, in_chans, embed_dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, self.patch_embed.num_patches + 1, embed_dim))
        self.register_tokens = (
            nn.Parameter(torch.zeros(1, num_register_tokens, embed_dim))
            if num_register_tokens
            else None
        )
        block = dict(
            proj_bias=proj_bias, ffn_bias=ffn_bias, ffn_layer=ffn_layer, init_values=layerscale_init
        )
        self.blocks = nn.ModuleList(
            Block(
                embed_dim, num_heads, mlp_ratio, qkv_bias, drop_path=r, norm_eps=norm_eps, **block
            )
            for r in drop_path_rates(drop_path_rate, depth, drop_path_uniform)
        )
        self.norm = nn.LayerNorm(embed_dim, eps=norm_eps)
        self.mask_token = nn.Parameter(torch.zeros(1, embed_dim)) if use_mask_token else None
        self._init_parameters()

    def _init_parameters(self) -> None:
        # DINO's order (position table, CLS, then every layer) keeps v1 seeds exact;
        # registers as DINOv2 (normal, std 1e-6); the mask token stays zero.
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        nn.init.trunc_normal_(self.cls_token, std=0.02)
        self.apply(_init_weights)
        if self.register_tokens is not None:
            nn.init.normal_(self.register_tokens, std=1e-6)

    def set_activation_checkpointing(
        self, policy: str = "full", every: int = 1, recompute_threshold: float = 0.0
    ) -> VisionTransformer:
        """Checkpoint every ``every``-th block (blocks 0, every, 2 every, ...)
        with ``policy`` (one of :data:`CHECKPOINT_POLICIES`: ``full``
        recomputes the block in the backward pass, ``selective`` keeps the
        outputs of its matrix products and attention whose recomputation
        costs at least ``recompute_threshold`` FLOPs per byte kept, and
        recomputes the rest); the other blocks keep their activations. Only
        while training with autograd on. Returns ``self``."""
        if policy not in CHECKPOINT_POLICIES:
            raise ValueError(
                f"activation checkpointing must be one of "
                f"{', '.join(CHECKPOINT_POLICIES)}, got {policy!r}"
            )
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"checkpoint every must be an int >= 1, got {every!r}")
        if not recompute_threshold >= 0:
            raise ValueError(f"recompute_threshold must be >= 0, got {recompute_threshold!r}")
        for i, block in enumerate(self.blocks):
            block.checkpointing = policy if i % every == 0 else "none"
            block.recompute_threshold = float(recompute_threshold)
        return self

    def set_grad_checkpointing(self, enable: bool = True) -> VisionTransformer:
        """Full checkpointing of every block (``enable``) or none: timm's name
        for :meth:`set_activation_checkpointing`. Returns ``self``."""
        return self.set_activation_checkpointing("full" if enable else "none")

    @property
    def grad_checkpointing(self) -> bool:
        """Whether any block is checkpointed."""
        return any(block.checkpointing != "none" for block in self.blocks)

    # ------------------------------------------------------------ tokens

    def interpolate_pos_encoding(self, x: torch.Tensor, h: int, w: int) -> torch.Tensor:
        """Position embeddings for an ``h`` x ``w`` image whose tokens (CLS + patches) are ``x``
        (B, 1 + n, C): the learned table itself at the native grid, otherwise the
        patch part resized bicubically to the new grid (the CLS entry is kept;
        ``interpolate_offset`` and ``interpolate_antialias`` as DINOv2)."""
        npatch = x.shape[1] - 1
        gh, gw = h // self.patch_size, w // self.patch_size
        if npatch == self.pos_embed.shape[1] - 1 and (gh, gw) == pos_embed_grid(self.pos_embed):
            return self.pos_embed
        return resize_pos_embed(
            self.pos_embed, (gh, gw), self.interpolate_offset, self.interpolate_antialias
        )

    def _mask(self, x: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
        if self.mask_token is None:
            raise ValueError("masks given to a ViT without a mask token (use_mask_token=True)")
        if masks.dtype != torch.bool:
            raise TypeError(f"masks must be a bool tensor (True: masked), got {masks.dtype}")
        masks = masks.flatten(1)
        if masks.shape != x.shape[:2]:
            raise ValueError(
                f"masks of shape {tuple(masks.shape)} for {x.shape[0]} images of "
                f"{x.shape[1]} patches; expected (B, {x.shape[1]}) or (B, rows, cols)"
            )
        return torch.where(masks.unsqueeze(-1), self.mask_token.to(x.dtype).unsqueeze(0), x)

    def prepare_tokens(self, x: torch.Tensor, masks: torch.Tensor | None = None) -> torch.Tensor:
        """Images (B, C, H, W) -> CLS, register and patch tokens with position
        embeddings (B, 1 + registers + n, C); ``masks`` (bool, B x n, True:
        masked) replace those patches' embeddings by the mask token first."""
        b, _, h, w = x.shape
        x = self.patch_embed(x)
        if masks is not None:
            x = self._mask(x, masks)
        # cat promotes to the wider dtype: the embeddings are summed in float32,
        # then the stream goes to bfloat16 under bfloat16 autocast
        x = torch.cat((self.cls_token.expand(b, -1, -1), x), dim=1)
        x = x + self.interpolate_pos_encoding(x, h, w)
        if self.register_tokens is not None:
            x = torch.cat((x[:, :1], self.register_tokens.expand(b, -1, -1), x[:, 1:]), dim=1)
        return autocast_stream(x)

    def _blocks(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x

    def packed_prenorm(
        self, x_list: Sequence[torch.Tensor], masks_list: Sequence | None = None
    ) -> list[torch.Tensor]:
        """The tokens before the final norm (B_i, N_i, C) of each batch of
        ``x_list`` (crops of any sizes, with their masks or None), every batch
        through the blocks in one packed pass."""
        masks_list = [None] * len(x_list) if masks_list is None else list(masks_list)
        if len(masks_list) != len(x_list):
            raise ValueError(f"{len(x_list)} batches of crops but {len(masks_list)} masks")
        tokens = [self.prepare_tokens(x, m) for x, m in zip(x_list, masks_list, strict=True)]
        rows, layout = pack(tokens)
        for block in self.blocks:
            rows = block(rows, None, layout)
        return unpack(rows, layout)

    def cls_feature(self, x: torch.Tensor) -> torch.Tensor:
        """The normalised class token (B, C) of tokens ``x`` before the final norm."""
        return self.norm(x[:, 0])

    # ------------------------------------------------------------ outputs

    def forward_tokens(self, x: torch.Tensor, masks: torch.Tensor | None = None) -> torch.Tensor:
        """All tokens after the final norm, shape (B, 1 + registers + n, embed_dim)."""
        return self.norm(self._blocks(self.prepare_tokens(x, masks)))

    def _outputs(self, x: torch.Tensor, masks: torch.Tensor | None) -> dict:
        x_norm, r = self.norm(x), self.num_register_tokens
        return {
            "x_norm_clstoken": x_norm[:, 0],
            "x_norm_regtokens": x_norm[:, 1 : r + 1],
            "x_norm_patchtokens": x_norm[:, r + 1 :],
            "x_prenorm": x,
            "masks": masks,
        }

    def forward_features(
        self,
        x: torch.Tensor | Sequence[torch.Tensor],
        masks: torch.Tensor | Sequence[torch.Tensor | None] | None = None,
    ) -> dict | list[dict]:
        """DINOv2's outputs of a batch (B, C, H, W): a dict of
        ``x_norm_clstoken`` (B, C), ``x_norm_regtokens`` (B, registers, C),
        ``x_norm_patchtokens`` (B, n, C), ``x_prenorm`` (B, 1 + registers + n, C,
        before the final norm) and ``masks`` (as given). ``masks``: bool
        (B, n) or (B, rows, cols), True where a patch is replaced by the mask
        token. A list of batches (with a list of masks, or None) gives a list
        of dicts (:meth:`forward_features_list`)."""
        if not isinstance(x, torch.Tensor):
            return self.forward_features_list(x, masks)
        return self._outputs(self._blocks(self.prepare_tokens(x, masks)), masks)

    def forward_features_list(
        self, x_list: Sequence[torch.Tensor], masks_list: Sequence | None = None
    ) -> list[dict]:
        """:meth:`forward_features` of each batch of ``x_list`` (crops of any
        sizes) with its masks (``masks_list`` None: no masks), all batches
        through the blocks in one packed pass."""
        masks_list = [None] * len(x_list) if masks_list is None else list(masks_list)
        prenorm = self.packed_prenorm(x_list, masks_list)
        return [self._outputs(x, m) for x, m in zip(prenorm, masks_list, strict=True)]

    def forward(self, x: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
        """The normalised CLS token (B, embed_dim); of a list of crops, those of
        all crops in input order (consecutive crops of one size batched, and
        the sizes packed into one pass)."""
        if isinstance(x, torch.Tensor):
            return self.cls_feature(self.packed_prenorm([x])[0])
        if len(x) == 0:
            raise ValueError("VisionTransformer: no crops given")
        batches = [torch.cat(list(x[s:e])) for s, e in MultiCropWrapper.resolution_groups(x)]
        return torch.cat([self.cls_feature(t) for t in self.packed_prenorm(batches)])

    def get_intermediate_layers(self, x: torch.Tensor, n: int = 1) -> list[torch.Tensor]:
        """Outputs (all tokens: CLS, registers, patches; after the final norm)
        of the last ``n`` blocks."""
        if not 1 <= n <= len(self.blocks):
            raise ValueError(f"get_intermediate_layers: n must be in [1, {len(self.blocks)}]")
        x = self.prepare_tokens(x)
        out = []
        for i, block in enumerate(self.blocks):
            x = block(x)
            if i >= len(self.blocks) - n:
                out.append(self.norm(x))
        return out

    def get_last_selfattention(self, x: torch.Tensor) -> torch.Tensor:
        """Attention weights of the last block, shape (B, heads, N, N) over all
        N = 1 + registers + n tokens."""
        x = self.prepare_tokens(x)
        for block in self.blocks[:-1]:
            x = block(x)
        last = self.blocks[-1]
        return last.attn.attention_weights(last.norm1(x))


#: crop sizes a compiled block keeps a graph of (global and local, and
#: DINOv3's pairs of them), in training and evaluation mode each
MAX_CROP_SIZES = 8


def apply_block_options(
    backbone: nn.Module,
    activation_checkpointing: str = "none",
    every: int = 1,
    compile: bool = False,
    compile_mode: str | None = None,
    recompute_threshold: float = 0.0,
) -> nn.Module:
    """The per-block training options of a backbone, in place, in the order
    that composes with sharding (which comes after): activation checkpointing
    of every ``every``-th block with ``activation_checkpointing`` (one of
    :data:`CHECKPOINT_POLICIES`; see
    :meth:`VisionTransformer.set_activation_checkpointing`; ``selective``
    with ``recompute_threshold``), then
    ``torch.compile`` of each block in place (``block.compile()``), so that a
    block's checkpoint is inside its compiled graph and ``state_dict`` keys
    keep their names. A backbone other than a ViT takes no checkpointing and
    is compiled whole, in place. Returns ``backbone``.

    A block compiles whole (``fullgraph``) with static shapes; the blocks
    share one code object and so one graph cache, whose limit is raised to
    hold a graph per drop-path rate, crop size and mode (docs/training.md,
    "The step")."""
    if not isinstance(backbone, VisionTransformer):
        if activation_checkpointing != "none":
            raise ValueError(
                f"activation checkpointing ({activation_checkpointing}) needs a "
                f"ViT backbone, got {type(backbone).__name__}"
            )
        if compile:
            backbone.compile(mode=compile_mode)
        return backbone
    backbone.set_activation_checkpointing(activation_checkpointing, every, recompute_threshold)
    if compile:
        limit = 2 * MAX_CROP_SIZES * len(backbone.blocks) + 8
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, limit)
        for block in backbone.blocks:
            block.compile(mode=compile_mode, fullgraph=True, dynamic=False)
    return backbone


def _layerscale(layerscale_init: float | None, init_values: float | None) -> float | None:
    if layerscale_init and init_values and layerscale_init != init_values:
        raise ValueError(
            f"layerscale_init={layerscale_init} and init_values={init_values} name the same "
            "option (DINOv2 calls it init_values); give one"
        )
    return (layerscale_init or init_values) or None


def drop_path_rates(rate: float, depth: int, uniform: bool = False) -> list[float]:
    """Stochastic depth of each block: ``rate`` everywhere when ``uniform``
    (DINOv2's option), else a linear ramp from 0 to ``rate`` (DINO)."""
    if uniform:
        return [float(rate)] * depth
    # Plain Python (not torch.linspace) so that construction works on the meta device.
    return [rate * i / max(depth - 1, 1) for i in range(depth)]


def pos_embed_grid(pos_embed: torch.Tensor) -> tuple[int, int]:
    """The (square) patch grid of a position table (1, 1 + g * g, C)."""
    g = math.isqrt(pos_embed.shape[1] - 1)
    if g * g != pos_embed.shape[1] - 1:
        raise ValueError(
            f"a position table of {pos_embed.shape[1] - 1} patches is not a square grid"
        )
    return g, g


def resize_pos_embed(
    pos_embed: torch.Tensor,
    grid: tuple[int, int],
    offset: float = 0.0,
    antialias: bool = False,
) -> torch.Tensor:
    """A position table (1, 1 + n, C) for a ``grid`` of (rows, cols) patches:
    the CLS entry kept, the patch entries resized bicubically (align_corners
    False), in float32 at least and cast back. ``offset`` 0: to the grid's
    size (DINO); else by the scale factor ``(grid + offset) / g`` as DINOv2
    does. What the ViT does for inputs of another size, so a table exported
    at that size gives the same features."""
    g, _ = pos_embed_grid(pos_embed)
    grid = (int(grid[0]), int(grid[1]))
    if grid == (g, g):
        return pos_embed
    work = torch.promote_types(pos_embed.dtype, torch.float32)
    patch_pos = pos_embed[:, 1:].to(work).reshape(1, g, g, -1).permute(0, 3, 1, 2)
    if offset:
        size = {"scale_factor": ((grid[0] + offset) / g, (grid[1] + offset) / g)}
    else:
        size = {"size": grid}
    patch_pos = F.interpolate(
        patch_pos, mode="bicubic", align_corners=False, antialias=antialias, **size
    )
    if tuple(patch_pos.shape[-2:]) != grid:
        raise ValueError(
            f"interpolate_offset {offset} resizes {g}x{g} to "
            f"{tuple(patch_pos.shape[-2:])}, not {grid}"
        )
    patch_pos = patch_pos.to(pos_embed.dtype).permute(0, 2, 3, 1)
    return torch.cat((pos_embed[:, :1], patch_pos.reshape(1, grid[0] * grid[1], -1)), dim=1)


def _init_weights(m: nn.Module) -> None:
    # DINO: truncated normal (std 0.02) linear weights, zero biases, unit LayerNorm;
    # the patch convolution keeps PyTorch's default init; LayerScale keeps its value.
    if isinstance(m, nn.Linear):
        nn.init.trunc_normal_(m.weight, std=0.02)
        if m.bias is not None:
            nn.init.zeros_(m.bias)
    elif isinstance(m, nn.LayerNorm):
        nn.init.ones_(m.weight)
        nn.init.zeros_(m.bias)


def _vit(patch_size: int, dim: int, depth: int, heads: int, kwargs: dict) -> VisionTransformer:
    # a ``depth`` in kwargs replaces the size's own
    return VisionTransformer(
        patch_size=patch_size,
        embed_dim=dim,
        num_heads=heads,
        mlp_ratio=4.0,
        **({"depth": depth} | kwargs),
    )


def vit_tiny(patch_size: int = 16, **kwargs) -> VisionTransformer:
    """ViT-Tiny: embed 192, depth 12, 3 heads (5.5M parameters at patch 16)."""
    return _vit(patch_size, 192, 12, 3, kwargs)


def vit_small(patch_size: int = 16, **kwargs) -> VisionTransformer:
    """ViT-Small: embed 384, depth 12, 6 heads (21.7M parameters at patch 16;
    DINOv2's ViT-S/14 at 518 px, LayerScale and mask token: 22.1M)."""
    return _vit(patch_size, 384, 12, 6, kwargs)


def vit_base(patch_size: int = 16, **kwargs) -> VisionTransformer:
    """ViT-Base: embed 768, depth 12, 12 heads (85.8M parameters at patch 16;
    DINOv2's ViT-B/14: 86.6M)."""
    return _vit(patch_size, 768, 12, 12, kwargs)


def vit_large(patch_size: int = 16, **kwargs) -> VisionTransformer:
    """ViT-Large: embed 1024, depth 24, 16 heads (DINOv2's ViT-L/14: 304.4M)."""
    return _vit(patch_size, 1024, 24, 16, kwargs)


def vit_giant2(patch_size: int = 16, **kwargs) -> VisionTransformer:
    """DINOv2's ViT-giant: embed 1536, depth 40, 24 heads of 64, SwiGLU
    feed-forward layers (``ffn_layer="swiglufused"`` unless given; hidden
    4096) (DINOv2's ViT-g/14: 1136.5M)."""
    kwargs.setdefault("ffn_layer", "swiglufused")
    return _vit(patch_size, 1536, 40, 24, kwargs)
