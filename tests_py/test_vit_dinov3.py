"""DINOv3's backbones: the RoPE against the published formula (float64), its
augmentations, attention against a plain softmax(QK^T)V, the sizes'
parameter counts against timm's ports, equal features to timm's port with
its weights transferred (float64), activation checkpointing, masks, untied
norms, and the errors on bad input."""

import math

import pytest
import torch
from dino_opt import dinov3
from dino_opt.models import (
    DINOV3_SIZES,
    DinoV3VisionTransformer,
    apply_block_options,
    convert_dinov3_state_dict,
    convert_timm_dinov3_state_dict,
    vit_7b_dinov3,
)
from dino_opt.models import vit_dinov3 as v3
from dino_opt.models.rope import (
    RopePositionEmbedding,
    apply_rope,
    augment_coords,
    patch_coords,
    rope_periods,
)
from dino_opt.weights.layouts.dinov3 import from_hf_dinov3
from torch import nn

F64 = torch.float64


def tiny(**kw) -> DinoV3VisionTransformer:
    """A DINOv3 ViT small enough for a 2-core CPU (heads of 8 channels)."""
    cfg = dict(embed_dim=32, depth=2, num_heads=4, ffn_ratio=4.0, use_mask_token=True)
    return DinoV3VisionTransformer(**(cfg | kw))


