"""DINOv2 weights in and out: dino_opt's ViT with registers, LayerScale,
SwiGLU and bias switches exported to timm, Hugging Face (Dinov2Model,
Dinov2WithRegistersModel) and DINOv2's own layout, each giving dino_opt's
CLS and patch features; random-init timm, Hugging Face and DINOv2-layout
models loaded into dino_opt giving theirs; position interpolation equal to
the libraries' where they interpolate as DINOv2 does; the adaptations that
keep the function, and the errors. Small models (width 64, depth 2, 4x4
patches of 14 px) so that it runs on a 2-core CPU."""

import json

import pytest
import torch
from dino_opt.config import apply_overrides, default_config
from dino_opt.models import VisionTransformer, build_dino_models
from dino_opt.train import build_models
from dino_opt.weights import (
    export_backbone,
    export_weights,
    init_from,
    load_backbone,
    read_weights,
)
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from test_vit_dinov2 import official_keys

timm = pytest.importorskip("timm")
transformers = pytest.importorskip("transformers")

DIM, HEADS = 64, 4
CONFIGS = {
    "registers": dict(num_register_tokens=4),
    "swiglu": dict(ffn_layer="swiglufused"),
    "registers-swiglu-nobias": dict(
        num_register_tokens=2, ffn_layer="swiglu", qkv_bias=False, proj_bias=False
    ),
}


