"""Vision Transformer of DINOv3 (Simeoni et al., 2025): dino_opt's ViT with
rotary position embeddings instead of a position table.

Patches of 16, a class token and 4 storage (register) tokens, no absolute
position embedding: queries and keys of the patch tokens are rotated by
DINOv3's RoPE (:class:`~dino_opt.models.rope.RopePositionEmbedding`; the
class and storage tokens are not rotated) before
``scaled_dot_product_attention``. LayerScale (1e-5), LayerNorm eps 1e-5, a
GELU MLP or a SwiGLU of DINOv3's width, and DINOv3's masked key bias: the
qkv projection has learned query and value biases and a key bias held at
zero. Optionally separate final norms for the class and storage tokens
(``untie_cls_and_patch_norms``) and for the class tokens of local crops
(``untie_global_and_local_cls_norm``, the 7B's).

The model is a :class:`~dino_opt.models.vit.VisionTransformer` (same
``forward``, ``forward_features`` dict, checkpointing, ``blocks`` list for
per-block compilation and sharding); its blocks take the RoPE as a second
argument. The sizes are DINOv3's published backbones (``DINOV3_SIZES``).
``convert_timm_dinov3_state_dict`` and ``convert_dinov3_state_dict`` rename
the weights of timm's port and of DINOv3's own checkpoints to this model's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .layers import Attention, Block, LayerScale, SwiGLUFFN, autocast_stream, pack, unpack
from .rope import RopePositionEmbedding, apply_rope
from .vit import VisionTransformer, drop_path_rates

__all__ = [
    "DINOV3_FFN_LAYERS",
    "DINOV3_SIZES",
    "DinoV3VisionTransformer",
    "MaskedKeyBiasLinear",
    "RopeAttention",
    "RopeBlock",
    "convert_dinov3_state_dict",
    "convert_timm_dinov3_state_dict",
    "dinov3_swiglu_hidden_dim",
    "vit_7b_dinov3",
    "vit_base_dinov3",
    "vit_huge_plus_dinov3",
    "vit_large_dinov3",
    "vit_large_plus_dinov3",
    "vit_small_dinov3",
    "vit_small_plus_dinov3",
]

#: DINOv3's feed-forward kinds and the multiple their hidden width is rounded
#: up to (0: the GELU MLP, ``int(dim * ffn_ratio)`` wide).
DINOV3_FFN_LAYERS = {"mlp": 0, "swiglu": 8, "swiglu32": 32, "swiglu64": 64, "swiglu128": 128}

#: DINOv3's published backbones (patch 16, 4 storage tokens, LayerScale 1e-5,
#: LayerNorm eps 1e-5, masked key bias), by builder name.
DINOV3_SIZES = {
    "vit_small_dinov3": dict(embed_dim=384, depth=12, num_heads=6, ffn_ratio=4.0, ffn_layer="mlp"),
    "vit_small_plus_dinov3": dict(
        embed_dim=384, depth=12, num_heads=6, ffn_ratio=6.0, ffn_layer="swiglu"
    ),
    "vit_base_dinov3": dict(embed_dim=768, depth=12, num_heads=12, ffn_ratio=4.0, ffn_layer="mlp"),
    "vit_large_dinov3": dict(
        embed_dim=1024, depth=24, num_heads=16, ffn_ratio=4.0, ffn_layer="mlp"
    ),
    "vit_large_plus_dinov3": dict(
        embed_dim=1024, depth=24, num_heads=16, ffn_ratio=6.0, ffn_layer="swiglu"
    ),
    "vit_huge_plus_dinov3": dict(
        embed_dim=1280, depth=32, num_heads=20, ffn_ratio=6.0, ffn_layer="swiglu"
    ),
    "vit_7b_dinov3": dict(
        embed_dim=4096,
        depth=40,
        num_heads=32,
        ffn_ratio=3.0,
        ffn_layer="swiglu64",
        qkv_bias=False,
        untie_global_and_local_cls_norm=True,
    ),
}


def dinov3_swiglu_hidden_dim(mlp_hidden: int, align: int = 8) -> int:
    """DINOv3's SwiGLU width for a block whose MLP would be ``mlp_hidden``
    wide: two thirds of it, rounded up to a multiple of ``align``."""
    d = int(mlp_hidden * 2 / 3)
    return d + (-d % align)


class MaskedKeyBiasLinear(nn.Linear):
    """The fused qkv projection (dim -> 3 dim) with DINOv3's masked key bias:
    learned biases of the queries (``q_bias``) and values (``v_bias``), the
    keys' bias held at zero (DINOv3 keeps a key bias multiplied by a zero
    mask; it is not a parameter here)."""

    def __init__(self, dim: int) -> None:
        super().__init__(dim, 3 * dim, bias=False)
        self.q_bias = nn.Parameter(torch.zeros(dim))
        self.v_bias = nn.Parameter(torch.zeros(dim))

    def full_bias(self) -> torch.Tensor:
        """The bias of all three parts, (3 dim,), with zeros for the keys."""
        return torch.cat((self.q_bias, torch.zeros_like(self.q_bias), self.v_bias))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.full_bias())


class RopeAttention(Attention):
    """Self-attention whose patch tokens' queries and keys are rotated by the
    RoPE ``(sin, cos)`` given to ``forward`` (each (n patches, head_dim); the
    first ``N - n`` tokens are not rotated), then
    ``scaled_dot_product_attention``. ``mask_k_bias`` (with ``qkv_bias``):
    the qkv projection is a :class:`MaskedKeyBiasLinear`."""

    def __init__(
        self,
        dim: int,
        num_heads: int,
        qkv_bias: bool = True,
        proj_bias: bool = True,
        mask_k_bias: bool = False,
    ) -> None:
        masked = qkv_bias and mask_k_bias
        super().__init__(dim, num_heads, qkv_bias=qkv_bias and not masked, proj_bias=proj_bias)
        if masked:
            self.qkv = MaskedKeyBiasLinear(dim)

    def rotate(
        self, q: torch.Tensor, k: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Queries and keys (B, heads, N, head_dim) with the patch tokens rotated."""
        if rope is None:
            raise ValueError(
                "RopeAttention needs the RoPE (sin, cos) of the patch grid; the "
                "DINOv3 ViT passes it (call the model or its methods)"
            )
        sin, cos = rope
        return apply_rope(q, sin, cos), apply_rope(k, sin, cos)


