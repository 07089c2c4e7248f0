"""Tests of dino_opt.tune.optimize: fused attention, channels_last, torch.compile."""

import copy
import io
import logging
import time

import pytest
import torch
import torch.nn.functional as F
from dino_opt.models import vit_tiny
from dino_opt.tune import (
    COMPILE_MODES,
    ModelOptimizer,
    SDPAForward,
    explicit_attention,
    optimize_attention,
    optimize_model,
    optimize_model_report,
    restore_attention,
)
from dino_opt.tune import optimize as opt_module
from torch import nn

# ----------------------------------------------------------------- test models
# Hand-written multi-head self-attention, from the formula
#   Attention(Q, K, V) = softmax(Q K^T * scale) V,  scale = head_dim^-1/2,
# with Q, K, V from one fused projection and heads split along the channels.


class DinoStyleAttention(nn.Module):
    """Like DINO's ViT attention: explicit softmax, returns (x, attn) or x."""

    def __init__(self, dim, num_heads=2, qkv_bias=True, attn_drop=0.0, returns_attn=True):
        super().__init__()
        self.num_heads = num_heads
        self.scale = (dim // num_heads) ** -0.5
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(0.0)
        self.returns_attn = returns_attn

    def forward(self, x):
        b, n, c = x.shape
        h = self.num_heads
        qkv = self.qkv(x).view(b, n, 3, h, c // h)
        q = qkv[:, :, 0].transpose(1, 2)
        k = qkv[:, :, 1].transpose(1, 2)
        v = qkv[:, :, 2].transpose(1, 2)
        weights = torch.softmax(torch.matmul(q, k.transpose(2, 3)) * self.scale, dim=3)
        weights = self.attn_drop(weights)
        y = torch.matmul(weights, v).transpose(1, 2).reshape(b, n, c)
        y = self.proj_drop(self.proj(y))
        return (y, weights) if self.returns_attn else y


class TimmStyleAttention(nn.Module):
    """Like timm's attention: optional q/k norm and a ``fused_attn`` switch."""

    def __init__(self, dim, num_heads=2, qk_norm=False, fused_attn=False):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim**-0.5
        self.fused_attn = fused_attn
        self.qkv = nn.Linear(dim, dim * 3, bias=False)
        self.q_norm = nn.LayerNorm(self.head_dim) if qk_norm else nn.Identity()
        self.k_norm = nn.LayerNorm(self.head_dim) if qk_norm else nn.Identity()
        self.attn_drop = nn.Dropout(0.0)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(0.0)

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.num_heads, self.head_dim).unbind(2)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = self.q_norm(q), self.k_norm(k)
        if self.fused_attn:
            p = self.attn_drop.p if self.training else 0.0
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p)
        else:
            logits = (q * self.scale) @ k.transpose(-2, -1)
            y = self.attn_drop(logits.softmax(dim=-1)) @ v
        y = y.transpose(1, 2).reshape(b, n, c)
        return self.proj_drop(self.proj(y))


class NormedAttention(nn.Module):
    """Older-timm-like: q/k LayerNorm, no ``fused_attn``, only ``head_dim`` (no scale)."""

    def __init__(self, dim, num_heads=2):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, dim * 3)
        self.q_norm = nn.LayerNorm(self.head_dim)
        self.k_norm = nn.LayerNorm(self.head_dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, n, c = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = self.q_norm(qkv[0]), self.k_norm(qkv[1]), qkv[2]
        a = (q @ k.transpose(-2, -1) / self.head_dim**0.5).softmax(-1)
        return self.proj((a @ v).transpose(1, 2).reshape(b, n, c))


class WrongAttention(DinoStyleAttention):
    """Looks like DINO's attention, but softmax runs over the query axis."""

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        w = ((q @ k.transpose(-2, -1)) * self.scale).softmax(dim=-2)
        return self.proj((w @ v).transpose(1, 2).reshape(b, n, c)), w


class BiasedAttention(DinoStyleAttention):
    """DINO-style with a learned additive bias: has its own parameter, so it is
    not a plain attention and must be left alone."""

    def __init__(self, dim, num_heads=2, tokens=5):
        super().__init__(dim, num_heads)
        self.rel_bias = nn.Parameter(torch.zeros(num_heads, tokens, tokens))


class Block(nn.Module):
    def __init__(self, attn, dim):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = attn
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x):
        y = self.attn(self.norm1(x))
        if isinstance(y, tuple):
            y = y[0]
        x = x + y
        return x + self.mlp(self.norm2(x))