def randomize(model: nn.Module, gen: torch.Generator) -> nn.Module:
    """Every parameter redrawn (LayerScale and norm scales near 1), so that
    no branch is hidden behind LayerScale's 1e-5."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=p.dtype)
            scale_like = "gamma" in name or ("norm" in name and name.endswith("weight"))
            p.copy_(1 + 0.3 * noise if scale_like else 0.05 * noise)
    return model


# ------------------------------------------------------------------ RoPE


def reference_rope(h, w, head_dim, normalize="separate", base=100.0, periods=None):
    """sin, cos (h * w, head_dim) from the published formula, element by element
    in Python floats: coordinate = 2 (index + 0.5) / side - 1, angle = 2 pi
    coordinate / period, row angles then column angles, repeated."""
    n = head_dim // 4
    if periods is None:
        periods = [base ** (2 * k / (head_dim // 2)) for k in range(n)]
    side = {"separate": (h, w), "min": (min(h, w),) * 2, "max": (max(h, w),) * 2}[normalize]
    sin, cos = [], []
    for i in range(h):
        for j in range(w):
            coords = (2 * (i + 0.5) / side[0] - 1, 2 * (j + 0.5) / side[1] - 1)
            angles = [2 * math.pi * c / p for c in coords for p in periods] * 2
            sin.append([math.sin(a) for a in angles])
            cos.append([math.cos(a) for a in angles])
    return torch.tensor(sin, dtype=F64), torch.tensor(cos, dtype=F64)


@pytest.mark.parametrize("normalize", ["separate", "min", "max"])
@pytest.mark.parametrize("grid", [(3, 5), (4, 4)])
def test_rope_matches_the_formula(normalize, grid):
    rope = RopePositionEmbedding(64, 4, normalize_coords=normalize, dtype=F64)
    sin, cos = rope(*grid)
    ref_sin, ref_cos = reference_rope(*grid, 16, normalize)
    assert sin.shape == (grid[0] * grid[1], 16)
    torch.testing.assert_close(sin, ref_sin, rtol=0, atol=1e-13)
    torch.testing.assert_close(cos, ref_cos, rtol=0, atol=1e-13)


def test_rope_periods_from_min_and_max():
    periods = rope_periods(32, None, 0.5, 40.0, dtype=F64)
    ref = [0.5 * (40.0 / 0.5) ** (k / 7) for k in range(8)]
    torch.testing.assert_close(periods, torch.tensor(ref, dtype=F64), rtol=1e-14, atol=0)
    rope = RopePositionEmbedding(64, 2, base=None, min_period=0.5, max_period=40.0, dtype=F64)
    sin, cos = rope(2, 3)
    ref_sin, ref_cos = reference_rope(2, 3, 32, periods=ref)
    torch.testing.assert_close(sin, ref_sin, rtol=0, atol=1e-13)
    torch.testing.assert_close(cos, ref_cos, rtol=0, atol=1e-13)


def test_float32_rope_is_close_to_the_formula():
    sin, cos = RopePositionEmbedding(384, 6)(14, 14)
    ref_sin, ref_cos = reference_rope(14, 14, 64)
    assert sin.dtype == torch.float32
    torch.testing.assert_close(sin.double(), ref_sin, rtol=0, atol=2e-5)
    torch.testing.assert_close(cos.double(), ref_cos, rtol=0, atol=2e-5)


def test_apply_rope_rotates_pairs_of_the_patch_tokens_only(gen):
    head_dim, prefix, (h, w) = 8, 5, (2, 3)
    x = torch.randn(2, 3, prefix + h * w, head_dim, generator=gen, dtype=F64)
    sin, cos = reference_rope(h, w, head_dim)
    out = apply_rope(x, sin, cos)
    assert torch.equal(out[:, :, :prefix], x[:, :, :prefix])
    half = head_dim // 2
    a, b = x[..., prefix:, :half], x[..., prefix:, half:]
    s, c = sin[:, :half], cos[:, :half]  # the two halves share their angles
    torch.testing.assert_close(out[..., prefix:, :half], a * c - b * s, rtol=0, atol=1e-15)
    torch.testing.assert_close(out[..., prefix:, half:], b * c + a * s, rtol=0, atol=1e-15)


def test_rope_scores_depend_on_offsets_only_so_a_shift_keeps_them(gen):
    # <R(a) q, R(b) k> = <q, R(b - a) k>: shifting every coordinate keeps all scores.
    rope = RopePositionEmbedding(32, 2, shift_coords=0.7, dtype=F64)
    q, k = torch.randn(2, 12, 16, generator=gen, dtype=F64)
    fixed = rope.eval()(3, 4)
    shifted = rope.train()(3, 4)
    assert not torch.allclose(shifted[0], fixed[0])
    scores = apply_rope(q, *fixed) @ apply_rope(k, *fixed).T
    torch.testing.assert_close(apply_rope(q, *shifted) @ apply_rope(k, *shifted).T, scores)


def test_augmentations_stay_in_their_ranges():
    torch.manual_seed(0)
    base = patch_coords(4, 6, dtype=F64)
    shifts = torch.stack([augment_coords(base, shift=0.3)[0] - base[0] for _ in range(400)])
    assert shifts.abs().max() <= 0.3 and shifts.abs().max() > 0.28
    assert not torch.allclose(shifts[:, 0], shifts[:, 1])  # one draw per axis
    jit = torch.stack([augment_coords(base, jitter=1.5)[0] / base[0] for _ in range(400)])
    assert jit.min() >= 1 / 1.5 - 1e-12 and jit.max() <= 1.5 + 1e-12
    assert jit.min() < 1 / 1.4 and jit.max() > 1.4
    assert not torch.allclose(jit[:, 0], jit[:, 1])  # per axis
    res = torch.stack([augment_coords(base, rescale=2.0)[0] / base[0] for _ in range(400)])
    torch.testing.assert_close(res[:, 0], res[:, 1])  # one factor for both axes
    assert res.min() >= 0.5 - 1e-12 and res.max() <= 2 + 1e-12
    assert res.min() < 0.55 and res.max() > 1.8


def test_augmentations_only_in_training_mode():
    rope = RopePositionEmbedding(32, 2, shift_coords=0.1, jitter_coords=1.2, rescale_coords=2)
    rope.eval()
    assert not rope.augmenting
    assert torch.equal(rope(3, 3)[0], rope(3, 3)[0])
    rope.train()
    assert rope.augmenting and not torch.equal(rope(3, 3)[0], rope(3, 3)[0])
    plain = RopePositionEmbedding(32, 2).train()
    assert not plain.augmenting
    assert torch.equal(plain(3, 3)[0], rope.eval()(3, 3)[0])


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(base=None), "give base or min_period"),
        (dict(min_period=1.0, max_period=10.0), "give base or min_period"),
        (dict(base=None, min_period=1.0), "give base or min_period"),
        (dict(normalize_coords="mean"), "normalize_coords"),
        (dict(jitter_coords=0.5), "jitter_coords"),
        (dict(shift_coords=-1.0), "shift_coords"),
    ],
)
def test_rope_refuses_bad_settings(kw, match):
    with pytest.raises(ValueError, match=match):
        RopePositionEmbedding(32, 2, **kw)
    with pytest.raises(ValueError, match="multiple of 4"):
        RopePositionEmbedding(30, 3)  # heads of 10


def test_attention_equals_plain_softmax_attention(gen):
    attn = randomize(v3.RopeAttention(32, 4, qkv_bias=True, mask_k_bias=True).double(), gen)
    prefix, (h, w), heads, hd = 5, (3, 4), 4, 8
    x = torch.randn(2, prefix + h * w, 32, generator=gen, dtype=F64)
    sin, cos = reference_rope(h, w, hd)
    # Plain attention: q, k, v by hand (key bias zero), patches rotated pair by pair.
    bias = torch.cat((attn.qkv.q_bias, torch.zeros(32, dtype=F64), attn.qkv.v_bias))
    q, k, v = (x @ attn.qkv.weight.T + bias).reshape(2, -1, 3, heads, hd).permute(2, 0, 3, 1, 4)

    def rotate(t):
        a, b = t[..., prefix:, : hd // 2], t[..., prefix:, hd // 2 :]
        s, c = sin[:, : hd // 2], cos[:, : hd // 2]
        return torch.cat((t[..., :prefix, :], torch.cat((a * c - b * s, b * c + a * s), -1)), -2)

    weights = torch.softmax(rotate(q) @ rotate(k).transpose(-2, -1) / math.sqrt(hd), dim=-1)
    ref = attn.proj((weights @ v).transpose(1, 2).reshape(2, -1, 32))
    torch.testing.assert_close(attn(x, (sin, cos)), ref, rtol=0, atol=1e-13)
    torch.testing.assert_close(attn.attention_weights(x, (sin, cos)), weights, rtol=0, atol=1e-14)
    with pytest.raises(ValueError, match="needs the RoPE"):
        attn(x)


# ------------------------------------------------------------------ the ViT


def numel(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


TIMM_NAMES = {
    "vit_small_dinov3": "vit_small_patch16_dinov3",
    "vit_small_plus_dinov3": "vit_small_plus_patch16_dinov3",
    "vit_base_dinov3": "vit_base_patch16_dinov3",
    "vit_large_dinov3": "vit_large_patch16_dinov3",
    "vit_huge_plus_dinov3": "vit_huge_plus_patch16_dinov3",
}


@pytest.mark.parametrize("name", list(TIMM_NAMES))
def test_parameter_counts_equal_timms(name):
    timm = pytest.importorskip("timm")
    with torch.device("meta"):
        ours, plain = getattr(v3, name)(), getattr(v3, name)(qkv_bias=False)
        theirs = timm.create_model(TIMM_NAMES[name] + "_qkvb", num_classes=0)
        theirs_plain = timm.create_model(TIMM_NAMES[name], num_classes=0)
    assert numel(ours) == numel(theirs)
    assert numel(plain) == numel(theirs_plain) < numel(ours)


def test_the_7b_counts_timms_plus_its_local_class_norm():
    timm = pytest.importorskip("timm")
    with torch.device("meta"):
        ours = vit_7b_dinov3()
        tied = vit_7b_dinov3(untie_global_and_local_cls_norm=False)
        theirs = timm.create_model("vit_7b_patch16_dinov3", num_classes=0)
    assert numel(tied) == numel(theirs)
    assert numel(ours) - numel(tied) == numel(ours.local_cls_norm) == 2 * 4096
    assert ours.blocks[0].mlp.w3.in_features == theirs.blocks[0].mlp.fc2.in_features


def test_every_size_builds_with_dinov3s_settings():
    with torch.device("meta"):
        for name, size in DINOV3_SIZES.items():
            model = getattr(v3, name)()
            assert (model.embed_dim, len(model.blocks), model.num_heads) == (
                size["embed_dim"],
                size["depth"],
                size["num_heads"],
            )
            assert model.patch_size == 16 and model.num_register_tokens == 4
            assert model.pos_embed is None and model.norm.eps == 1e-5
            assert model.blocks[0].ls1.gamma.shape == (model.embed_dim,)


def timm_and_ours(timm_name: str, ours_name: str, gen, **kw):
    timm = pytest.importorskip("timm")
    theirs = randomize(timm.create_model(timm_name, num_classes=0).double(), gen)
    ours = getattr(v3, ours_name)(**kw).double()
    ours.load_state_dict(convert_timm_dinov3_state_dict(theirs.state_dict()), strict=True)
    return theirs, ours


def assert_same_features(theirs, ours, x):
    ref = theirs.forward_features(x)
    out = ours.forward_features(x)
    torch.testing.assert_close(out["x_norm_clstoken"], ref[:, 0], rtol=0, atol=1e-11)
    torch.testing.assert_close(out["x_norm_regtokens"], ref[:, 1:5], rtol=0, atol=1e-11)
    torch.testing.assert_close(out["x_norm_patchtokens"], ref[:, 5:], rtol=0, atol=1e-11)


PARITY = [
    ("vit_small_patch16_dinov3", "vit_small_dinov3", {"qkv_bias": False}),
    ("vit_small_patch16_dinov3_qkvb", "vit_small_dinov3", {}),
    ("vit_small_plus_patch16_dinov3_qkvb", "vit_small_plus_dinov3", {}),
    ("vit_small_plus_patch16_dinov3", "vit_small_plus_dinov3", {"qkv_bias": False}),
]


@pytest.mark.parametrize("timm_name, ours_name, kw", PARITY, ids=[p[0] for p in PARITY])
@pytest.mark.parametrize("mode", ["eval", "train"])
def test_features_equal_timms_with_its_weights(timm_name, ours_name, kw, mode, gen):
    theirs, ours = timm_and_ours(timm_name, ours_name, gen, **kw)
    theirs.train(mode == "train")
    ours.train(mode == "train")
    with torch.no_grad():
        for size in [(224, 224), (160, 224)]:
            assert_same_features(theirs, ours, torch.randn(2, 3, *size, generator=gen, dtype=F64))


def dinov3_layout(state_dict: dict, gen) -> dict:
    """Our weights under DINOv3's own checkpoint names: storage tokens, a qkv
    bias with a (nonzero) key part and its mask, SwiGLU's w1 / w2, periods."""
    out = {"rope_embed.periods": torch.ones(16, dtype=F64)}
    for key, value in state_dict.items():
        if key.endswith("qkv.q_bias"):
            stem = key[: -len("q_bias")]
            k_bias = torch.randn(value.shape, generator=gen, dtype=F64)
            out[stem + "bias"] = torch.cat((value, k_bias, state_dict[stem + "v_bias"]))
            out[stem + "bias_mask"] = torch.cat(
                (torch.ones_like(value), torch.zeros_like(value), torch.ones_like(value))
            )
        elif ".mlp.w12." in key:
            w1, w2 = value.chunk(2)
            out[key.replace("w12", "w1")], out[key.replace("w12", "w2")] = w1, w2
        elif not key.endswith("qkv.v_bias"):
            out[key.replace("register_tokens", "storage_tokens")] = value
    return out


