"""Packed crops: every crop size through the ViT's blocks in one pass (the
token-wise layers on all rows at once, attention within each size) gives
what separate calls give, values and gradients in float64, for the DINO,
DINOv2 (registers, masks) and DINOv3 (RoPE, storage tokens) ViTs; the packed
subset drop path equals the mask form for the same draws."""

import pytest
import torch
import torch.nn.functional as F
from dino_opt.models import MultiCropWrapper, layers
from dino_opt.models.head import DINOHead
from dino_opt.models.layers import Block, attend, kept_rows, kept_samples, pack, unpack
from dino_opt.models.vit import vit_tiny
from dino_opt.models.vit_dinov3 import DinoV3VisionTransformer, RopeBlock
from dino_opt.train.dinov2 import DINOv2Wrapper
from reference import block_reference


def _randomized(module, seed=3):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.2)
    return module


def _grad(out, inputs):
    # the mask token has no gradient where no patch is masked: zeros
    return torch.autograd.grad(out, inputs, allow_unused=True, materialize_grads=True)


BACKBONES = {
    "dino": lambda p: vit_tiny(patch_size=8, img_size=32, depth=3, drop_path_rate=p),
    "dinov2": lambda p: vit_tiny(
        patch_size=8,
        img_size=32,
        depth=3,
        drop_path_rate=p,
        num_register_tokens=2,
        layerscale_init=1e-5,
        ffn_layer="swiglu",
        use_mask_token=True,
    ),
    "dinov3": lambda p: DinoV3VisionTransformer(
        patch_size=8,
        embed_dim=48,
        depth=3,
        num_heads=4,
        drop_path_rate=p,
        n_storage_tokens=2,
        ffn_layer="swiglu",
        use_mask_token=True,
        untie_cls_and_patch_norms=True,
    ),
}


def _images(seed=0):
    g = torch.Generator().manual_seed(seed)
    glob = torch.randn(4, 3, 32, 32, generator=g, dtype=torch.float64)
    local = torch.randn(6, 3, 16, 16, generator=g, dtype=torch.float64)
    masks = torch.rand(4, 4, 4, generator=g) < 0.4
    return glob, local, masks


def test_pack_and_unpack_are_inverse_views():
    a, b = torch.randn(2, 5, 3), torch.randn(3, 2, 3)
    rows, layout = pack([a, b])
    assert layout == ((2, 5), (3, 2)) and rows.shape == (16, 3)
    back = unpack(rows, layout)
    torch.testing.assert_close(back[0], a)
    torch.testing.assert_close(back[1], b)
    assert back[1].data_ptr() == rows[10:].data_ptr()  # views of the stream
    single, lay = pack([a])
    assert lay == ((2, 5),) and single.data_ptr() == a.data_ptr()
    with pytest.raises(ValueError, match="no token batches"):
        pack([])


def test_kept_rows_are_the_kept_samples_tokens():
    layout = ((3, 2), (2, 4))
    rows = kept_rows([torch.tensor([2, 0]), None], layout, torch.device("cpu"))
    assert rows.tolist() == [4, 5, 0, 1, 6, 7, 8, 9, 10, 11, 12, 13]