def _randomize(module: torch.nn.Module, gen: torch.Generator) -> torch.nn.Module:
    """Every parameter random (biases, norms, LayerScale, tokens too), so a
    swapped key cannot go unnoticed."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            one = name.endswith(("norm1.weight", "norm2.weight", "norm.weight", "layernorm.weight"))
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.1 + float(one))
    return module.eval()


def ours(gen, **kw) -> VisionTransformer:
    cfg = dict(
        img_size=56,
        patch_size=14,
        embed_dim=DIM,
        depth=2,
        num_heads=HEADS,
        layerscale_init=1e-5,
        use_mask_token=True,
    )
    return _randomize(VisionTransformer(**(cfg | kw)), gen)


def _features(model: VisionTransformer, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        out = model.eval().forward_features(x)
    return out["x_norm_clstoken"], out["x_norm_patchtokens"]


def _timm_features(model, x, registers: int):
    with torch.no_grad():
        tokens = model.eval().forward_features(x)
    return tokens[:, 0], tokens[:, 1 + registers :]


def _hf_features(model, x, registers: int):
    with torch.no_grad():
        tokens = model.eval()(pixel_values=x).last_hidden_state
    return tokens[:, 0], tokens[:, 1 + registers :]


def _close(a: tuple, b: tuple, atol: float = 1e-5) -> None:
    for u, v in zip(a, b, strict=True):
        assert u.shape == v.shape
        assert (u - v).abs().max().item() <= atol


def _timm_from_file(path):
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    model = timm.create_model(meta["timm_model"], **json.loads(meta["timm_kwargs"]))
    model.load_state_dict(load_file(path), strict=True)
    return model.eval(), meta


# ---------------------------------------------------------------- export


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("size", [56, 84])
def test_timm_export_gives_our_features(name, size, tmp_path, gen):
    model = ours(gen, **CONFIGS[name])
    x = torch.randn(2, 3, size, size, generator=gen)
    r = export_backbone(model, "timm", tmp_path / "t.safetensors", image_size=size)
    timm_model, meta = _timm_from_file(r.path)
    assert "dinov2" in meta["timm_model"] and ("reg4" in meta["timm_model"]) == ("reg" in name)
    assert (size == 56) == (not r.notes)  # a resized table is said so
    _close(_timm_features(timm_model, x, model.num_register_tokens), _features(model, x))


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("size", [56, 84])
def test_hf_export_gives_our_features(name, size, tmp_path, gen):
    model = ours(gen, **CONFIGS[name])
    x = torch.randn(2, 3, size, size, generator=gen)
    r = export_backbone(model, "hf", tmp_path / "hf", image_size=size)
    config = json.loads((r.path / "config.json").read_text())
    cls = getattr(transformers, config["architectures"][0])
    assert (cls is transformers.Dinov2WithRegistersModel) == ("reg" in name)
    assert config["image_size"] == size and config["use_swiglu_ffn"] == ("swiglu" in name)
    hf = cls.from_pretrained(str(r.path))
    _close(_hf_features(hf, x, model.num_register_tokens), _features(model, x))


@pytest.mark.parametrize("name", CONFIGS)
def test_dinov2_export_has_the_official_layout(name, tmp_path, gen):
    model = ours(gen, use_mask_token=False, **CONFIGS[name])  # the file has one all the same
    r = export_backbone(model, "dinov2", tmp_path / "dinov2_vits14_pretrain.pth")
    state = torch.load(r.path, weights_only=True)
    expected = official_keys(2, CONFIGS[name].get("ffn_layer", "mlp"), "reg" in name)
    if not CONFIGS[name].get("qkv_bias", True):
        expected = [k for k in expected if not k.endswith(("qkv.bias", "attn.proj.bias"))]
    assert list(state) == expected
    assert not state["mask_token"].any()
    fresh = VisionTransformer(**(read_weights(r.path).arch.model_kwargs() | {"num_heads": HEADS}))
    fresh.load_state_dict(state, strict=True)
    x = torch.randn(2, 3, 56, 56, generator=gen)
    _close(_features(fresh, x), _features(model, x), atol=0)
    assert "block_chunks=0" in r.load and read_weights(r.path).format == "dinov2"


@pytest.mark.parametrize("name", ["registers", "swiglu"])
def test_timm_converts_our_dinov2_file_as_an_official_one(name, tmp_path, gen):
    """timm's own converter of DINOv2's published files (register tokens into
    its no_embed_class layout, w12/w3 into its packed SwiGLU) reads ours."""
    model = ours(gen, **CONFIGS[name])
    r = export_backbone(model, "dinov2", tmp_path / "d.pth")
    t = export_backbone(model, "timm", tmp_path / "t.safetensors")
    target, _ = _timm_from_file(t.path)
    convert = timm.models.vision_transformer.checkpoint_filter_fn
    state = convert(torch.load(r.path, weights_only=True), target)
    target.load_state_dict(state, strict=True)
    x = torch.randn(2, 3, 56, 56, generator=gen)
    _close(_timm_features(target, x, model.num_register_tokens), _features(model, x))


def test_dino_format_refuses_dinov2_features(tmp_path, gen):
    with pytest.raises(ValueError, match="4 registers, LayerScale.*--format dinov2"):
        export_backbone(ours(gen, **CONFIGS["registers"]), "dino", tmp_path / "d.pth")
    v1 = ours(gen, layerscale_init=None)  # a DINO ViT with a mask token
    r = export_backbone(v1, "dino", tmp_path / "v1.pth")
    assert "mask_token" not in torch.load(r.path, weights_only=True) and r.notes


# ---------------------------------------------------------------- import


@pytest.mark.parametrize(
    "timm_name, kw, registers",
    [
        ("vit_small_patch14_reg4_dinov2", {}, 4),
        ("vit_giant_patch14_dinov2", {"mlp_ratio": 5.5}, 0),  # SwiGLU hidden 176
        ("vit_small_patch14_dinov2", {"init_values": None, "qkv_bias": False}, 0),
    ],
)
def test_random_timm_models_load_into_ours(timm_name, kw, registers, tmp_path, gen):
    shape = dict(img_size=56, embed_dim=DIM, depth=2, num_heads=HEADS, num_classes=0)
    source = _randomize(timm.create_model(timm_name, pretrained=False, **shape, **kw), gen)
    path = tmp_path / "timm.safetensors"
    save_file(source.state_dict(), str(path))
    weights = read_weights(path)
    assert weights.format == "timm" and weights.arch.num_register_tokens == registers
    assert weights.arch.swiglu == ("giant" in timm_name)
    model = VisionTransformer(**(weights.arch.model_kwargs() | {"num_heads": HEADS}))
    notes = load_backbone(path, model)
    assert any("mask token starts at zero" in n for n in notes) == weights.arch.mask_token
    x = torch.randn(2, 3, 56, 56, generator=gen)
    _close(_features(model, x), _timm_features(source, x, registers))


def _hf_config(registers: int, swiglu: bool):
    kw = dict(
        hidden_size=DIM,
        num_hidden_layers=2,
        num_attention_heads=HEADS,
        image_size=56,
        patch_size=14,
        use_swiglu_ffn=swiglu,
    )
    if registers:
        return transformers.Dinov2WithRegistersModel, transformers.Dinov2WithRegistersConfig(
            num_register_tokens=registers, **kw
        )
    return transformers.Dinov2Model, transformers.Dinov2Config(**kw)


@pytest.mark.parametrize("registers, swiglu", [(0, False), (0, True), (4, False), (4, True)])
def test_random_hf_models_load_into_ours(registers, swiglu, tmp_path, gen):
    cls, config = _hf_config(registers, swiglu)
    source = _randomize(cls(config), gen)
    source.save_pretrained(tmp_path / "hf")  # the published layout
    save_file(source.state_dict(), str(tmp_path / "hf5.safetensors"))  # transformers 5's names
    x = torch.randn(2, 3, 56, 56, generator=gen)
    for path in (tmp_path / "hf", tmp_path / "hf5.safetensors"):
        weights = read_weights(path)
        assert weights.format == "hf" and weights.arch.num_register_tokens == registers
        assert weights.arch.swiglu == swiglu and weights.arch.layerscale
        model = VisionTransformer(**(weights.arch.model_kwargs() | {"num_heads": HEADS}))
        load_backbone(path, model)
        _close(_features(model, x), _hf_features(source, x, registers))
    assert read_weights(tmp_path / "hf").arch.num_heads == HEADS  # from config.json


def _chunked(sd: dict, chunks: int, depth: int) -> dict:
    """DINOv2's block_chunks layout: block i of chunk c as ``blocks.{c}.{i}``."""
    size = depth // chunks
    return {
        (
            f"blocks.{int(k.split('.')[1]) // size}.{k[len('blocks.') :]}"
            if k.startswith("blocks.")
            else k
        ): v
        for k, v in sd.items()
    }