class TinyTransformer(nn.Module):
    def __init__(self, make_attn, dim=16, depth=2):
        super().__init__()
        self.blocks = nn.ModuleList(Block(make_attn(dim), dim) for _ in range(depth))
        self.head = nn.Linear(dim, 3)

    def forward(self, x):
        for blk in self.blocks:
            x = blk(x)
        return self.head(x.mean(dim=1))


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3)
        )
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(self.features(x).mean(dim=(2, 3)))


ATTENTIONS = {
    "dino_tuple": lambda d: DinoStyleAttention(d, returns_attn=True),
    "dino_tensor": lambda d: DinoStyleAttention(d, returns_attn=False, qkv_bias=False),
    "timm": lambda d: TimmStyleAttention(d, qk_norm=True),
    "normed": NormedAttention,
}


def make_model(kind, gen, dtype=torch.float64, depth=2, dim=16):
    model = TinyTransformer(ATTENTIONS[kind], dim=dim, depth=depth)
    with torch.no_grad():
        for p in model.parameters():  # random, non-trivial weights (LayerNorm too)
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return model.to(dtype)


def is_converted(attn):
    return isinstance(attn.__dict__.get("forward"), SDPAForward) or (
        getattr(attn, "fused_attn", False) is True
    )


# ----------------------------------------------------------------- optimize_attention


@pytest.mark.parametrize("kind", list(ATTENTIONS))
def test_converted_equal_in_float64_with_gradients(kind, gen):
    model = make_model(kind, gen)
    ref = copy.deepcopy(model)
    keys = list(model.state_dict())
    state = {k: v.clone() for k, v in model.state_dict().items()}

    assert optimize_attention(model) == 2
    assert all(is_converted(b.attn) for b in model.blocks)
    assert not any(is_converted(b.attn) for b in ref.blocks)
    # state_dict: same keys in the same order, same values
    assert list(model.state_dict()) == keys
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k])

    x = torch.randn(3, 9, 16, generator=gen, dtype=torch.float64)
    w = torch.randn(3, 3, generator=gen, dtype=torch.float64)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    out, expected = model(xa), ref(xb)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    (out * w).sum().backward()
    (expected * w).sum().backward()
    torch.testing.assert_close(xa.grad, xb.grad, rtol=1e-10, atol=1e-12)
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.parametrize("kind", list(ATTENTIONS))
def test_converted_close_in_float32(kind, gen):
    model = make_model(kind, gen, dtype=torch.float32)
    ref = copy.deepcopy(model)
    assert optimize_attention(model) == 2
    x = torch.randn(4, 11, 16, generator=gen)
    torch.testing.assert_close(model(x), ref(x), rtol=1e-5, atol=1e-5)


def test_tuple_contract_and_explicit_attention(gen):
    attn = DinoStyleAttention(16, num_heads=4).double()
    ref = copy.deepcopy(attn)
    assert optimize_attention(attn) == 1  # the root module itself is converted
    x = torch.randn(2, 5, 16, generator=gen, dtype=torch.float64)
    out = attn(x)
    assert isinstance(out, tuple) and len(out) == 2 and out[1] is None
    ref_x, ref_w = ref(x)
    torch.testing.assert_close(out[0], ref_x, rtol=1e-12, atol=1e-12)
    # attention maps: the module's own forward, inside explicit_attention only
    with explicit_attention(attn):
        x2, w2 = attn(x)
    torch.testing.assert_close(w2, ref_w, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x2, ref_x, rtol=1e-12, atol=1e-12)
    assert attn(x)[1] is None