@pytest.mark.parametrize("kind", sorted(BACKBONES))
def test_packed_forward_equals_separate_calls(kind):
    net = _randomized(BACKBONES[kind](0.0)).double().train()
    glob, local, masks = _images()
    masks = None if kind == "dino" else masks  # DINO's ViT has no mask token
    params = [p for p in net.parameters()]
    x = [glob.clone().requires_grad_(), local.clone().requires_grad_()]

    # the class features of a list of crops (what the DINO wrapper runs)
    crops = [x[0][:2], x[0][2:], *x[1].split(2)]
    ours = net(crops)
    expect = torch.cat([net(x[0]), net(x[1])])
    torch.testing.assert_close(ours, expect, rtol=1e-12, atol=1e-12)
    g_ours = _grad(ours.sin().sum(), [*x, *params])
    g_ref = _grad(expect.sin().sum(), [*x, *params])
    for g, e in zip(g_ours, g_ref, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-12)

    # DINOv2's outputs, with masks on the global crops (the student's pass)
    packed = net.forward_features_list(x, [masks, None])
    separate = [
        net.forward_features(x[0], masks=masks),
        net.forward_features(x[1], local_crops=True)
        if kind == "dinov3"
        else net.forward_features(x[1]),
    ]
    keys = ("x_norm_clstoken", "x_norm_regtokens", "x_norm_patchtokens", "x_prenorm")
    for out, ref in zip(packed, separate, strict=True):
        for key in keys:
            torch.testing.assert_close(out[key], ref[key], rtol=1e-12, atol=1e-12, msg=key)
    total = sum(o[k].sin().sum() for o in packed for k in keys)
    reference = sum(o[k].sin().sum() for o in separate for k in keys)
    g_ours = _grad(total, [*x, *params])
    g_ref = _grad(reference, [*x, *params])
    for g, e in zip(g_ours, g_ref, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kind", sorted(BACKBONES))
def test_every_crop_size_runs_each_projection_once(kind):
    net = BACKBONES[kind](0.1).train()
    calls = []
    for block in net.blocks:
        block.attn.qkv.register_forward_hook(lambda m, a, out: calls.append(a[0].shape))
    glob, local, _ = _images()
    net([glob.float(), local.float()])
    assert len(calls) == len(net.blocks)  # one product for both sizes, not one each
    kept = kept_samples(4, net.blocks[-1].drop_path.p), kept_samples(6, net.blocks[-1].drop_path.p)
    r = 1 + net.num_register_tokens
    assert calls[-1][0] == kept[0] * (r + 16) + kept[1] * (r + 4)  # the kept samples' rows only


def test_the_wrappers_take_the_packed_pass():
    net = _randomized(BACKBONES["dinov2"](0.0)).double()
    head = DINOHead(192, 16, hidden_dim=32, bottleneck_dim=8).double()
    glob, local, masks = _images()
    passes = []
    net.blocks[0].register_forward_pre_hook(lambda m, a, kw: passes.append(1), with_kwargs=True)
    MultiCropWrapper(net, head)([glob[:2], glob[2:], local[:3], local[3:]])
    assert len(passes) == 1
    student = DINOv2Wrapper(net, head)
    index = torch.nonzero(masks.flatten()).flatten()
    out = student([glob[:2], glob[2:], local[:3], local[3:]], masks=masks, mask_indices=index)
    assert len(passes) == 2
    ref = net.forward_features(glob, masks=masks)
    torch.testing.assert_close(out.global_cls, ref["x_norm_clstoken"])
    torch.testing.assert_close(
        out.local_logits, head(net.forward_features(local)["x_norm_clstoken"])
    )


@pytest.mark.parametrize("kind", ["dino", "dinov3"])
def test_packed_subset_drop_path_equals_the_mask_form(kind):
    p = 0.3
    if kind == "dino":
        block = Block(32, 4, drop_path=p, init_values=1e-5)
    else:
        block = RopeBlock(32, 4, drop_path=p, ffn_layer="swiglu64", mask_k_bias=True)
    block = _randomized(block).double().train()
    g = torch.Generator().manual_seed(5)
    xs = [
        torch.randn(8, 5, 32, generator=g, dtype=torch.float64, requires_grad=True),
        torch.randn(10, 3, 32, generator=g, dtype=torch.float64, requires_grad=True),
    ]
    ropes = None
    if kind == "dinov3":  # one patch grid's RoPE per size (4 and 2 patches)
        ropes = [
            tuple(torch.rand(n, 8, generator=g, dtype=torch.float64) for _ in range(2))
            for n in (4, 2)
        ]
    # the draws the packed block makes: per branch, each crop size in order
    torch.manual_seed(7)
    draws = [[torch.randperm(b)[: kept_samples(b, p)] for b in (8, 10)] for _ in range(2)]
    torch.manual_seed(7)
    rows, layout = pack(xs)
    out = unpack(block(rows, ropes, layout), layout)
    refs = [
        block_reference(block, x, [draws[0][i], draws[1][i]], None if ropes is None else ropes[i])
        for i, x in enumerate(xs)
    ]
    params = list(block.parameters())
    for o, r in zip(out, refs, strict=True):
        torch.testing.assert_close(o, r, rtol=1e-12, atol=1e-12)
    total = sum(o.sin().sum() for o in out)
    reference = sum(r.sin().sum() for r in refs)
    for a, b in zip(
        torch.autograd.grad(total, [*xs, *params]),
        torch.autograd.grad(reference, [*xs, *params]),
        strict=True,
    ):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("n", [5, 37, 197])
def test_half_attention_on_the_cpu_is_the_published_attention(n, monkeypatch):
    # attend: bfloat16 matrix products on the CPU (its flash kernel is slower
    # there); against softmax(q k^T / sqrt(d)) v in float64, values
    # and gradients, within bfloat16's rounding
    torch.manual_seed(n)
    q, k, v = (torch.randn(3, 2, n, 16, dtype=torch.float64) for _ in range(3))
    grad = torch.randn(3, 2, n, 16, dtype=torch.float64)

    def run(fn, dtype):
        x = [t.detach().to(dtype, copy=True).requires_grad_() for t in (q, k, v)]
        out = fn(*x)
        out.backward(grad.to(dtype))
        return [out.double()] + [t.grad.double() for t in x]

    def published(q, k, v):
        return ((q @ k.transpose(-2, -1)) / q.shape[-1] ** 0.5).softmax(-1) @ v

    expected = run(published, torch.float64)
    got = run(attend, torch.bfloat16)
    for g, e, name in zip(got, expected, ("out", "dq", "dk", "dv"), strict=True):
        assert (g - e).abs().max() <= 0.03 * e.abs().max() + 1e-2, name

    # float64, and bfloat16 past the scores' bound: torch's own attention
    sdpa = F.scaled_dot_product_attention
    for a, b in zip(run(attend, torch.float64), run(sdpa, torch.float64), strict=True):
        assert torch.equal(a, b)
    monkeypatch.setattr(layers, "CPU_SCORES_BYTES", 3 * 2 * n * n * 2 - 1)
    for a, b in zip(run(attend, torch.bfloat16), run(sdpa, torch.bfloat16), strict=True):
        assert torch.equal(a, b)