def test_dinov3_checkpoints_load_as_timm_reads_them(gen):
    timm = pytest.importorskip("timm")
    from timm.models.eva import checkpoint_filter_fn

    theirs = timm.create_model("vit_small_plus_patch16_dinov3_qkvb", num_classes=0).double()
    source = randomize(v3.vit_small_plus_dinov3().double(), gen)
    dinov3_sd = dinov3_layout(source.state_dict(), gen)
    theirs.load_state_dict(checkpoint_filter_fn(dinov3_sd, theirs), strict=True)
    ours = v3.vit_small_plus_dinov3().double()
    ours.load_state_dict(convert_dinov3_state_dict(dinov3_sd), strict=True)
    with torch.no_grad():
        assert_same_features(theirs.eval(), ours.eval(), torch.randn(1, 3, 64, 96, dtype=F64))


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_checkpointing_gives_the_same_gradients(policy, gen):
    aug = dict(pos_embed_rope_shift_coords=0.5, pos_embed_rope_rescale_coords=2.0)
    model = randomize(tiny(drop_path_rate=0.3, **aug).double(), gen)
    ckpt = tiny(drop_path_rate=0.3, **aug).double()
    ckpt.load_state_dict(model.state_dict())
    assert apply_block_options(ckpt, policy) is ckpt
    assert all(block.checkpointing == policy for block in ckpt.blocks)
    x = torch.randn(3, 3, 32, 48, generator=gen, dtype=F64)
    grads = []
    for m in (model, ckpt):
        torch.manual_seed(7)
        out = m.forward_features(x)
        (out["x_norm_clstoken"].pow(2).sum() + out["x_norm_patchtokens"].pow(3).sum()).backward()
        grads.append({n: p.grad for n, p in m.named_parameters() if n != "mask_token"})
    assert grads[0].keys() == grads[1].keys()
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, rtol=0, atol=1e-12, msg=name)


