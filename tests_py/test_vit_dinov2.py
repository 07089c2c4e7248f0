"""The DINOv2 side of dino_opt's ViT: register tokens, the mask token,
LayerScale, SwiGLU, uniform stochastic depth, bias switches, DINOv2's
position interpolation, its output dict, its parameter counts and its
state-dict names. DINO (v1) behaviour is tests_py/test_models.py's."""

import pytest
import torch
import torch.nn.functional as F
from dino_opt.config import ConfigError, apply_overrides, default_config
from dino_opt.models import (
    VisionTransformer,
    build_backbone,
    build_dino_models,
    vit_base,
    vit_giant2,
    vit_large,
    vit_small,
)
from dino_opt.models import layers as layers_module
from dino_opt.models.layers import Attention, LayerScale, SwiGLUFFN, swiglu_hidden_dim
from dino_opt.models.vit import drop_path_rates, resize_pos_embed
from dino_opt.train import build_models
from torch import nn

DIM, HEADS, REG = 32, 4, 4


def v2_vit(**kw) -> VisionTransformer:
    """A DINOv2-style ViT small enough for a 2-core CPU: 14-pixel patches,
    28x28 native size (2x2 grid), registers, LayerScale, mask token."""
    cfg = dict(
        img_size=28,
        patch_size=14,
        embed_dim=DIM,
        depth=2,
        num_heads=HEADS,
        num_register_tokens=REG,
        layerscale_init=1e-5,
        use_mask_token=True,
    )
    cfg.update(kw)
    return VisionTransformer(**cfg)


def _randomize(model: nn.Module, gen: torch.Generator) -> nn.Module:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.1)
    return model


# ---------------------------------------------------------------- tokens and outputs


def test_output_dict_shapes_with_registers(gen):
    model = _randomize(v2_vit(), gen).eval()
    x = torch.randn(3, 3, 42, 56, generator=gen)  # 3x4 patches
    with torch.no_grad():
        out = model.forward_features(x)
        tokens = model.forward_tokens(x)
        cls = model(x)
    assert set(out) == {
        "x_norm_clstoken",
        "x_norm_regtokens",
        "x_norm_patchtokens",
        "x_prenorm",
        "masks",
    }
    assert out["x_norm_clstoken"].shape == (3, DIM)
    assert out["x_norm_regtokens"].shape == (3, REG, DIM)
    assert out["x_norm_patchtokens"].shape == (3, 12, DIM)
    assert out["x_prenorm"].shape == tokens.shape == (3, 1 + REG + 12, DIM)
    assert out["masks"] is None
    assert torch.equal(cls, out["x_norm_clstoken"])  # registers dropped from the output
    assert torch.equal(tokens[:, 1 + REG :], out["x_norm_patchtokens"])
    assert torch.equal(tokens[:, 1 : 1 + REG], out["x_norm_regtokens"])


def test_registers_follow_the_cls_token_without_position(gen):
    model = _randomize(v2_vit(), gen)
    x = torch.randn(2, 3, 28, 28, generator=gen)
    with torch.no_grad():
        tokens = model.prepare_tokens(x)
        patches = model.patch_embed(x)
    pos = model.pos_embed.detach()
    assert torch.equal(tokens[:, 0], (model.cls_token[0] + pos[:, 0]).detach().expand(2, -1))
    assert torch.equal(tokens[:, 1 : 1 + REG], model.register_tokens.detach().expand(2, -1, -1))
    assert torch.equal(tokens[:, 1 + REG :], patches + pos[:, 1:])


def test_mask_token_replaces_exactly_the_masked_patches(gen):
    model = _randomize(v2_vit(), gen)
    x = torch.randn(2, 3, 56, 56, generator=gen)  # 4x4 patches
    masks = torch.zeros(2, 16, dtype=torch.bool)
    masks[0, [0, 5, 15]] = True
    masks[1, 7] = True
    with torch.no_grad():
        plain, masked = model.prepare_tokens(x), model.prepare_tokens(x, masks)
        grid = model.prepare_tokens(x, masks.reshape(2, 4, 4))  # (B, rows, cols) too
    pos = model.interpolate_pos_encoding(plain[:, :17], 56, 56).detach()
    patches, ref = masked[:, 1 + REG :], plain[:, 1 + REG :]
    assert torch.equal(patches[~masks], ref[~masks])
    expected = (model.mask_token + pos[0, 1:][masks.nonzero()[:, 1]]).detach()
    assert torch.equal(patches[masks], expected)
    assert torch.equal(masked[:, : 1 + REG], plain[:, : 1 + REG])
    assert torch.equal(grid, masked)
    out = model.eval().forward_features(x, masks)
    assert out["masks"] is masks