class RopeBlock(Block):
    """dino_opt's pre-norm :class:`~dino_opt.models.layers.Block` with
    :class:`RopeAttention` and DINOv3's feed-forward widths; ``forward(x,
    rope)``. Activation checkpointing (``checkpointing``) as the block's, with
    the RoPE passed into the checkpoint."""

    def __init__(
        self,
        dim: int,
        num_heads: int,
        ffn_ratio: float = 4.0,
        qkv_bias: bool = True,
        drop_path: float = 0.0,
        norm_eps: float = 1e-5,
        *,
        proj_bias: bool = True,
        ffn_bias: bool = True,
        ffn_layer: str = "mlp",
        init_values: float | None = 1e-5,
        mask_k_bias: bool = False,
    ) -> None:
        if ffn_layer not in DINOV3_FFN_LAYERS:
            raise ValueError(
                f"ffn_layer must be one of {', '.join(DINOV3_FFN_LAYERS)}, got {ffn_layer!r}"
            )
        super().__init__(
            dim,
            num_heads,
            ffn_ratio,
            False,
            drop_path,
            norm_eps,
            proj_bias=proj_bias,
            ffn_bias=ffn_bias,
            init_values=init_values,
        )
        self.attn = RopeAttention(dim, num_heads, qkv_bias, proj_bias, mask_k_bias)
        align = DINOV3_FFN_LAYERS[ffn_layer]
        if align:
            hidden = dinov3_swiglu_hidden_dim(int(dim * ffn_ratio), align)
            self.mlp = SwiGLUFFN(dim, hidden, bias=ffn_bias)