def test_official_layout_loads_chunked_or_not(tmp_path, gen):
    source = ours(gen, depth=4, num_register_tokens=4, interpolate_antialias=True)
    sd = source.state_dict()
    torch.save(_chunked(sd, 2, 4), tmp_path / "chunked.pth")
    assert "blocks.1.3.ls2.gamma" in torch.load(tmp_path / "chunked.pth", weights_only=True)
    torch.save(sd, tmp_path / "flat.pth")
    x = torch.randn(2, 3, 70, 70, generator=gen)  # another size: interpolated
    for path in (tmp_path / "chunked.pth", tmp_path / "flat.pth"):
        weights = read_weights(path)
        assert weights.format == "dinov2" and weights.arch.depth == 4
        # the hub's register models resize anti-aliased, to the grid's size
        assert weights.arch.interpolate_antialias and weights.arch.interpolate_offset == 0
        model = VisionTransformer(**(weights.arch.model_kwargs() | {"num_heads": HEADS}))
        load_backbone(path, model)
        for key, value in model.state_dict().items():
            assert torch.equal(value, sd[key]), key
        _close(_features(model, x), _features(source, x), atol=0)


def test_round_trips_give_the_same_features(tmp_path, gen):
    model = ours(gen, **CONFIGS["registers-swiglu-nobias"])
    x = torch.randn(2, 3, 56, 56, generator=gen)
    timm_model, _ = _timm_from_file(export_backbone(model, "timm", tmp_path / "t.st").path)
    save_file(timm_model.state_dict(), str(tmp_path / "resaved.safetensors"))
    hf_path = export_backbone(model, "hf", tmp_path / "hf").path
    hf = transformers.Dinov2WithRegistersModel.from_pretrained(str(hf_path))
    hf.save_pretrained(tmp_path / "hf_resaved")
    for path in (tmp_path / "resaved.safetensors", tmp_path / "hf_resaved"):
        back = VisionTransformer(**(read_weights(path).arch.model_kwargs() | {"num_heads": HEADS}))
        notes = load_backbone(path, back)
        _close(_features(back, x), _features(model, x))
        fresh = ours(gen, **CONFIGS["registers-swiglu-nobias"])  # our own architecture
        notes = load_backbone(path, fresh)
        _close(_features(fresh, x), _features(model, x))
    assert any("zero proj_bias left out" in n for n in notes)  # Hugging Face has them all