def test_mask_errors():
    model = v2_vit()
    x = torch.zeros(1, 3, 28, 28)
    with pytest.raises(TypeError, match="bool"):
        model.forward_features(x, torch.zeros(1, 4))
    with pytest.raises(ValueError, match=r"\(B, 4\)"):
        model.forward_features(x, torch.zeros(1, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="use_mask_token"):
        v2_vit(use_mask_token=False).forward_features(x, torch.zeros(1, 4, dtype=torch.bool))
    assert "mask_token" not in v2_vit(use_mask_token=False).state_dict()
    assert v2_vit().mask_token.shape == (1, DIM) and not v2_vit().mask_token.any()


def test_lists_of_crops_and_masks(gen):
    model = _randomize(v2_vit(), gen).eval()
    crops = [torch.randn(2, 3, s, s, generator=gen) for s in (28, 28, 14, 42)]
    masks = [torch.rand(2, (c.shape[-1] // 14) ** 2, generator=gen) < 0.5 for c in crops]
    with torch.no_grad():
        cls = model(crops)
        outs = model.forward_features(crops, masks)
        each = [model.forward_features(c, m) for c, m in zip(crops, masks, strict=True)]
        ref = torch.cat([model(c) for c in crops])
    assert cls.shape == (8, DIM)
    assert torch.allclose(cls, ref, atol=1e-6)  # crops of one size share a pass
    assert len(outs) == 4
    for a, b in zip(outs, each, strict=True):
        assert torch.equal(a["x_norm_patchtokens"], b["x_norm_patchtokens"])
        assert a["masks"] is b["masks"]
    assert len(model.forward_features_list(crops[:2])) == 2  # no masks
    with pytest.raises(ValueError, match="2 batches of crops but 1 masks"):
        model.forward_features(crops[:2], masks[:1])


def test_attention_maps_and_intermediate_layers_cover_the_registers(gen):
    model = _randomize(v2_vit(), gen).eval()
    x = torch.randn(2, 3, 28, 28, generator=gen)
    with torch.no_grad():
        assert model.get_last_selfattention(x).shape == (2, HEADS, 1 + REG + 4, 1 + REG + 4)
        layers = model.get_intermediate_layers(x, n=2)
        assert torch.allclose(layers[-1], model.forward_tokens(x))


# ---------------------------------------------------------------- layers


def test_swiglu_hidden_size_and_forward(gen):
    assert swiglu_hidden_dim(4 * 1536) == 4096  # ViT-g
    assert swiglu_hidden_dim(4 * 1024) == 2736
    assert swiglu_hidden_dim(128) == 88  # int(85.33) = 85, up to a multiple of 8
    model = v2_vit(ffn_layer="swiglufused")
    mlp = model.blocks[0].mlp
    assert isinstance(mlp, SwiGLUFFN)
    hidden = (int(4 * DIM * 2 / 3) + 7) // 8 * 8
    assert mlp.w12.weight.shape == (2 * hidden, DIM) and mlp.w3.weight.shape == (DIM, hidden)
    assert v2_vit(ffn_layer="swiglu").blocks[0].mlp.w3.weight.shape == (DIM, hidden)
    x = torch.randn(5, DIM, generator=gen)
    a, b = (x @ mlp.w12.weight.T + mlp.w12.bias).split(hidden, dim=-1)
    ref = (F.silu(a) * b) @ mlp.w3.weight.T + mlp.w3.bias
    assert torch.allclose(mlp(x), ref, atol=1e-6)
    with torch.device("meta"):
        g = vit_giant2(patch_size=14)
    assert g.blocks[0].mlp.w12.weight.shape == (8192, 1536)
    with pytest.raises(ValueError, match="ffn_layer"):
        v2_vit(ffn_layer="geglu")


def test_layerscale_init_and_off():
    model = v2_vit(layerscale_init=1e-5)
    gammas = [m.gamma for m in model.modules() if isinstance(m, LayerScale)]
    assert len(gammas) == 4 and all(torch.equal(g, torch.full((DIM,), 1e-5)) for g in gammas)
    assert torch.equal(
        v2_vit(layerscale_init=None, init_values=0.1).blocks[1].ls2.gamma, torch.full((DIM,), 0.1)
    )
    for off in (None, 0.0):
        plain = v2_vit(layerscale_init=off)
        assert isinstance(plain.blocks[0].ls1, nn.Identity)
        assert not any(".ls" in k for k in plain.state_dict())
    with pytest.raises(ValueError, match="init_values"):
        v2_vit(layerscale_init=1e-5, init_values=1e-4)


def test_bias_switches():
    model = v2_vit(qkv_bias=False, proj_bias=False, ffn_bias=False, ffn_layer="swiglu")
    keys = set(model.state_dict())
    biases = ("qkv.bias", "attn.proj.bias", "w12.bias", "w3.bias")
    assert not any(k.endswith(biases) for k in keys)
    assert "blocks.0.norm1.bias" in keys and "patch_embed.proj.bias" in keys
    keys = set(v2_vit(qkv_bias=False).state_dict())
    assert "blocks.0.attn.proj.bias" in keys and "blocks.0.attn.qkv.bias" not in keys


def test_drop_path_uniform_and_ramp():
    assert drop_path_rates(0.4, 4, uniform=True) == [0.4] * 4
    assert drop_path_rates(0.3, 4) == pytest.approx([0.0, 0.1, 0.2, 0.3])
    model = v2_vit(depth=3, drop_path_rate=0.4, drop_path_uniform=True)
    assert [b.drop_path.p for b in model.blocks] == [0.4] * 3
    assert [b.drop_path.p for b in v2_vit(depth=3, drop_path_rate=0.4).blocks] == [0, 0.2, 0.4]


# ---------------------------------------------------------------- position interpolation


def test_interpolate_offset_uses_dinov2_scale_factor(gen):
    model = _randomize(v2_vit(img_size=56, interpolate_offset=0.1), gen)  # 4x4 table
    table = model.pos_embed.detach()
    pos = model.interpolate_pos_encoding(torch.zeros(1, 1 + 6, DIM), 28, 42).detach()
    grid = table[:, 1:].reshape(1, 4, 4, DIM).permute(0, 3, 1, 2)
    ref = F.interpolate(grid, scale_factor=(2.1 / 4, 3.1 / 4), mode="bicubic")
    assert torch.equal(pos[:, 0], table[:, 0])
    assert torch.equal(pos[0, 1:], ref[0].permute(1, 2, 0).reshape(6, DIM))
    by_size = F.interpolate(grid, size=(2, 3), mode="bicubic")  # what offset 0 does
    assert not torch.allclose(pos[0, 1:], by_size[0].permute(1, 2, 0).reshape(6, DIM))
    model.interpolate_antialias = True
    pos = model.interpolate_pos_encoding(torch.zeros(1, 1 + 6, DIM), 28, 42).detach()
    ref = F.interpolate(grid, scale_factor=(2.1 / 4, 3.1 / 4), mode="bicubic", antialias=True)
    assert torch.equal(pos[0, 1:], ref[0].permute(1, 2, 0).reshape(6, DIM))
    assert model.interpolate_pos_encoding(torch.zeros(1, 17, DIM), 56, 56) is model.pos_embed


def test_interpolation_runs_in_float32_and_casts_back(gen):
    table = torch.randn(1, 1 + 16, DIM, generator=gen).bfloat16()
    for offset, aa in ((0.0, False), (0.1, False), (0.0, True)):
        half = resize_pos_embed(table, (3, 5), offset, aa)
        assert half.dtype == torch.bfloat16
        assert torch.equal(half, resize_pos_embed(table.float(), (3, 5), offset, aa).bfloat16())
    double = resize_pos_embed(table.double(), (3, 5))  # wider types keep their precision
    assert double.dtype == torch.float64


def test_masks_and_registers_under_bf16_autocast(gen):
    model = v2_vit(ffn_layer="swiglufused")
    masks = torch.rand(2, 9, generator=gen) < 0.5
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model.forward_features(torch.randn(2, 3, 42, 42, generator=gen), masks)
    assert out["x_norm_patchtokens"].shape == (2, 9, DIM)
    assert torch.isfinite(out["x_prenorm"]).all()


# ---------------------------------------------------------------- checkpointing


def _grads(model, x, masks, seed):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    out = model.forward_features(x, masks)
    (out["x_norm_clstoken"].sin().sum() + out["x_norm_patchtokens"].cos().sum()).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_grad_checkpointing_same_gradients(gen, monkeypatch):
    model = (
        _randomize(
            v2_vit(depth=3, ffn_layer="swiglufused", drop_path_rate=0.3, drop_path_uniform=True),
            gen,
        )
        .double()
        .train()
    )
    x = torch.randn(4, 3, 42, 42, generator=gen, dtype=torch.float64)
    masks = torch.rand(4, 9, generator=gen) < 0.4
    ref = _grads(model, x, masks, seed=1)
    calls = []
    real = layers_module.checkpoint
    monkeypatch.setattr(
        layers_module, "checkpoint", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    got = _grads(model.set_grad_checkpointing(True), x, masks, seed=1)
    assert len(calls) == 3
    assert ref.keys() == got.keys() and "mask_token" in got and "register_tokens" in got
    for name, g in got.items():
        assert torch.allclose(g, ref[name], rtol=1e-10, atol=1e-12), name
    assert got["mask_token"].abs().sum() > 0  # the mask token is trained


# ---------------------------------------------------------------- sizes and names


def dinov2_param_formula(dim, depth, ffn="mlp", patch=14, img=518, registers=0):
    """Parameters of a DINOv2 ViT (LayerScale, mask token) term by term."""
    mlp_hidden = 4 * dim
    if ffn == "mlp":
        ffn_params = dim * mlp_hidden + mlp_hidden + mlp_hidden * dim + dim
    else:
        h = (int(mlp_hidden * 2 / 3) + 7) // 8 * 8
        ffn_params = dim * 2 * h + 2 * h + h * dim + dim
    block = (
        2 * dim
        + dim * 3 * dim
        + 3 * dim
        + dim * dim
        + dim
        + dim  # norm1 qkv proj ls1
        + 2 * dim
        + ffn_params
        + dim
    )  # norm2 ffn ls2
    tokens = dim + (1 + (img // patch) ** 2) * dim + registers * dim + dim  # cls pos reg mask
    return 3 * patch * patch * dim + dim + tokens + depth * block + 2 * dim


@pytest.mark.parametrize(
    "ctor, dim, depth, ffn, expected",
    [
        (vit_small, 384, 12, "mlp", 22_056_576),
        (vit_base, 768, 12, "mlp", 86_580_480),
        (vit_large, 1024, 24, "mlp", 304_368_640),
        (vit_giant2, 1536, 40, "swiglufused", 1_136_480_768),
    ],
)
def test_dinov2_parameter_counts(ctor, dim, depth, ffn, expected):
    with torch.device("meta"):  # shapes only: ViT-g is 1.1B parameters
        model = ctor(patch_size=14, img_size=518, layerscale_init=1e-5, use_mask_token=True)
        with_reg = ctor(
            patch_size=14,
            img_size=518,
            layerscale_init=1e-5,
            use_mask_token=True,
            num_register_tokens=4,
        )
    n = sum(p.numel() for p in model.parameters())
    assert n == expected == dinov2_param_formula(dim, depth, ffn)
    assert sum(p.numel() for p in with_reg.parameters()) == expected + 4 * dim
    assert model.embed_dim == dim and len(model.blocks) == depth


def official_keys(depth: int, ffn: str = "mlp", registers: bool = False) -> list[str]:
    """DINOv2's state-dict names (DinoVisionTransformer, block_chunks=0) in
    its order: tokens, patch embedding, blocks, final norm."""
    keys = ["cls_token", "pos_embed"] + (["register_tokens"] if registers else [])
    keys += ["mask_token", "patch_embed.proj.weight", "patch_embed.proj.bias"]
    fc = ("w12", "w3") if ffn != "mlp" else ("fc1", "fc2")
    layers = [
        "norm1.weight",
        "norm1.bias",
        "attn.qkv.weight",
        "attn.qkv.bias",
        "attn.proj.weight",
        "attn.proj.bias",
        "ls1.gamma",
        "norm2.weight",
        "norm2.bias",
        f"mlp.{fc[0]}.weight",
        f"mlp.{fc[0]}.bias",
        f"mlp.{fc[1]}.weight",
        f"mlp.{fc[1]}.bias",
        "ls2.gamma",
    ]
    for i in range(depth):
        keys += [f"blocks.{i}.{name}" for name in layers]
    return keys + ["norm.weight", "norm.bias"]


@pytest.mark.parametrize("ctor, depth", [(vit_small, 12), (vit_giant2, 40)])
@pytest.mark.parametrize("registers", [0, 4])
def test_state_dict_names_are_dinov2s(ctor, depth, registers):
    with torch.device("meta"):
        model = ctor(
            patch_size=14,
            img_size=518,
            layerscale_init=1e-5,
            use_mask_token=True,
            num_register_tokens=registers,
        )
    ffn = "swiglufused" if ctor is vit_giant2 else "mlp"
    assert list(model.state_dict()) == official_keys(depth, ffn, bool(registers))
    sd = model.state_dict()
    assert sd["pos_embed"].shape == (1, 1 + 37 * 37, model.embed_dim)
    assert sd["mask_token"].shape == (1, model.embed_dim)
    if registers:
        assert sd["register_tokens"].shape == (1, 4, model.embed_dim)


# ---------------------------------------------------------------- builders


def test_model_depth_replaces_the_sizes_number_of_blocks():
    cfg = apply_overrides(
        default_config(),
        [
            "model.backbone=vit_tiny",
            "model.depth=3",
            "model.out_dim=16",
            "model.drop_path_rate=0.2",
        ],
    )
    with torch.device("meta"):
        student, teacher = build_models(cfg)
        v3, _ = build_backbone("vit_small_dinov3", depth=2)
        own, _ = build_backbone("vit_small_dinov3")
    assert len(student.backbone.blocks) == len(teacher.backbone.blocks) == 3
    assert [b.drop_path.p for b in student.backbone.blocks] == pytest.approx([0, 0.1, 0.2])
    assert student.backbone.embed_dim == 192 and student.backbone.num_heads == 3
    assert len(v3.blocks) == 2 and len(own.blocks) == 12
    for name in ("resnet18", "convnext_tiny"):
        with pytest.raises(ValueError, match="ViT options depth do not apply"):
            build_backbone(name, depth=3)
    with pytest.raises(ConfigError, match="model.depth"):
        apply_overrides(default_config(), ["model.depth=0"])


def test_build_backbone_and_dino_models_take_the_dinov2_options():
    options = dict(
        num_register_tokens=4,
        layerscale_init=1e-5,
        ffn_layer="swiglu",
        qkv_bias=False,
        drop_path_uniform=True,
        interpolate_offset=0.1,
        interpolate_antialias=True,
        img_size=28,
        use_mask_token=True,
    )
    with torch.device("meta"):
        net, dim = build_backbone("vit_small", patch_size=14, drop_path_rate=0.2, **options)
        giant, _ = build_backbone("vit_giant2", patch_size=14)
        giant_mlp, _ = build_backbone("vit_giant2", patch_size=14, ffn_layer="mlp")
        large, dim_l = build_backbone("vit_large", patch_size=16)
    assert dim == 384 and net.num_register_tokens == 4 and net.mask_token is not None
    assert net.interpolate_offset == 0.1 and net.interpolate_antialias and net.img_size == 28
    assert [b.drop_path.p for b in net.blocks] == [0.2] * 12
    assert isinstance(net.blocks[0].mlp, SwiGLUFFN) and net.blocks[0].attn.qkv.bias is None
    assert isinstance(giant.blocks[0].mlp, SwiGLUFFN)  # the architecture's own FFN
    assert not isinstance(giant_mlp.blocks[0].mlp, SwiGLUFFN)
    assert dim_l == 1024 and len(large.blocks) == 24 and large.num_heads == 16
    student, teacher = build_dino_models(
        "vit_tiny",
        out_dim=16,
        patch_size=14,
        hidden_dim=16,
        bottleneck_dim=8,
        drop_path_rate=0.1,
        **options,
    )
    assert student.backbone.register_tokens.shape == (1, 4, 192)
    assert all(b.drop_path.p == 0.1 for b in student.backbone.blocks)
    assert all(b.drop_path.p == 0.0 for b in teacher.backbone.blocks)
    s, t = student.state_dict(), teacher.state_dict()
    assert all(torch.equal(s[k], t[k]) for k in s)
    with torch.no_grad():
        student.eval()
        crops = [torch.randn(2, 3, 28, 28), torch.randn(2, 3, 14, 14)]
        assert torch.equal(student(crops), teacher(crops))


def test_attention_equals_the_formula_forward_and_backward(gen):
    """q, k, v taken from the fused projection by ``unbind`` give the same
    output and gradients, bit for bit in float64, as indexing them (the
    published blocks' form), followed by softmax attention written out."""
    attn = _randomize(Attention(64, 4).double(), gen)
    x = torch.randn(3, 17, 64, generator=gen, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(3, 17, 64, generator=gen, dtype=torch.float64)
    ours = attn(x)
    ours.backward(grad)
    got = [t.grad.clone() for t in (x, attn.qkv.weight, attn.qkv.bias)]
    x.grad, attn.qkv.weight.grad, attn.qkv.bias.grad = None, None, None
    qkv = attn.qkv(x).reshape(3, 17, 3, 4, 16).permute(2, 0, 3, 1, 4)
    weights = ((qkv[0] * 16**-0.5) @ qkv[1].transpose(-2, -1)).softmax(dim=-1)
    ref = attn.proj((weights @ qkv[2]).transpose(1, 2).reshape(3, 17, 64))
    ref.backward(grad)
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)
    for a, b in zip(got, (x.grad, attn.qkv.weight.grad, attn.qkv.bias.grad), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