def test_tensor_contract_kept(gen):
    attn = DinoStyleAttention(16, returns_attn=False)
    assert optimize_attention(attn) == 1
    assert isinstance(attn(torch.randn(2, 5, 16, generator=gen)), torch.Tensor)


def test_timm_style_flag_flipped_not_replaced(gen):
    model = make_model("timm", gen)
    assert optimize_attention(model) == 2
    for b in model.blocks:
        assert b.attn.fused_attn is True
        assert "forward" not in b.attn.__dict__  # its own fused path, no new forward
    # already fused: nothing to do
    fused = TinyTransformer(lambda d: TimmStyleAttention(d, fused_attn=True))
    assert optimize_attention(fused) == 0


def test_our_vit_left_alone(gen):
    vit = vit_tiny(img_size=32, patch_size=8).double()
    ref = copy.deepcopy(vit)
    assert optimize_attention(vit) == 0
    assert not any("forward" in m.__dict__ for m in vit.modules())
    x = torch.randn(2, 3, 32, 32, generator=gen, dtype=torch.float64)
    assert torch.equal(vit(x), ref(x))


def test_second_call_converts_nothing(gen):
    model = make_model("dino_tuple", gen)
    assert optimize_attention(model) == 2
    assert optimize_attention(model) == 0


def test_use_flash_attention_false_is_a_no_op(gen):
    model = make_model("dino_tuple", gen)
    assert optimize_attention(model, use_flash_attention=False) == 0
    assert not any(is_converted(b.attn) for b in model.blocks)


def test_check_rejects_a_different_forward_and_changes_nothing(gen):
    model = TinyTransformer(DinoStyleAttention)
    model.blocks[1].attn = WrongAttention(16)
    with pytest.raises(RuntimeError, match=r"blocks\.1\.attn.*WrongAttention.*relative"):
        optimize_attention(model)
    # atomic: the good module before it was not converted either
    assert not any(is_converted(b.attn) for b in model.blocks)
    # without the check the structural match converts both: the check is what catches it
    assert optimize_attention(model, check=False) == 2


def test_check_is_not_fooled_by_zero_weights():
    model = TinyTransformer(DinoStyleAttention)
    model.blocks[0].attn = WrongAttention(16)
    nn.init.zeros_(model.blocks[0].attn.proj.weight)  # output 0 either way
    nn.init.zeros_(model.blocks[0].attn.proj.bias)
    with pytest.raises(RuntimeError, match="WrongAttention"):
        optimize_attention(model)


def test_modules_with_extra_state_are_skipped(gen):
    model = TinyTransformer(BiasedAttention)
    assert optimize_attention(model) == 0


def test_dropout_only_in_training(gen, monkeypatch):
    model = TinyTransformer(lambda d: DinoStyleAttention(d, attn_drop=0.25), depth=1)
    assert optimize_attention(model) == 1
    seen = []
    real = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append(kwargs["dropout_p"])
        return real(*args, **kwargs)

    monkeypatch.setattr(opt_module.F, "scaled_dot_product_attention", spy)
    x = torch.randn(2, 5, 16, generator=gen)
    model.train()(x)
    model.eval()(x)
    assert seen == [0.25, 0.0]


def test_extra_arguments_go_to_the_original_forward(gen):
    class MaskedAttention(DinoStyleAttention):
        def forward(self, x, mask=None):
            y, w = super().forward(x)
            return (y * 0 if mask is not None else y), w

    attn = MaskedAttention(16)
    assert optimize_attention(attn) == 1
    x = torch.randn(2, 5, 16, generator=gen)
    assert attn(x)[1] is None  # fused
    y, w = attn(x, mask=torch.ones(5, 5))  # the original, with the mask
    assert w is not None and torch.count_nonzero(y) == 0