# ---------------------------------------------------------------- interpolation


def _differs(a: tuple, b: tuple) -> bool:
    return not torch.allclose(a[1], b[1], atol=1e-4)


def test_interpolation_equals_the_libraries_where_they_resize_as_dinov2(tmp_path, gen):
    """Hugging Face's Dinov2Model resizes to the grid (offset 0, no
    anti-aliasing); Dinov2WithRegistersModel and timm's dynamic_img_size
    anti-alias (DINOv2's register models): ours with those options gives
    their features at sizes other than the table's, and other features
    with the anti-aliasing switched."""
    x = [torch.randn(2, 3, s, s, generator=gen) for s in (84, 42, 70)]
    for registers, antialias in ((0, False), (4, True)):
        cls, config = _hf_config(registers, False)
        hf = _randomize(cls(config), gen)
        hf.save_pretrained(tmp_path / f"hf{registers}")
        model = ours(gen, num_register_tokens=registers, interpolate_antialias=antialias)
        load_backbone(tmp_path / f"hf{registers}", model)
        for xi in x:
            _close(_features(model, xi), _hf_features(hf, xi, registers))
        model.interpolate_antialias = not antialias
        assert all(_differs(_features(model, xi), _hf_features(hf, xi, registers)) for xi in x)
    source = timm.create_model(
        "vit_small_patch14_reg4_dinov2",
        img_size=56,
        embed_dim=DIM,
        depth=2,
        num_heads=HEADS,
        num_classes=0,
        dynamic_img_size=True,
    )
    _randomize(source, gen)
    save_file(source.state_dict(), str(tmp_path / "timm.safetensors"))
    model = ours(gen, num_register_tokens=4, interpolate_antialias=True)
    load_backbone(tmp_path / "timm.safetensors", model)
    for xi in x:
        _close(_features(model, xi), _timm_features(source, xi, 4))
    model.interpolate_antialias = False
    assert all(_differs(_features(model, xi), _timm_features(source, xi, 4)) for xi in x)


def test_dinov2_offset_differs_from_the_libraries_but_exports_exactly(tmp_path, gen):
    """DINOv2's published ViTs without registers resize with offset 0.1 (a
    scale factor), which neither transformers nor timm does: their features
    at other sizes differ; a table exported for that size gives ours."""
    model = ours(gen, interpolate_offset=0.1)
    x = torch.randn(2, 3, 84, 84, generator=gen)
    native = transformers.Dinov2Model.from_pretrained(
        str(export_backbone(model, "hf", tmp_path / "native").path)
    )
    assert _differs(_hf_features(native, x, 0), _features(model, x))
    r = export_backbone(model, "hf", tmp_path / "at84", image_size=84)
    assert "offset 0.1" in r.notes[0]
    _close(
        _hf_features(transformers.Dinov2Model.from_pretrained(str(r.path)), x, 0),
        _features(model, x),
    )


# ---------------------------------------------------------------- adaptation and errors


def test_adaptations_keep_the_function(tmp_path, gen):
    x = torch.randn(2, 3, 56, 56, generator=gen)
    v1 = ours(gen, layerscale_init=None, use_mask_token=False)
    path = export_backbone(v1, "dino", tmp_path / "v1.pth").path
    target = ours(gen, num_register_tokens=0)  # LayerScale and a mask token: from v1 weights
    notes = load_backbone(path, target)
    assert any("LayerScale set to 1" in n for n in notes)
    assert any("mask token starts at zero" in n for n in notes)
    _close(_features(target, x), _features(v1, x), atol=0)
    cls, config = _hf_config(0, False)  # Hugging Face: LayerScale 1 at init, biases everywhere
    source = _randomize(cls(config), gen)
    with torch.no_grad():
        for name, p in source.named_parameters():
            if "lambda1" in name or "o_proj.bias" in name:
                p.fill_(1.0 if "lambda1" in name else 0.0)
    source.save_pretrained(tmp_path / "hf")
    plain = ours(gen, layerscale_init=None, proj_bias=False, use_mask_token=False)
    notes = load_backbone(tmp_path / "hf", plain)
    assert any("LayerScale of 1 left out" in n for n in notes)
    assert any("zero proj_bias left out" in n for n in notes)
    _close(_features(plain, x), _hf_features(source, x, 0))