@pytest.mark.parametrize(
    "shape, match",
    [
        (
            (2, 3, 40, 48),
            r"^x: images of shape \(2, 3, 40, 48\); H and W must be positive "
            r"multiples of the patch size 16$",
        ),
        ((2, 1, 32, 32), r"^x: images must have shape \(B, 3, H, W\), got \(2, 1, 32, 32\)$"),
        ((3, 32, 32), r"^x: images must have shape \(B, 3, H, W\), got \(3, 32, 32\)$"),
    ],
)
def test_bad_images_raise_a_one_line_error(shape, match):
    model = tiny()
    for call in (model, model.forward_features, model.get_last_selfattention):
        with pytest.raises(ValueError, match=match):
            call(torch.zeros(shape))


def test_outputs_agree_with_each_other(gen):
    model = randomize(tiny(untie_cls_and_patch_norms=True).double(), gen).eval()
    x = torch.randn(2, 3, 48, 32, generator=gen, dtype=F64)
    out = model.forward_features(x)
    assert set(out) == {
        "x_norm_clstoken",
        "x_norm_regtokens",
        "x_norm_patchtokens",
        "x_prenorm",
        "masks",
    }
    assert out["x_norm_regtokens"].shape == (2, 4, 32)
    assert out["x_norm_patchtokens"].shape == (2, 6, 32)
    pre = out["x_prenorm"]
    torch.testing.assert_close(out["x_norm_clstoken"], model.cls_norm(pre[:, 0]))
    torch.testing.assert_close(out["x_norm_patchtokens"], model.norm(pre[:, 5:]))
    assert not torch.allclose(out["x_norm_clstoken"], model.norm(pre[:, 0]))
    torch.testing.assert_close(model(x), out["x_norm_clstoken"])
    last = model.get_intermediate_layers(x, n=2)[-1]
    torch.testing.assert_close(last[:, 0], out["x_norm_clstoken"])
    torch.testing.assert_close(last[:, 5:], out["x_norm_patchtokens"])
    attn = model.get_last_selfattention(x)
    assert attn.shape == (2, 4, 11, 11)
    torch.testing.assert_close(attn.sum(-1), torch.ones(2, 4, 11, dtype=F64))