def test_restore_attention(gen):
    model = TinyTransformer(lambda d: DinoStyleAttention(d))
    model.blocks[1].attn = TimmStyleAttention(16)
    assert optimize_attention(model) == 2
    assert restore_attention(model) == 2
    assert not any(is_converted(b.attn) for b in model.blocks)
    assert model.blocks[1].attn.fused_attn is False


def test_deepcopy_and_pickle_keep_the_conversion(gen):
    model = make_model("dino_tuple", gen, dtype=torch.float32)
    assert optimize_attention(model) == 2
    x = torch.randn(2, 5, 16, generator=gen)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    for clone in (copy.deepcopy(model), torch.load(buf, weights_only=False)):
        for b in clone.blocks:
            assert b.attn.forward.module is b.attn  # bound to the copy, not the original
        torch.testing.assert_close(clone(x), model(x))
        with torch.no_grad():
            clone.head.bias.add_(1.0)
        assert not torch.allclose(clone(x), model(x))


def test_meta_device_needs_check_off():
    with torch.device("meta"):
        model = TinyTransformer(lambda d: DinoStyleAttention(d))
    with pytest.raises(ValueError, match="meta.*check=False"):
        optimize_attention(model)
    assert optimize_attention(model, check=False) == 2
    assert model.blocks[0].attn.forward.n_outputs == 2


def test_lesson_class_method_returns_the_model(gen):
    model = make_model("dino_tensor", gen)
    assert ModelOptimizer.optimize_attention(model) is model
    assert model._dino_opt_optimizations["attention_modules_converted"] == 2


# ----------------------------------------------------------------- optimize_model


def test_channels_last_on_a_cnn():
    cnn = SmallCNN()
    out = ModelOptimizer.optimize_model(cnn, {"channels_last": True})
    assert out is cnn
    w = cnn.features[0].weight
    assert w.is_contiguous(memory_format=torch.channels_last) and not w.is_contiguous()
    rec = cnn._dino_opt_optimizations
    assert rec["channels_last"] is True and rec["conv2d_layers"] == 2
    assert rec["compiled"] is False and rec["attention_modules_converted"] is None
    y = cnn(torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last))
    assert y.shape == (2, 4)


def test_channels_last_not_on_a_vit(caplog):
    vit = vit_tiny(img_size=32, patch_size=8)
    with caplog.at_level(logging.INFO, logger="dino_opt.tune.optimize"):
        _, report = optimize_model_report(vit, {"channels_last": True, "optimize_attention": True})
    w = vit.patch_embed.proj.weight
    assert w.is_contiguous() and not w.is_contiguous(memory_format=torch.channels_last)
    assert report["channels_last"] is False and report["conv2d_layers"] == 0
    assert report["attention_modules_converted"] == 0
    assert any("ViT gains nothing" in n for n in report["notes"])
    assert "ViT gains nothing" in caplog.text


def test_channels_last_without_any_conv(gen):
    _, report = optimize_model_report(make_model("dino_tuple", gen), {"channels_last": True})
    assert report["channels_last"] is False
    assert any("no Conv2d" in n for n in report["notes"])


def test_empty_config_changes_nothing(gen):
    model = make_model("dino_tuple", gen)
    assert optimize_model(model, {}) is model
    assert optimize_model(model, None) is model
    assert not any(is_converted(b.attn) for b in model.blocks)
    rec = model._dino_opt_optimizations
    assert rec["config"] == {
        "compile": False,
        "compile_mode": "default",
        "channels_last": False,
        "optimize_attention": False,
    }