def test_errors_name_the_problem(tmp_path, gen):
    source = ours(gen, **CONFIGS["registers"])
    path = export_backbone(source, "dinov2", tmp_path / "d.pth").path
    with pytest.raises(ValueError, match="4 registers, the model is a ViT .* with patch 14 \\("):
        load_backbone(path, ours(gen))
    with pytest.raises(ValueError, match="LayerScale, the model has none"):
        load_backbone(path, ours(gen, num_register_tokens=4, layerscale_init=None))
    with pytest.raises(ValueError, match="SwiGLU"):
        load_backbone(path, ours(gen, num_register_tokens=4, ffn_layer="swiglu"))
    hf = export_backbone(source, "hf", tmp_path / "hf").path
    with pytest.raises(ValueError, match="4 heads, the model 2"):
        load_backbone(hf, ours(gen, num_register_tokens=4, num_heads=2))
    state = torch.load(path, weights_only=True)
    state["blocks.1.attn.extra"] = state.pop("blocks.1.attn.qkv.weight")
    torch.save(state, tmp_path / "broken.pth")
    with pytest.raises(
        ValueError,
        match=r"missing keys.*blocks\.1\.attn\.qkv\.weight.*"
        r"unexpected.*blocks\.1\.attn\.extra",
    ):
        load_backbone(tmp_path / "broken.pth", ours(gen, num_register_tokens=4))
    with pytest.raises(ValueError, match="whole mlp_ratio"):
        export_backbone(ours(gen, mlp_ratio=2.5), "hf", tmp_path / "odd")


# ---------------------------------------------------------------- a dino_opt run's checkpoint


def test_export_weights_and_init_from_of_a_dinov2_style_run(tmp_path, gen):
    cfg = apply_overrides(
        default_config(),
        [
            "recipe.name=dinov2",
            "model.backbone=vit_tiny",
            "model.patch_size=14",
            "model.num_register_tokens=4",
            "model.layerscale_init=1e-5",
            "model.ffn_layer=swiglufused",
            "augmentation.global_crop_size=28",
            "augmentation.local_crop_size=14",
            "model.out_dim=16",
            "model.hidden_dim=16",
            "model.bottleneck_dim=8",
        ],
    )
    student, teacher = build_models(cfg)
    _randomize(teacher, gen)
    source = tmp_path / "ckpt.pth"
    torch.save(
        {"student": student.state_dict(), "teacher": teacher.state_dict(), "config": cfg.to_dict()},
        source,
    )
    x = torch.randn(2, 3, 28, 28, generator=gen)
    r = export_weights(source, "timm", tmp_path / "t.safetensors")
    assert r.image_size == 28 and "vit_giant_patch14_reg4_dinov2" in r.load
    timm_model, _ = _timm_from_file(r.path)
    _close(_timm_features(timm_model, x, 4), _features(teacher.backbone, x))
    s2, t2 = build_dino_models(
        "vit_tiny",
        out_dim=16,
        patch_size=14,
        hidden_dim=16,
        bottleneck_dim=8,
        num_register_tokens=4,
        layerscale_init=1e-5,
        ffn_layer="swiglufused",
        img_size=28,
        use_mask_token=True,
    )
    notes = init_from(r.path, s2, t2)
    assert notes[0].startswith("timm weights (vit_tiny)")
    _close(_features(t2.backbone, x), _features(teacher.backbone, x))
    with pytest.raises(ValueError, match="--format dinov2"):
        export_weights(source, "dino", tmp_path / "d.pth")