class DinoV3VisionTransformer(VisionTransformer):
    """DINOv3's Vision Transformer backbone; ``forward`` returns the
    normalised class token (B, embed_dim), ``forward_features`` the dict of
    dino_opt's ViTs.

    Args:
        img_size: nominal image side (kept for reference; any multiple of
            ``patch_size`` goes through, there is no position table).
        patch_size, in_chans, embed_dim, depth, num_heads: the shape.
        ffn_ratio: MLP width over ``embed_dim`` (SwiGLU: two thirds of it,
            rounded up as ``ffn_layer`` says).
        qkv_bias, proj_bias, ffn_bias: biases; ``mask_k_bias`` with
            ``qkv_bias``: DINOv3's key bias held at zero.
        drop_path_rate: stochastic depth, the same in every block (DINOv3's
            rule; ``drop_path_uniform=False``: dino_opt's linear ramp).
        norm_eps: LayerNorm epsilon (DINOv3: 1e-5).
        ffn_layer: one of :data:`DINOV3_FFN_LAYERS`.
        layerscale_init: LayerScale's initial value (1e-5); None: none.
        n_storage_tokens: storage (register) tokens after the class token (4).
        untie_cls_and_patch_norms: a final norm of its own (``cls_norm``) for
            the class and storage tokens.
        untie_global_and_local_cls_norm: a final norm (``local_cls_norm``) for
            the class and storage tokens of local crops, used in training only
            (``forward_features(x, local_crops=True)``, or the second batch of
            ``forward_features_list``, as DINOv3).
        use_mask_token: a learned ``mask_token`` for masked patches (iBOT).
        pos_embed_rope_*: the RoPE's base (100), periods, coordinate
            normalisation, training-time augmentations (None: off) and dtype
            (see :class:`~dino_opt.models.rope.RopePositionEmbedding`).
    """

    def __init__(
        self,
        img_size: int = 224,
        patch_size: int = 16,
        in_chans: int = 3,
        embed_dim: int = 768,
        depth: int = 12,
        num_heads: int = 12,
        ffn_ratio: float = 4.0,
        qkv_bias: bool = True,
        drop_path_rate: float = 0.0,
        norm_eps: float = 1e-5,
        *,
        proj_bias: bool = True,
        ffn_bias: bool = True,
        ffn_layer: str = "mlp",
        layerscale_init: float | None = 1e-5,
        n_storage_tokens: int = 4,
        mask_k_bias: bool = True,
        untie_cls_and_patch_norms: bool = False,
        untie_global_and_local_cls_norm: bool = False,
        use_mask_token: bool = False,
        drop_path_uniform: bool = True,
        pos_embed_rope_base: float | None = 100.0,
        pos_embed_rope_min_period: float | None = None,
        pos_embed_rope_max_period: float | None = None,
        pos_embed_rope_normalize_coords: str = "separate",
        pos_embed_rope_shift_coords: float | None = None,
        pos_embed_rope_jitter_coords: float | None = None,
        pos_embed_rope_rescale_coords: float | None = None,
        pos_embed_rope_dtype: torch.dtype = torch.float32,
    ) -> None:
        # The parent builds the patch embedding, class / storage / mask tokens
        # and final norm (no blocks); its position table is dropped.
        super().__init__(
            img_size,
            patch_size,
            in_chans,
            embed_dim,
            0,
            num_heads,
            ffn_ratio,
            qkv_bias,
            drop_path_rate,
            norm_eps,
            proj_bias=proj_bias,
            ffn_bias=ffn_bias,
            layerscale_init=layerscale_init,
            num_register_tokens=n_storage_tokens,
            use_mask_token=use_mask_token,
            drop_path_uniform=drop_path_uniform,
        )
        self.pos_embed = None
        self.depth = self.n_blocks = depth
        self.ffn_layer = ffn_layer
        self.n_storage_tokens = self.num_register_tokens
        self.rope_embed = RopePositionEmbedding(
            embed_dim,
            num_heads,
            base=pos_embed_rope_base,
            min_period=pos_embed_rope_min_period,
            max_period=pos_embed_rope_max_period,
            normalize_coords=pos_embed_rope_normalize_coords,
            shift_coords=pos_embed_rope_shift_coords,
            jitter_coords=pos_embed_rope_jitter_coords,
            rescale_coords=pos_embed_rope_rescale_coords,
            dtype=pos_embed_rope_dtype,
        )
        block = dict(
            proj_bias=proj_bias,
            ffn_bias=ffn_bias,
            ffn_layer=ffn_layer,
            init_values=self.layerscale_init,
            mask_k_bias=mask_k_bias,
        )
        self.blocks = nn.ModuleList(
            RopeBlock(embed_dim, num_heads, ffn_ratio, qkv_bias, r, norm_eps, **block)
            for r in drop_path_rates(drop_path_rate, depth, drop_path_uniform)
        )
        norm = nn.LayerNorm(embed_dim, eps=norm_eps)
        self.cls_norm = norm if untie_cls_and_patch_norms else None
        self.local_cls_norm = (
            nn.LayerNorm(embed_dim, eps=norm_eps) if untie_global_and_local_cls_norm else None
        )
        self.init_weights()

    def init_weights(self) -> None:
        """DINOv3's initialisation: class and storage tokens normal (std
        0.02), linear weights truncated normal (std 0.02) with zero biases,
        unit LayerNorms, LayerScale at its value, PyTorch's default for the
        patch convolution, a zero mask token."""
        nn.init.normal_(self.cls_token, std=0.02)
        if self.register_tokens is not None:
            nn.init.normal_(self.register_tokens, std=0.02)
        if self.mask_token is not None:
            nn.init.zeros_(self.mask_token)
        self.apply(_init_module)

    # ------------------------------------------------------------ tokens

    def interpolate_pos_encoding(self, x: torch.Tensor, h: int, w: int) -> torch.Tensor:
        """Not applicable: DINOv3 has no position table (its RoPE takes any grid)."""
        raise NotImplementedError("the DINOv3 ViT has no position table; positions are RoPE")

    def check_images(self, x: torch.Tensor) -> tuple[int, int]:
        """The patch grid (rows, cols) of images ``x`` (B, C, H, W); a one-line
        ValueError naming ``x`` and its shape when they do not fit the model."""
        chans, p = self.patch_embed.proj.in_channels, self.patch_size
        if not isinstance(x, torch.Tensor) or x.ndim != 4 or x.shape[1] != chans:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"x: images must have shape (B, {chans}, H, W), got {shape}")
        h, w = x.shape[-2:]
        if h % p or w % p or h == 0 or w == 0:
            raise ValueError(
                f"x: images of shape {tuple(x.shape)}; H and W must be positive "
                f"multiples of the patch size {p}"
            )
        return h // p, w // p

    def prepare_tokens_with_masks(
        self, x: torch.Tensor, masks: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, tuple[int, int]]:
        """Images (B, C, H, W) -> class, storage and patch tokens (B, 1 +
        storage + n, C) and the patch grid (rows, cols). ``masks`` (bool, (B,
        n) or (B, rows, cols), True: masked) replace those patches by the mask
        token."""
        grid = self.check_images(x)
        x = self.patch_embed(x)
        cls = self.cls_token
        if masks is not None:
            x = self.masked(x, masks)
        elif self.mask_token is not None:
            cls = cls + 0 * self.mask_token  # DINOv3: the mask token always in the graph
        tokens = [cls.expand(len(x), -1, -1), x]
        if self.register_tokens is not None:
            tokens.insert(1, self.register_tokens.expand(len(x), -1, -1))
        return autocast_stream(torch.cat(tokens, dim=1)), grid

    def prepare_tokens(self, x: torch.Tensor, masks: torch.Tensor | None = None) -> torch.Tensor:
        """The tokens of :meth:`prepare_tokens_with_masks`, without the grid
        (the blocks then need the RoPE: ``block(x, model.rope(grid, x))``)."""
        return self.prepare_tokens_with_masks(x, masks)[0]

    def masked(self, x: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
        """Patch embeddings ``x`` (B, n, C) with the masked ones (``masks``
        True) replaced by the mask token."""
        if self.mask_token is None:
            raise ValueError("masks given to a ViT without a mask token (use_mask_token=True)")
        if masks.dtype != torch.bool:
            raise TypeError(f"masks must be a bool tensor (True: masked), got {masks.dtype}")
        masks = masks.flatten(1)
        if masks.shape != x.shape[:2]:
            raise ValueError(
                f"masks: shape {tuple(masks.shape)} for {x.shape[0]} images of "
                f"{x.shape[1]} patches; expected (B, {x.shape[1]})"
            )
        return torch.where(masks.unsqueeze(-1), self.mask_token.to(x.dtype).unsqueeze(0), x)

    def rope(self, grid: tuple[int, int], x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The RoPE ``(sin, cos)`` of a patch grid, on ``x``'s device, in at
        least ``x``'s precision."""
        return self.rope_embed(grid[0], grid[1], device=x.device, dtype=x.dtype)

    def run_blocks(self, x: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        """Tokens through every block. The RoPE is computed once, or, while
        its augmentations are on, drawn anew for each block (as DINOv3)."""
        fixed = None if self.rope_embed.augmenting else self.rope(grid, x)
        for block in self.blocks:
            x = block(x, fixed if fixed is not None else self.rope(grid, x))
        return x

    # ------------------------------------------------------------ outputs

    def normed(self, x: torch.Tensor, local_crops: bool = False) -> tuple[torch.Tensor, ...]:
        """Final norms of tokens ``x``: (class and storage, patches)."""
        r = self.num_register_tokens + 1
        cls_norm = self.cls_norm
        if local_crops and self.training and self.local_cls_norm is not None:
            cls_norm = self.local_cls_norm
        if cls_norm is None:
            x = self.norm(x)
            return x[:, :r], x[:, r:]
        return cls_norm(x[:, :r]), self.norm(x[:, r:])

    def forward_tokens(self, x: torch.Tensor, masks: torch.Tensor | None = None) -> torch.Tensor:
        """All tokens after the final norms, (B, 1 + storage + n, embed_dim)."""
        tokens, grid = self.prepare_tokens_with_masks(x, masks)
        return torch.cat(self.normed(self.run_blocks(tokens, grid)), dim=1)

    def forward_features(
        self,
        x: torch.Tensor | Sequence[torch.Tensor],
        masks: torch.Tensor | Sequence[torch.Tensor | None] | None = None,
        local_crops: bool = False,
    ) -> dict | list[dict]:
        """The outputs of a batch (B, C, H, W): a dict of ``x_norm_clstoken``
        (B, C), ``x_norm_regtokens`` (B, storage, C), ``x_norm_patchtokens``
        (B, n, C), ``x_prenorm`` (B, 1 + storage + n, C) and ``masks`` (as
        given). ``local_crops``: the class token through ``local_cls_norm``
        (training mode, where the model has it). A list of batches gives a
        list of dicts (:meth:`forward_features_list`)."""
        if not isinstance(x, torch.Tensor):
            return self.forward_features_list(x, masks)
        tokens, grid = self.prepare_tokens_with_masks(x, masks)
        return self._outputs(self.run_blocks(tokens, grid), masks, local_crops)

    def _outputs(self, x: torch.Tensor, masks: torch.Tensor | None, local_crops: bool) -> dict:
        cls_reg, patches = self.normed(x, local_crops)
        return {
            "x_norm_clstoken": cls_reg[:, 0],
            "x_norm_regtokens": cls_reg[:, 1:],
            "x_norm_patchtokens": patches,
            "x_prenorm": x,
            "masks": masks,
        }

    def forward_features_list(
        self, x_list: Sequence[torch.Tensor], masks_list: Sequence | None = None
    ) -> list[dict]:
        """:meth:`forward_features` of each batch with its masks, all batches
        through the blocks in one packed pass; the second batch counts as
        local crops (DINOv3's rule for ``local_cls_norm``)."""
        masks_list = [None] * len(x_list) if masks_list is None else list(masks_list)
        prenorm = self.packed_prenorm(x_list, masks_list)
        pairs = enumerate(zip(prenorm, masks_list, strict=True))
        return [self._outputs(x, m, local_crops=i == 1) for i, (x, m) in pairs]

    def packed_prenorm(
        self, x_list: Sequence[torch.Tensor], masks_list: Sequence | None = None
    ) -> list[torch.Tensor]:
        """The tokens before the final norms of each batch of ``x_list`` (any
        grids, with their masks or None), every batch through the blocks in
        one packed pass, each with its grid's RoPE (drawn anew for each block
        while the RoPE's augmentations are on)."""
        masks_list = [None] * len(x_list) if masks_list is None else list(masks_list)
        if len(masks_list) != len(x_list):
            raise ValueError(f"{len(x_list)} batches of crops but {len(masks_list)} masks")
        prepared = [
            self.prepare_tokens_with_masks(x, m) for x, m in zip(x_list, masks_list, strict=True)
        ]
        tokens, grids = zip(*prepared, strict=True)
        rows, layout = pack(tokens)

        def ropes() -> list[tuple[torch.Tensor, torch.Tensor]]:
            return [self.rope(g, t) for g, t in zip(grids, tokens, strict=True)]

        fixed = None if self.rope_embed.augmenting else ropes()
        for block in self.blocks:
            rows = block(rows, fixed if fixed is not None else ropes(), layout)
        return unpack(rows, layout)

    def cls_feature(self, x: torch.Tensor) -> torch.Tensor:
        """The normalised class token (B, C) of tokens ``x`` before the final norms."""
        return (self.norm if self.cls_norm is None else self.cls_norm)(x[:, 0])

    def get_intermediate_layers(self, x: torch.Tensor, n: int = 1) -> list[torch.Tensor]:
        """Outputs (all tokens, after the final norms) of the last ``n`` blocks."""
        if not 1 <= n <= len(self.blocks):
            raise ValueError(f"get_intermediate_layers: n must be in [1, {len(self.blocks)}]")
        x, grid = self.prepare_tokens_with_masks(x)
        rope, out = self.rope(grid, x), []
        for i, block in enumerate(self.blocks):
            x = block(x, rope)
            if i >= len(self.blocks) - n:
                out.append(torch.cat(self.normed(x), dim=1))
        return out

    def get_last_selfattention(self, x: torch.Tensor) -> torch.Tensor:
        """Attention weights of the last block (B, heads, N, N) over all tokens."""
        x, grid = self.prepare_tokens_with_masks(x)
        rope = self.rope(grid, x)
        for block in self.blocks[:-1]:
            x = block(x, rope)
        last = self.blocks[-1]
        return last.attn.attention_weights(last.norm1(x), rope)


def _init_module(m: nn.Module) -> None:
    if isinstance(m, nn.Linear):
        nn.init.trunc_normal_(m.weight, std=0.02)
        if m.bias is not None:
            nn.init.zeros_(m.bias)
    if isinstance(m, MaskedKeyBiasLinear):
        nn.init.zeros_(m.q_bias)
        nn.init.zeros_(m.v_bias)
    elif isinstance(m, (nn.LayerNorm, nn.Conv2d)):
        m.reset_parameters()
    elif isinstance(m, LayerScale):
        nn.init.constant_(m.gamma, m.init_values)


def convert_timm_dinov3_state_dict(state_dict: dict) -> dict:
    """A state dict of timm's DINOv3 port (``vit_*_patch16_dinov3*``) renamed
    to :class:`DinoV3VisionTransformer`'s: ``reg_token`` -> ``register_tokens``,
    ``gamma_1`` / ``gamma_2`` -> ``ls1.gamma`` / ``ls2.gamma``, ``attn.q_bias``
    / ``attn.v_bias`` -> ``attn.qkv.q_bias`` / ``attn.qkv.v_bias``, SwiGLU's
    ``fc1_g`` and ``fc1_x`` stacked into ``w12`` and ``fc2`` -> ``w3``; the
    classifier (``head``), ``fc_norm`` and RoPE buffers are left out."""
    out = {}
    for key, value in state_dict.items():
        if key.startswith(("head.", "fc_norm.", "rope.")) or key.endswith(".k_bias"):
            continue
        for old, new in (
            ("reg_token", "register_tokens"),
            ("gamma_1", "ls1.gamma"),
            ("gamma_2", "ls2.gamma"),
            ("attn.q_bias", "attn.qkv.q_bias"),
            ("attn.v_bias", "attn.qkv.v_bias"),
        ):
            key = key.replace(old, new)
        out[key] = value
    return _stack_swiglu(out, ("fc1_g", "fc1_x", "fc2"))


def convert_dinov3_state_dict(state_dict: dict) -> dict:
    """A state dict of DINOv3's own backbones renamed to
    :class:`DinoV3VisionTransformer`'s: ``storage_tokens`` ->
    ``register_tokens``, a masked qkv bias (``qkv.bias`` with ``qkv.bias_mask``)
    split into ``qkv.q_bias`` and ``qkv.v_bias`` (the key part, masked to
    zero, left out), SwiGLU's ``w1`` and ``w2`` stacked into ``w12``; the
    RoPE periods (recomputed here) are left out."""
    out = {}
    for key, value in state_dict.items():
        if key == "rope_embed.periods" or key.endswith(".bias_mask"):
            continue
        if key.endswith("qkv.bias") and key + "_mask" in state_dict:
            q, _, v = value.chunk(3)
            out[key[: -len("bias")] + "q_bias"], out[key[: -len("bias")] + "v_bias"] = q, v
            continue
        out[key.replace("storage_tokens", "register_tokens")] = value
    return _stack_swiglu(out, ("w1", "w2", "w3"))


def _stack_swiglu(state_dict: dict, names: tuple[str, str, str]) -> dict:
    """SwiGLU layers stored as gate, value and output projections (``names``)
    as :class:`~dino_opt.models.layers.SwiGLUFFN`'s ``w12`` and ``w3``."""
    gate, value, output = (f".mlp.{n}." for n in names)
    out = {}
    for key, tensor in state_dict.items():
        if value in key:
            continue
        if gate in key:
            other = state_dict[key.replace(gate, value)]
            out[key.replace(gate, ".mlp.w12.")] = torch.cat((tensor, other))
        elif output in key and key.replace(output, gate) in state_dict:
            out[key.replace(output, ".mlp.w3.")] = tensor
        else:
            out[key] = tensor
    return out


def _dinov3(name: str, patch_size: int, kwargs: dict) -> DinoV3VisionTransformer:
    return DinoV3VisionTransformer(patch_size=patch_size, **(DINOV3_SIZES[name] | kwargs))


def vit_small_dinov3(patch_size: int = 16, **kwargs) -> DinoV3VisionTransformer:
    """DINOv3's ViT-S/16: embed 384, depth 12, 6 heads, GELU MLP x4 (21.6M parameters)."""
    return _dinov3("vit_small_dinov3", patch_size, kwargs)


def vit_small_plus_dinov3(patch_size: int = 16, **kwargs) -> DinoV3VisionTransformer:
    """DINOv3's ViT-S+/16: embed 384, depth 12, 6 heads, SwiGLU 1536 wide (28.7M)."""
    return _dinov3("vit_small_plus_dinov3", patch_size, kwargs)


def vit_base_dinov3(patch_size: int = 16, **kwargs) -> DinoV3VisionTransformer:
    """DINOv3's ViT-B/16: embed 768, depth 12, 12 heads, GELU MLP x4 (85.7M)."""
    return _dinov3("vit_base_dinov3", patch_size, kwargs)


def vit_large_dinov3(patch_size: int = 16, **kwargs) -> DinoV3VisionTransformer:
    """DINOv3's ViT-L/16: embed 1024, depth 24, 16 heads, GELU MLP x4 (303.1M)."""
    return _dinov3("vit_large_dinov3", patch_size, kwargs)


def vit_large_plus_dinov3(patch_size: int = 16, **kwargs) -> DinoV3VisionTransformer:
    """DINOv3's ViT-L+/16: embed 1024, depth 24, 16 heads, SwiGLU 4096 wide."""
    return _dinov3("vit_large_plus_dinov3", patch_size, kwargs)


def vit_huge_plus_dinov3(patch_size: int = 16, **kwargs) -> DinoV3VisionTransformer:
    """DINOv3's ViT-H+/16: embed 1280, depth 32, 20 heads, SwiGLU 5120 wide (840.6M)."""
    return _dinov3("vit_huge_plus_dinov3", patch_size, kwargs)


def vit_7b_dinov3(patch_size: int = 16, **kwargs) -> DinoV3VisionTransformer:
    """DINOv3's ViT-7B/16: embed 4096, depth 40, 32 heads, SwiGLU 8192 wide
    (rounded to 64), no qkv bias, a local-crop class norm (6716.0M)."""
    return _dinov3("vit_7b_dinov3", patch_size, kwargs)