@pytest.mark.parametrize(
    "config, pattern",
    [
        ({"compile_modle": True}, r"'compile_modle'.*channels_last, compile, compile_mode"),
        ({"fuse": True}, r"'fuse'.*allowed keys: .*optimize_attention"),
        (
            {"compile_mode": "fast"},
            r"'compile_mode'.*default, reduce-overhead, max-autotune.*'fast'",
        ),
        ({"compile_mode": None}, r"'compile_mode'.*None"),
        ({"channels_last": 1}, r"'channels_last' must be True or False; got 1"),
        ({"compile": "yes"}, r"'compile' must be True or False; got 'yes'"),
        ({"optimize_attention": None}, r"'optimize_attention' must be True or False"),
        ({"compile": True, "compile_model": False}, r"'compile'.*'compile_model'.*disagree"),
    ],
)
def test_bad_config_raises(config, pattern, gen):
    model = make_model("dino_tuple", gen)
    with pytest.raises(ValueError, match=pattern):
        optimize_model(model, config)
    assert not any(is_converted(b.attn) for b in model.blocks)
    assert not hasattr(model, "_dino_opt_optimizations")


def test_config_must_be_a_mapping(gen):
    with pytest.raises(TypeError, match="mapping"):
        optimize_model(make_model("dino_tuple", gen), [("compile", True)])


def test_lesson_alias_compile_model(gen):
    model = make_model("dino_tuple", gen)
    _, report = optimize_model_report(model, {"compile_model": False, "compile": False})
    assert report["config"]["compile"] is False and report["compiled"] is False
    assert "compile_model" not in report["config"]
    assert set(COMPILE_MODES) == {"default", "reduce-overhead", "max-autotune"}


def test_compile_in_place_with_warmup_timing(gen):
    """torch.compile (inductor) needs a working C++ compiler on the CPU; if the
    backend fails to compile, the test is skipped with the reason."""
    torch._dynamo.reset()
    model = make_model("dino_tuple", gen, dtype=torch.float32, depth=1)
    ref = copy.deepcopy(model)
    keys = list(model.state_dict())
    x = torch.randn(2, 5, 16, generator=gen)
    t0 = time.perf_counter()
    try:
        with torch.no_grad():
            out_model, report = optimize_model_report(
                model, {"compile": True, "optimize_attention": True}, example_input=x
            )
    except torch._dynamo.exc.BackendCompilerFailed as e:
        torch._dynamo.reset()
        pytest.skip(f"torch.compile's backend failed on this machine: {str(e)[:300]}")
    assert out_model is model  # compiled in place
    assert list(model.state_dict()) == keys  # no _orig_mod. prefix
    assert report["compiled"] is True and report["compile_mode"] == "default"
    assert report["attention_modules_converted"] == 1
    timing = report["compile_timing"]
    assert len(timing["warmup_calls_s"]) == 3
    assert timing["first_call_s"] == timing["warmup_calls_s"][0]
    assert 0 < timing["steady_call_s"] and timing["warmup_cost_s"] >= 0
    assert timing["first_call_s"] + timing["steady_call_s"] <= time.perf_counter() - t0
    assert timing["grad_enabled"] is False
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x), rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()


def test_dynamo_traces_the_fused_forward_in_one_graph(gen):
    """No graph break at the instance forward, and the graph calls SDPA, not softmax."""
    torch._dynamo.reset()
    model = make_model("dino_tuple", gen, dtype=torch.float32)
    assert optimize_attention(model) == 2
    explained = torch._dynamo.explain(model)(torch.randn(2, 5, 16, generator=gen))
    torch._dynamo.reset()
    assert explained.graph_count == 1 and explained.graph_break_count == 0
    targets = [str(n.target) for n in explained.graphs[0].graph.nodes]
    assert sum("scaled_dot_product_attention" in t for t in targets) == 2
    assert not any("softmax" in t for t in targets)


@pytest.mark.cuda
@pytest.mark.slow
def test_flash_kernel_on_cuda(gen):
    """On a GPU the converted modules run under the flash kernel alone (bf16) and
    match the hand-written forward."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model = make_model("dino_tuple", gen, dtype=torch.float32, dim=64).cuda()
    ref = copy.deepcopy(model)
    assert optimize_attention(model) == 2
    x = torch.randn(4, 50, 64, generator=gen).cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16), torch.no_grad():
        expected = ref(x).float()
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            got = model(x).float()
    torch.testing.assert_close(got, expected, rtol=3e-2, atol=3e-2)