def test_local_class_norm_in_training_only(gen):
    model = randomize(tiny(untie_global_and_local_cls_norm=True).double(), gen)
    x = torch.randn(2, 3, 32, 32, generator=gen, dtype=F64)
    glob, loc = model.train().forward_features_list([x, x])
    torch.testing.assert_close(loc["x_norm_patchtokens"], glob["x_norm_patchtokens"])
    torch.testing.assert_close(loc["x_norm_clstoken"], model.local_cls_norm(loc["x_prenorm"][:, 0]))
    assert not torch.allclose(loc["x_norm_clstoken"], glob["x_norm_clstoken"])
    glob, loc = model.eval().forward_features_list([x, x])
    torch.testing.assert_close(loc["x_norm_clstoken"], glob["x_norm_clstoken"])


def test_masks_replace_patches_by_the_mask_token(gen):
    model = randomize(tiny().double(), gen).eval()
    x = torch.randn(2, 3, 32, 48, generator=gen, dtype=F64)
    masks = torch.zeros(2, 2, 3, dtype=torch.bool)
    masks[0, 1, 2] = True
    out = model.forward_features(x, masks)
    assert out["masks"] is masks
    y = x.clone()
    y[0, :, 16:, 32:] = torch.randn(3, 16, 16, generator=gen, dtype=F64)  # the masked patch
    torch.testing.assert_close(model.forward_features(y, masks)["x_prenorm"], out["x_prenorm"])
    plain = model.forward_features(x)["x_prenorm"]
    assert not torch.allclose(plain[0], out["x_prenorm"][0])
    torch.testing.assert_close(plain[1], out["x_prenorm"][1])
    with pytest.raises(ValueError, match="masks: shape"):
        model.forward_features(x, torch.zeros(2, 5, dtype=torch.bool))


