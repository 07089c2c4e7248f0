"""Tests of dino_opt.models: ViT, DINO head, multi-crop wrapper and the builders."""

import math
import sys

import pytest
import torch
import torch.nn.functional as F
from dino_opt.config import apply_overrides, default_config
from dino_opt.models import (
    BACKBONES,
    DINOHead,
    MultiCropWrapper,
    VisionTransformer,
    WeightNormLinear,
    build_backbone,
    build_dino_models,
    eval_mode,
    running_stats_kept,
    vit_base,
    vit_small,
    vit_tiny,
)
from dino_opt.models import layers as layers_module
from dino_opt.models.vit import Attention, drop_path
from dino_opt.models.vit_dinov3 import DinoV3VisionTransformer
from dino_opt.train import build_models
from torch import nn


def n_params(m: nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


def vit_param_formula(dim, depth, patch, img=224, chans=3, mlp_ratio=4):
    """Parameter count of a DINO ViT from its architecture, term by term."""
    hidden = dim * mlp_ratio
    patch_embed = chans * patch * patch * dim + dim
    tokens = dim + (1 + (img // patch) ** 2) * dim  # CLS + position table
    block = (
        2 * dim  # norm1
        + dim * 3 * dim
        + 3 * dim  # qkv with bias
        + dim * dim
        + dim  # proj
        + 2 * dim  # norm2
        + dim * hidden
        + hidden  # fc1
        + hidden * dim
        + dim  # fc2
    )
    return patch_embed + tokens + depth * block + 2 * dim


def small_vit(**kw) -> VisionTransformer:
    """A ViT small enough for a 2-core CPU: 32x32 native size, 4x4 grid."""
    cfg = dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=4)
    cfg.update(kw)
    return VisionTransformer(**cfg)


# ---------------------------------------------------------------- parameter counts


@pytest.mark.parametrize(
    "ctor, patch, dim, expected",
    [
        (vit_tiny, 16, 192, 5_524_416),
        (vit_small, 16, 384, 21_665_664),
        (vit_small, 8, 384, 21_670_272),
        (vit_base, 16, 768, 85_798_656),
    ],
)
def test_vit_parameter_counts(ctor, patch, dim, expected):
    with torch.device("meta"):  # shapes only: skips the cost of initialising 86M weights
        model = ctor(patch_size=patch)
    assert model.embed_dim == dim
    assert n_params(model) == expected
    assert vit_param_formula(dim, 12, patch) == expected


def test_resnet_parameter_counts():
    pytest.importorskip("torchvision")
    # torchvision's counts (11,689,512 and 25,557,032) minus the removed fc layer.
    for name, dim, expected in [("resnet18", 512, 11_176_512), ("resnet50", 2048, 23_508_032)]:
        with torch.device("meta"):
            model, embed_dim = build_backbone(name)
        assert embed_dim == dim
        assert isinstance(model.fc, nn.Identity)
        assert n_params(model) == expected
    model, _ = build_backbone("resnet18")
    with torch.no_grad():
        assert model.eval()(torch.randn(2, 3, 32, 32)).shape == (2, 512)


def test_head_parameter_count():
    with torch.device("meta"):
        head = DINOHead(384, 65536)
    mlp = (384 * 2048 + 2048) + (2048 * 2048 + 2048) + (2048 * 256 + 256)
    assert n_params(head) == mlp + 256 * 65536 + 65536


# ---------------------------------------------------------------- ViT forward


def test_vit_output_shapes_224_and_96():
    torch.manual_seed(0)
    model = vit_tiny(patch_size=16).eval()
    assert model.pos_embed.shape == (1, 197, 192)
    x = torch.randn(1, 3, 224, 224)
    with torch.no_grad():
        tokens = model.forward_tokens(x)
        assert tokens.shape == (1, 1 + 196, 192)
        assert torch.equal(model(x), tokens[:, 0])  # the CLS token
        out = model.forward_features(x)  # DINOv2's dict
        assert torch.equal(out["x_norm_clstoken"], tokens[:, 0])
        assert torch.equal(out["x_norm_patchtokens"], tokens[:, 1:])
        assert out["x_norm_regtokens"].shape == (1, 0, 192) and out["masks"] is None
        assert torch.equal(model.norm(out["x_prenorm"]), tokens)
        assert model.forward_tokens(torch.randn(1, 3, 96, 96)).shape == (1, 1 + 36, 192)
        assert model(torch.randn(3, 3, 96, 96)).shape == (3, 192)


def test_vit_patch8_shapes():
    model = small_vit(patch_size=8, img_size=64).eval()  # native grid 8x8
    with torch.no_grad():
        assert model.forward_tokens(torch.randn(2, 3, 64, 64)).shape == (2, 65, 32)
        assert model.forward_tokens(torch.randn(2, 3, 24, 24)).shape == (2, 10, 32)
        assert model.forward_tokens(torch.randn(2, 3, 64, 40)).shape == (2, 1 + 8 * 5, 32)


def test_pos_embed_native_size_skips_interpolation(monkeypatch):
    model = small_vit(img_size=64, patch_size=16).eval()  # native grid 4x4
    calls = []
    real = F.interpolate

    def counting(*args, **kwargs):
        calls.append(kwargs.get("size"))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "interpolate", counting)
    tokens = torch.zeros(1, 17, 32)
    assert model.interpolate_pos_encoding(tokens, 64, 64) is model.pos_embed
    with torch.no_grad():
        model(torch.randn(1, 3, 64, 64))
    assert calls == []
    with torch.no_grad():
        model(torch.randn(1, 3, 32, 32))
    assert calls == [(2, 2)]


def test_pos_embed_interpolation_values():
    torch.manual_seed(0)
    model = small_vit(img_size=64, patch_size=8)  # 8x8 table
    table = model.pos_embed.detach()
    pos = model.interpolate_pos_encoding(torch.zeros(1, 1 + 16, 32), 32, 32).detach()
    assert pos.shape == (1, 17, 32)
    assert torch.equal(pos[:, 0], table[:, 0])  # CLS entry kept as is
    grid = table[0, 1:].reshape(8, 8, 32).permute(2, 0, 1)[None]
    ref = F.interpolate(grid, size=(4, 4), mode="bicubic", align_corners=False)
    assert torch.allclose(pos[0, 1:], ref[0].permute(1, 2, 0).reshape(16, 32), atol=1e-6)

    # A per-channel constant table stays constant on any grid (no row/column mix-up).
    with torch.no_grad():
        model.pos_embed[:, 1:] = torch.arange(32.0)
    pos = model.interpolate_pos_encoding(torch.zeros(1, 1 + 3 * 5, 32), 24, 40).detach()
    assert torch.allclose(pos[0, 1:], torch.arange(32.0).expand(15, 32), atol=1e-5)


def test_pos_embed_interpolation_is_row_major():
    # A table that varies along rows only must give a result that varies along rows only.
    model = small_vit(img_size=64, patch_size=8)
    rows = torch.arange(8.0).repeat_interleave(8)  # value = row index
    with torch.no_grad():
        model.pos_embed[0, 1:] = rows[:, None]
    pos = model.interpolate_pos_encoding(torch.zeros(1, 1 + 4 * 6, 32), 32, 48).detach()
    grid = pos[0, 1:, 0].reshape(4, 6)
    assert torch.allclose(grid, grid[:, :1].expand(4, 6))  # constant along each row
    assert (grid[1:, 0] > grid[:-1, 0]).all()  # increasing down the rows


def test_sdpa_attention_equals_explicit_float64():
    torch.manual_seed(0)
    dim, heads, b, n = 16, 4, 3, 7
    attn = Attention(dim, heads).double()
    x = torch.randn(b, n, dim, dtype=torch.float64)

    wq, wk, wv = attn.qkv.weight.split(dim)
    bq, bk, bv = attn.qkv.bias.split(dim)

    def split_heads(t):
        return t.reshape(b, n, heads, dim // heads).transpose(1, 2)

    q, k, v = (split_heads(x @ w.T + bias) for w, bias in ((wq, bq), (wk, bk), (wv, bv)))
    weights = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(dim // heads), dim=-1)
    out = (weights @ v).transpose(1, 2).reshape(b, n, dim)
    ref = out @ attn.proj.weight.T + attn.proj.bias

    assert torch.allclose(attn(x), ref, rtol=1e-12, atol=1e-12)
    assert torch.allclose(attn.attention_weights(x), weights, rtol=1e-12, atol=1e-12)


def test_get_last_selfattention_and_intermediate_layers():
    torch.manual_seed(0)
    model = small_vit(depth=3).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        attn = model.get_last_selfattention(x)
        assert attn.shape == (2, 4, 17, 17)
        assert torch.allclose(attn.sum(-1), torch.ones(2, 4, 17))
        layers = model.get_intermediate_layers(x, n=2)
        assert len(layers) == 2
        assert torch.allclose(layers[-1], model.forward_tokens(x))
        assert not torch.allclose(layers[0], layers[1])
    with pytest.raises(ValueError):
        model.get_intermediate_layers(x, n=4)


def test_vit_bf16_autocast_cpu():
    model = small_vit()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(torch.randn(2, 3, 32, 32))
    assert out.shape == (2, 32) and torch.isfinite(out).all()


# ---------------------------------------------------------------- checkpointing


def _loss_and_grads(model, x, seed):
    model.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    torch.manual_seed(seed)
    out = model(x)
    (out.sin().sum()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return out.detach(), grads, x.grad.clone()


@pytest.mark.parametrize("dpr", [0.0, 0.5])
def test_grad_checkpointing_same_output_and_grads(monkeypatch, dpr):
    torch.manual_seed(0)
    model = small_vit(depth=3, drop_path_rate=dpr).double().train()
    x = torch.randn(4, 3, 32, 32, dtype=torch.float64)
    out_ref, grads_ref, gx_ref = _loss_and_grads(model, x, seed=1)

    calls = []
    real = layers_module.checkpoint

    def counting(fn, *args, **kwargs):
        calls.append(kwargs.get("use_reentrant"))
        return real(fn, *args, **kwargs)

    monkeypatch.setattr(layers_module, "checkpoint", counting)
    assert model.set_grad_checkpointing(True) is model
    out, grads, gx = _loss_and_grads(model, x, seed=1)
    assert calls == [False] * 3  # every block, non-reentrant

    # drop_path draws the same masks in the recomputation (RNG state restored).
    assert torch.allclose(out, out_ref, rtol=1e-12, atol=1e-12)
    assert torch.allclose(gx, gx_ref, rtol=1e-10, atol=1e-12)
    for name, g in grads.items():
        assert torch.allclose(g, grads_ref[name], rtol=1e-10, atol=1e-12), name

    # Not used in eval mode or without autograd.
    calls.clear()
    with torch.no_grad():
        model(x)
    model.eval()
    model(x)
    assert calls == []
    model.set_grad_checkpointing(False).train()
    model(x)
    assert calls == []


# ---------------------------------------------------------------- drop path


def test_drop_path_schedule_and_eval_identity():
    model = small_vit(depth=4, drop_path_rate=0.3)
    rates = [b.drop_path.p for b in model.blocks]
    assert rates == pytest.approx([0.0, 0.1, 0.2, 0.3])

    torch.manual_seed(0)
    plain = small_vit(depth=4, drop_path_rate=0.0)
    plain.load_state_dict(model.state_dict())
    x = torch.randn(8, 3, 32, 32)
    model.eval()
    plain.eval()
    with torch.no_grad():
        assert torch.equal(model(x), plain(x))
        model.train()
        torch.manual_seed(3)
        assert not torch.allclose(model(x), plain(x))


def test_drop_path_function():
    torch.manual_seed(0)
    x = torch.ones(20000, 3, 2)
    assert drop_path(x, 0.5, training=False) is x
    assert drop_path(x, 0.0, training=True) is x
    y = drop_path(x, 0.25, training=True)
    per_sample = y.reshape(20000, -1)
    # Whole samples are dropped or kept; kept ones are scaled by 1 / (1 - p).
    assert ((per_sample == 0).all(1) | (per_sample == 1 / 0.75).all(1)).all()
    dropped = (per_sample[:, 0] == 0).double().mean().item()
    assert abs(dropped - 0.25) < 0.015  # > 4 standard deviations
    assert abs(y.mean().item() - 1.0) < 0.03


# ---------------------------------------------------------------- multi-crop wrapper


def test_multicrop_wrapper_matches_per_crop_and_groups_by_resolution():
    torch.manual_seed(0)
    backbone = small_vit().double().eval()
    head = DINOHead(32, 24, nlayers=2, hidden_dim=16, bottleneck_dim=8).double().eval()
    wrapper = MultiCropWrapper(backbone, head)
    calls, passes = [], []
    # each resolution group is embedded as one batch; the ViT packs the
    # groups into one pass through its blocks
    backbone.patch_embed.register_forward_hook(lambda m, inp, out: calls.append(inp[0].shape))
    backbone.blocks[0].register_forward_hook(lambda m, inp, out: passes.append(inp[0].shape))

    sizes = [32, 32, 16, 16, 16]
    crops = [torch.randn(2, 3, s, s, dtype=torch.float64) for s in sizes]
    with torch.no_grad():
        out = wrapper(crops)
        assert calls == [(4, 3, 32, 32), (6, 3, 16, 16)]
        assert passes == [(4 * 17 + 6 * 5, 32)]  # the rows of both sizes at once
        calls.clear()
        ref = torch.cat([head(backbone(c)) for c in crops])
    assert out.shape == (10, 24)
    assert torch.allclose(out, ref, rtol=1e-10, atol=1e-12)

    # Groups are runs of consecutive equal sizes; order is kept.
    calls.clear()
    with torch.no_grad():
        out = wrapper([crops[0], crops[2], crops[1]])
    assert len(calls) == 3
    assert torch.allclose(out, torch.cat([ref[0:2], ref[4:6], ref[2:4]]), atol=1e-12)

    # A single tensor is one crop.
    with torch.no_grad():
        assert torch.allclose(wrapper(crops[2]), ref[4:6], atol=1e-12)
    with pytest.raises(ValueError):
        wrapper([])


def test_multicrop_wrapper_backward():
    torch.manual_seed(0)
    wrapper = MultiCropWrapper(small_vit(), DINOHead(32, 24, hidden_dim=16, bottleneck_dim=8))
    out = wrapper([torch.randn(2, 3, 32, 32), torch.randn(2, 3, 16, 16)])
    out.sum().backward()
    assert wrapper.backbone.pos_embed.grad is not None
    assert wrapper.head.last_layer.weight_v.grad is not None


# ---------------------------------------------------------------- DINO head


def test_dino_head_shapes_and_normalisation():
    torch.manual_seed(0)
    head = DINOHead(32, 100, hidden_dim=64, bottleneck_dim=16)
    assert sum(isinstance(m, nn.Linear) for m in head.mlp.modules()) == 3
    seen = []
    head.last_layer.register_forward_pre_hook(lambda m, inp: seen.append(inp[0]))
    x = torch.randn(5, 32)
    out = head(x)
    assert out.shape == (5, 100)
    assert torch.allclose(seen[0].norm(dim=-1), torch.ones(5), atol=1e-6)

    # Weight-normalised last layer: unit rows, norms fixed when norm_last_layer.
    w = head.last_layer.weight
    assert torch.allclose(w.norm(dim=1), torch.ones(100), atol=1e-6)
    assert not head.last_layer.weight_g.requires_grad
    assert head.last_layer.weight_v.requires_grad
    assert set(head.last_layer.state_dict()) == {"weight_g", "weight_v"}
    # Since inputs and prototypes have unit norm, outputs are cosines.
    assert out.abs().max() <= 1 + 1e-5

    opt = torch.optim.SGD([p for p in head.parameters() if p.requires_grad], lr=1.0)
    head(x).pow(2).sum().backward()
    opt.step()
    assert torch.allclose(head.last_layer.weight.norm(dim=1), torch.ones(100), atol=1e-6)


def test_weight_norm_linear_matches_torch_weight_norm():
    torch.manual_seed(0)
    head = DINOHead(8, 12, nlayers=1, bottleneck_dim=6, norm_last_layer=False)
    assert isinstance(head.mlp, nn.Linear)
    assert head.last_layer.weight_g.requires_grad
    with torch.no_grad():
        head.last_layer.weight_g.uniform_(0.5, 2.0)
    ref = nn.utils.parametrizations.weight_norm(nn.Linear(6, 12, bias=False))
    with torch.no_grad():
        ref.parametrizations.weight.original0.copy_(head.last_layer.weight_g)
        ref.parametrizations.weight.original1.copy_(head.last_layer.weight_v)
    x = torch.randn(4, 6)
    assert torch.allclose(head.last_layer(x), ref(x), atol=1e-6)
    assert torch.allclose(
        head.last_layer.weight.norm(dim=1), head.last_layer.weight_g.squeeze(1), atol=1e-6
    )


@pytest.mark.parametrize("rows", [3, 40, 64, 200])  # fewer rows than inputs (64) and more
def test_weight_norm_linear_both_forms_equal_torch_weight_norm_in_float64(rows):
    # fewer rows than inputs: the outputs are scaled by g / ||v||; else the
    # normalised weight is formed; values and gradients as torch's weight_norm
    g = torch.Generator().manual_seed(rows)
    layer = WeightNormLinear(64, 96).double()
    ref = nn.utils.parametrizations.weight_norm(nn.Linear(64, 96, bias=False).double())
    with torch.no_grad():
        layer.weight_g.copy_(torch.rand(96, 1, generator=g, dtype=torch.float64) + 0.5)
        layer.weight_v.copy_(torch.randn(96, 64, generator=g, dtype=torch.float64))
        ref.parametrizations.weight.original0.copy_(layer.weight_g)
        ref.parametrizations.weight.original1.copy_(layer.weight_v)
    x = torch.randn(rows, 64, generator=g, dtype=torch.float64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    out, out_ref = layer(x), ref(x_ref)
    torch.testing.assert_close(out, out_ref, rtol=1e-12, atol=1e-12)
    up = torch.randn(rows, 96, generator=g, dtype=torch.float64)
    (out * up).sum().backward()
    (out_ref * up).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(
        layer.weight_g.grad, ref.parametrizations.weight.original0.grad, rtol=1e-10, atol=1e-12
    )
    torch.testing.assert_close(
        layer.weight_v.grad, ref.parametrizations.weight.original1.grad, rtol=1e-10, atol=1e-12
    )


@pytest.mark.parametrize("rows", [8, 200])
@pytest.mark.parametrize("norm_last_layer", [True, False])
def test_a_frozen_last_layer_computes_no_weight_gradient(rows, norm_last_layer):
    # frozen: the same outputs and input gradient, in float64, on both forward
    # forms (outputs scaled, weight formed), and no gradient for its weights
    g = torch.Generator().manual_seed(rows)
    head = DINOHead(16, 96, nlayers=2, hidden_dim=24, bottleneck_dim=64).double()
    head.norm_last_layer = norm_last_layer
    head.last_layer.weight_g.requires_grad_(not norm_last_layer)
    with torch.no_grad():
        head.last_layer.weight_g.copy_(torch.rand(96, 1, generator=g, dtype=torch.float64) + 0.5)
    x = torch.randn(rows, 16, generator=g, dtype=torch.float64)
    up = torch.randn(rows, 96, generator=g, dtype=torch.float64)
    results = {}
    for frozen in (False, True):
        head.zero_grad(set_to_none=True)
        head.last_layer.frozen = frozen
        xi = x.clone().requires_grad_()
        out = head(xi)
        (out * up).sum().backward()
        results[frozen] = out.detach(), xi.grad, head.mlp[0].weight.grad
    for a, b in zip(results[False], results[True], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert head.last_layer.weight_v.grad is None and head.last_layer.weight_g.grad is None


def test_dino_head_batchnorm_and_init():
    head = DINOHead(32, 10, use_bn=True, nlayers=3, hidden_dim=64, bottleneck_dim=16)
    assert sum(isinstance(m, nn.BatchNorm1d) for m in head.mlp.modules()) == 2
    assert head(torch.randn(4, 32)).shape == (4, 10)
    for m in head.mlp.modules():
        if isinstance(m, nn.Linear):
            assert torch.count_nonzero(m.bias) == 0
            assert abs(m.weight.mean().item()) < 0.003
            assert 0.018 < m.weight.std().item() < 0.022
    with pytest.raises(ValueError):
        DINOHead(32, 10, nlayers=0)


# ---------------------------------------------------------------- builders


def test_build_dino_models_teacher_equals_student():
    torch.manual_seed(0)
    student, teacher = build_dino_models(
        "vit_tiny", out_dim=64, patch_size=16, drop_path_rate=0.2, hidden_dim=64, bottleneck_dim=16
    )
    assert isinstance(student, MultiCropWrapper) and isinstance(teacher, MultiCropWrapper)
    s_state, t_state = student.state_dict(), teacher.state_dict()
    assert s_state.keys() == t_state.keys()
    for k in s_state:
        assert torch.equal(s_state[k], t_state[k]), k
        assert s_state[k].data_ptr() != t_state[k].data_ptr(), k  # copies, not shared
    assert not any(p.requires_grad for p in teacher.parameters())
    trainable = {n for n, p in student.named_parameters() if p.requires_grad}
    assert trainable == {n for n, _ in student.named_parameters()} - {"head.last_layer.weight_g"}
    assert student.backbone.blocks[-1].drop_path.p == pytest.approx(0.2)
    assert all(b.drop_path.p == 0.0 for b in teacher.backbone.blocks)

    x = [torch.randn(2, 3, 96, 96), torch.randn(2, 3, 64, 64)]
    student.eval()
    with torch.no_grad():
        assert torch.equal(student(x), teacher(x))
        # Training-mode teacher is still deterministic: it has no drop path.
        assert torch.equal(teacher.train()(x[1]), teacher(x[1]))


def test_build_backbone_vits_and_errors(monkeypatch):
    with torch.device("meta"):
        model, dim = build_backbone("vit_small", patch_size=8, drop_path_rate=0.0)
    assert dim == 384 and model.patch_size == 8
    assert BACKBONES == (
        "vit_tiny",
        "vit_small",
        "vit_base",
        "vit_large",
        "vit_giant2",
        "vit_small_dinov3",
        "vit_small_plus_dinov3",
        "vit_base_dinov3",
        "vit_large_dinov3",
        "vit_large_plus_dinov3",
        "vit_huge_plus_dinov3",
        "vit_7b_dinov3",
        "resnet18",
        "resnet50",
        "convnext_tiny",
        "convnext_small",
        "convnext_base",
        "convnext_large",
    )
    with pytest.raises(ValueError, match="vit_tiny, vit_small, vit_base, vit_large, vit_giant2"):
        build_backbone("vit_huge")
    with pytest.raises(ValueError, match="ResNet.*num_register_tokens"):
        build_backbone("resnet18", num_register_tokens=4)

    monkeypatch.setitem(sys.modules, "torchvision", None)
    monkeypatch.setitem(sys.modules, "torchvision.models", None)
    with pytest.raises(ImportError, match="torchvision"):
        build_backbone("resnet50")


def test_the_dinov3_sizes_are_backbones_of_the_config():
    # model.backbone=vit_*_dinov3 builds DINOv3's ViT (RoPE, 4 storage tokens,
    # LayerScale) with the recipe's options; the ViT options its size fixes are refused.
    cfg = apply_overrides(
        default_config(),
        ["model.backbone=vit_small_dinov3", "model.out_dim=32", "recipe.name=dinov2"],
    )
    student, teacher = build_models(cfg)
    backbone = student.backbone
    assert isinstance(backbone, DinoV3VisionTransformer) and backbone.embed_dim == 384
    assert backbone.n_storage_tokens == 4 and backbone.mask_token is not None
    # DINOv3's ViT-S/16 (21,596,160) and the mask token the recipe asks for
    assert sum(p.numel() for p in backbone.parameters()) == 21_596_160 + 384
    feats = backbone.forward_features(torch.randn(2, 3, 32, 32))
    assert feats["x_norm_clstoken"].shape == (2, 384)
    assert feats["x_norm_patchtokens"].shape == (2, 4, 384)
    bad = apply_overrides(
        default_config(), ["model.backbone=vit_base_dinov3", "model.num_register_tokens=2"]
    )
    with pytest.raises(
        ValueError, match="'vit_base_dinov3' is a DINOv3 size, which fixes num_register_tokens"
    ):
        build_models(bad)


@pytest.mark.parametrize("training", [True, False])
def test_eval_mode_sets_eval_inside_and_restores_the_mode_also_on_an_error(training):
    net = nn.Sequential(nn.Linear(3, 3), nn.Dropout(0.5), nn.BatchNorm1d(3)).train(training)
    net[2].train(not training)  # a submodule whose mode differs from its parent's
    with eval_mode(net) as inside:
        assert inside is net and not any(m.training for m in net.modules())
        x = torch.randn(4, 3)
        assert torch.equal(net(x), net(x))  # no dropout, running statistics
    assert net.training is training and net[0].training is training
    assert net[2].training is not training  # its own mode, not its parent's
    with pytest.raises(RuntimeError, match="inside"), eval_mode(net):
        raise RuntimeError("inside")
    assert [m.training for m in net.modules()] == [training, training, training, not training]


def test_running_stats_kept_leaves_batchnorm_statistics_and_restores_momentum():
    net = nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.BatchNorm2d(4, momentum=None)
    ).train()
    g = torch.Generator().manual_seed(0)
    net(torch.randn(8, 3, 9, 9, generator=g) * 3 + 1)  # statistics away from their start
    before = {k: v.clone() for k, v in net.state_dict().items() if "running" in k}
    x = torch.randn(8, 3, 9, 9, generator=g) * 5 - 2
    with running_stats_kept(net) as inside:
        assert inside is net
        out = net(x)
    after = {k: v for k, v in net.state_dict().items() if "running" in k}
    assert all(torch.equal(before[k], after[k]) for k in before)
    # still training mode: normalised by the batch's own statistics
    h = net[0](x)
    var = h.var((0, 2, 3), unbiased=False, keepdim=True)
    want = (h - h.mean((0, 2, 3), keepdim=True)) / torch.sqrt(var + 1e-5)
    with running_stats_kept(net):
        got = net[1](h)
    w, b = net[1].weight[None, :, None, None], net[1].bias[None, :, None, None]
    assert torch.allclose(got, want * w + b, atol=1e-5) and out.shape == (8, 4, 7, 7)
    assert (net[1].momentum, net[3].momentum) == (0.1, None)
    with pytest.raises(RuntimeError, match="inside"), running_stats_kept(net):
        raise RuntimeError("inside")
    assert (net[1].momentum, net[3].momentum) == (0.1, None)
    net(x)  # outside, the statistics move again
    assert not torch.equal(before["1.running_mean"], net.state_dict()["1.running_mean"])