def test_the_mask_token_is_in_the_graph_without_masks(gen):
    # As DINOv3: the class token adds 0 x mask token, so the mask token always
    # has a (zero) gradient and data-parallel wrappers see every parameter used.
    model = tiny().double().train()
    cls = model.forward_features(torch.randn(1, 3, 32, 32, generator=gen, dtype=F64))
    weights = torch.randn(32, generator=gen, dtype=F64)  # a plain sum of a LayerNorm output is flat
    (cls["x_norm_clstoken"] @ weights).sum().backward()
    assert model.mask_token.grad is not None and not model.mask_token.grad.any()
    assert model.cls_token.grad.any()


def test_features_equal_hugging_faces_dinov3(gen):
    transformers = pytest.importorskip("transformers")
    config = transformers.DINOv3ViTConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=256,
        num_register_tokens=4,
        layerscale_value=1.0,
    )
    hf = randomize(transformers.DINOv3ViTModel(config).double().eval(), gen)
    ours = DinoV3VisionTransformer(embed_dim=64, depth=2, num_heads=4, use_mask_token=True)
    ours = ours.double().eval()
    ours.load_state_dict(from_hf_dinov3(hf.state_dict()), strict=True)  # the package's key map
    for size in [(224, 224), (160, 224)]:
        x = torch.randn(2, 3, *size, generator=gen, dtype=F64)
        with torch.no_grad():
            ref = hf(pixel_values=x).last_hidden_state
            out = ours.forward_features(x)
        # Hugging Face's RoPE runs in float32: agreement to float32 rounding.
        torch.testing.assert_close(out["x_norm_clstoken"], ref[:, 0], rtol=0, atol=1e-6)
        torch.testing.assert_close(out["x_norm_patchtokens"], ref[:, 5:], rtol=0, atol=1e-6)


# ----------------------------------------------------------------- the hub's names


def test_hub_backbones_load_dinovs_released_layout(tmp_path, gen):
    source = randomize(v3.vit_small_plus_dinov3(use_mask_token=True), gen)  # float32, as released
    path = tmp_path / "dinov3_vits16plus_pretrain_lvd1689m-4057cbaa.pth"
    torch.save(dinov3_layout(source.state_dict(), gen), path)
    source = source.double()
    for weights in (str(path), path.as_uri()):
        model = dinov3.dinov3_vits16plus(weights=weights).double().eval()
        assert model.rope_embed.rescale_coords == 2.0  # the hub's setting (training only)
        x = torch.randn(2, 3, 48, 32, generator=gen, dtype=F64)
        with torch.no_grad():
            want, got = source.eval().forward_features(x), model.forward_features(x)
        for key in ("x_norm_clstoken", "x_norm_regtokens", "x_norm_patchtokens"):
            torch.testing.assert_close(got[key], want[key], rtol=0, atol=1e-12)
    assert isinstance(dinov3.dinov3_vitb16(pretrained=False), DinoV3VisionTransformer)
    sat = dinov3.dinov3_vitl16(pretrained=False, weights=dinov3.Weights.SAT493M)
    assert sat.local_cls_norm is not None


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda d: d.dinov3_vits16(), "pretrained=True needs weights=<path of the .pth file>"),
        (lambda d: d.dinov3_vits16(weights="https://x/y.pth"), "give a local file"),
        (lambda d: d.dinov3_vits16(weights="/no/such.pth"), "do not exist"),
    ],
)
def test_hub_backbones_refuse_what_they_cannot_load(call, match):
    with pytest.raises((ValueError, FileNotFoundError), match=match):
        call(dinov3)


def test_hub_backbone_with_weights_of_another_size(tmp_path, gen):
    source = v3.vit_small_dinov3(use_mask_token=True)
    path = tmp_path / "small.pth"
    torch.save(dinov3_layout(source.state_dict(), gen), path)
    with pytest.raises(ValueError, match=r"dinov3_vitb16: .*small.pth does not hold its weights"):
        dinov3.dinov3_vitb16(weights=path)


def test_a_position_table_is_refused_by_name_as_the_positions_are_rope():
    # The DINO ViT's interface asks for a table resized to the grid; DINOv3
    # has none (RoPE takes any grid), so the call is refused, not answered.
    model = tiny()
    assert not hasattr(model, "pos_embed") or model.pos_embed is None
    with pytest.raises(NotImplementedError, match="no position table; positions are RoPE"):
        model.interpolate_pos_encoding(torch.zeros(1, 5, model.embed_dim), 32, 32)
