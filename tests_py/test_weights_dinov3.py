"""DINOv3 weights in and out: dino_opt's DINOv3 ViT exported to DINOv3's own
layout, timm's ``vit_*_patch16_dinov3`` and Hugging Face's DINOv3ViTModel,
read back (read_weights, load_backbone, init_from) to the same tensors;
float64 features equal to timm's and Hugging Face's models loaded with the
exported weights, and to ours loaded with theirs; a dino_opt run's DINOv3
backbone through ``export_weights`` / ``dino-opt export`` and
``model.init_from``; the Gram teacher's ``recipe.gram.ckpt`` from those
files; the adaptations that keep the function, and one-line errors. Tiny
models (width 64, depth 2, 2 heads) so that it runs on a 2-core CPU."""

import copy
import json

import pytest
import torch
from dino_opt import dinov3
from dino_opt.cli import main
from dino_opt.config import GramConfig, apply_overrides, default_config
from dino_opt.models import DinoV3VisionTransformer, VisionTransformer
from dino_opt.train import GramTeacher, build_models
from dino_opt.weights import (
    DinoV3Arch,
    export_backbone,
    export_weights,
    init_from,
    load_backbone,
    open_backbone,
    read_weights,
)
from dino_opt.weights.layouts.dinov3 import from_hf_dinov3, rope_from_periods
from safetensors import safe_open
from safetensors.torch import load_file, save_file

timm = pytest.importorskip("timm")
transformers = pytest.importorskip("transformers")

F64 = torch.float64
CONFIGS = {
    "mlp": {},
    "swiglu": dict(ffn_layer="swiglu"),
    "plain": dict(qkv_bias=False, proj_bias=False, n_storage_tokens=2, layerscale_init=None),
}
FILES = {"dinov3": "d.pth", "timm": "t.safetensors", "hf": "hf"}


def _randomize(module: torch.nn.Module, gen: torch.Generator) -> torch.nn.Module:
    """Every parameter random (norm scales and LayerScale near 1), so that a
    swapped key cannot go unnoticed."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            scale = name.endswith(
                ("norm1.weight", "norm2.weight", "norm.weight", "gamma", "lambda1")
            )
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.1 + float(scale))
    return module.eval()


def ours(gen=None, **kw) -> DinoV3VisionTransformer:
    kw = dict(embed_dim=64, depth=2, num_heads=2, use_mask_token=True) | kw
    model = DinoV3VisionTransformer(**kw)
    return _randomize(model.double(), gen) if gen is not None else model.double().eval()


def _features(model, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        out = model.eval().forward_features(x)
    return out["x_norm_clstoken"], out["x_norm_patchtokens"]


def _tokens(tokens: torch.Tensor, storage: int) -> tuple[torch.Tensor, torch.Tensor]:
    return tokens[:, 0], tokens[:, 1 + storage :]


def _close(a: tuple, b: tuple, atol: float) -> None:
    for u, v in zip(a, b, strict=True):
        assert u.shape == v.shape
        assert (u - v).abs().max().item() <= atol


def _timm_from_file(path):
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    model = timm.create_model(
        meta["timm_model"], pretrained=False, **json.loads(meta["timm_kwargs"])
    )
    model.double().load_state_dict(load_file(path), strict=True)
    return model.eval(), meta


def _images(gen, *size):
    return torch.randn(2, 3, *size, generator=gen, dtype=F64)


# ---------------------------------------------------------------- round trips


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("fmt", FILES)
def test_round_trips_give_our_tensors(fmt, config, tmp_path, gen):
    model = ours(gen, **CONFIGS[config])
    r = export_backbone(model, fmt, tmp_path / FILES[fmt])
    weights = read_weights(r.path)
    assert weights.format == fmt and weights.backbone == "vit_dinov3"
    assert isinstance(weights.arch, DinoV3Arch) and weights.arch.heads == 2
    mine = model.state_dict()
    read = weights.teacher["backbone"]
    for key, value in read.items():  # what the target adds: LayerScale 1, zero biases
        if key not in mine:
            assert key.endswith("bias") and not value.any() or bool((value == 1).all()), key
    lost = {"mask_token"} if fmt == "timm" else set()
    assert set(mine) - set(read) == lost
    for key in set(mine) - lost:
        assert torch.equal(read[key], mine[key]), key
    fresh = ours(**CONFIGS[config])
    load_backbone(r.path, fresh)
    x = _images(gen, 32, 48)
    _close(_features(fresh, x), _features(model, x), atol=0)
    opened = open_backbone(r.path)  # what dino-opt knn / eval --weights build (float32)
    assert isinstance(opened.net, DinoV3VisionTransformer)
    _close(_features(opened.net, x.float()), _features(model.float(), x.float()), atol=1e-5)


def official_keys(depth: int, swiglu: bool, storage: bool) -> list[str]:
    """DINOv3's DinoVisionTransformer state dict keys, in its order."""
    keys = [
        "cls_token",
        *(["storage_tokens"] if storage else []),
        "mask_token",
        "patch_embed.proj.weight",
        "patch_embed.proj.bias",
        "rope_embed.periods",
    ]
    ffn = ["w1", "w2", "w3"] if swiglu else ["fc1", "fc2"]
    for i in range(depth):
        b = f"blocks.{i}."
        keys += [
            b + k
            for k in (
                "norm1.weight",
                "norm1.bias",
                "attn.qkv.weight",
                "attn.qkv.bias",
                "attn.qkv.bias_mask",
                "attn.proj.weight",
                "attn.proj.bias",
                "ls1.gamma",
                "norm2.weight",
                "norm2.bias",
            )
        ]
        keys += [f"{b}mlp.{n}.{k}" for n in ffn for k in ("weight", "bias")] + [b + "ls2.gamma"]
    return keys + ["norm.weight", "norm.bias"]


@pytest.mark.parametrize("config", ["mlp", "swiglu"])
def test_official_layout_is_dinov3s_and_timm_reads_it(config, tmp_path, gen):
    from timm.models.eva import checkpoint_filter_fn

    model = ours(gen, **CONFIGS[config])
    r = export_backbone(model, "dinov3", tmp_path / "dinov3_vits16_pretrain.pth")
    state = torch.load(r.path, weights_only=True)
    assert sorted(state) == sorted(official_keys(2, config == "swiglu", True))
    assert "DinoVisionTransformer(" in r.load and "n_storage_tokens=4" in r.load
    mask = state["blocks.0.attn.qkv.bias_mask"]
    assert mask.tolist() == [1.0] * 64 + [0.0] * 64 + [1.0] * 64
    assert rope_from_periods(state["rope_embed.periods"], 64)[0] == 2
    # timm converts DINOv3's published files with this function: it reads ours as one
    swiglu = {"swiglu_mlp": True, "swiglu_align_to": 8, "mlp_ratio": 2.75}
    theirs = timm.create_model(
        "vit_base_patch16_dinov3_qkvb",
        pretrained=False,
        embed_dim=64,
        depth=2,
        num_heads=2,
        num_classes=0,
        **(swiglu if config == "swiglu" else {}),
    )
    theirs.double().load_state_dict(checkpoint_filter_fn(state, theirs), strict=True)
    x = _images(gen, 48, 32)
    with torch.no_grad():
        _close(_tokens(theirs.eval().forward_features(x), 4), _features(model, x), atol=1e-12)


def test_official_file_with_bfloat16_periods_and_a_masked_key_bias(tmp_path, gen):
    model = ours(gen)
    path = export_backbone(model, "dinov3", tmp_path / "d.pth").path
    state = torch.load(path, weights_only=True)
    state["rope_embed.periods"] = state["rope_embed.periods"].bfloat16()  # DINOv3's default dtype
    for key in [k for k in state if k.endswith("qkv.bias")]:
        state[key][64:128] = torch.randn(64, generator=gen, dtype=F64)  # masked: never used
    torch.save(state, tmp_path / "published.pth")
    weights = read_weights(tmp_path / "published.pth")
    assert weights.format == "dinov3" and weights.arch.rope == weights.arch.rope_spec
    fresh = ours()
    load_backbone(tmp_path / "published.pth", fresh)
    x = _images(gen, 32, 32)
    _close(_features(fresh, x), _features(model, x), atol=0)


# ---------------------------------------------------------------- features equal to the libraries'


@pytest.mark.parametrize("config", CONFIGS)
def test_timm_export_gives_our_features(config, tmp_path, gen):
    model = ours(gen, **CONFIGS[config])
    r = export_backbone(model, "timm", tmp_path / "t.safetensors", image_size=64)
    theirs, meta = _timm_from_file(r.path)
    assert meta["timm_model"].endswith("_dinov3" if config == "plain" else "_dinov3_qkvb")
    storage = model.num_register_tokens
    for size in [(64, 64), (32, 80)]:
        x = _images(gen, *size)
        with torch.no_grad():
            _close(_tokens(theirs.forward_features(x), storage), _features(model, x), atol=1e-12)
            _close((theirs(x),), (model(x),), atol=1e-12)  # class-token pooling, as ours


@pytest.mark.parametrize("config", CONFIGS)
def test_hf_export_gives_our_features(config, tmp_path, gen):
    model = ours(gen, **CONFIGS[config])
    r = export_backbone(model, "hf", tmp_path / "hf")
    cfg = json.loads((r.path / "config.json").read_text())
    assert cfg["model_type"] == "dinov3_vit" and cfg["use_gated_mlp"] == (config == "swiglu")
    theirs = transformers.DINOv3ViTModel.from_pretrained(str(r.path), dtype=F64).eval()
    assert theirs.embeddings.cls_token.dtype == F64
    for size in [(64, 64), (32, 80)]:
        x = _images(gen, *size)
        with torch.no_grad():
            tokens = theirs(pixel_values=x).last_hidden_state
        # Hugging Face computes its RoPE in float32: equal to float32's rounding
        _close(_tokens(tokens, model.num_register_tokens), _features(model, x), atol=1e-6)


@pytest.mark.parametrize("swiglu", [False, True])
@pytest.mark.parametrize("container", ["safetensors", "torch"])
def test_random_timm_models_load_into_ours(swiglu, container, tmp_path, gen):
    kw = {"swiglu_mlp": True, "swiglu_align_to": 8, "mlp_ratio": 2.75} if swiglu else {}
    theirs = timm.create_model(
        "vit_base_patch16_dinov3_qkvb",
        pretrained=False,
        embed_dim=64,
        depth=2,
        num_heads=2,
        num_classes=0,
        **kw,
    )
    _randomize(theirs.double(), gen)
    path = tmp_path / ("t.safetensors" if container == "safetensors" else "t.pth")
    if container == "safetensors":
        save_file(theirs.state_dict(), path)
    else:
        torch.save(theirs.state_dict(), path)
    assert read_weights(path).format == "timm"
    model = ours(ffn_layer="swiglu" if swiglu else "mlp")
    notes = load_backbone(path, model)
    assert any("mask token starts at zero" in n for n in notes)
    x = _images(gen, 32, 48)
    with torch.no_grad():
        _close(_features(model, x), _tokens(theirs.eval().forward_features(x), 4), atol=1e-12)


@pytest.mark.parametrize("gated", [False, True])
def test_random_hugging_face_models_load_into_ours(gated, tmp_path, gen):
    config = transformers.DINOv3ViTConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_register_tokens=4,
        intermediate_size=176 if gated else 256,
        use_gated_mlp=gated,
        hidden_act="silu" if gated else "gelu",
    )
    theirs = _randomize(transformers.DINOv3ViTModel(config).double(), gen)
    theirs.save_pretrained(tmp_path / "hf")
    weights = read_weights(tmp_path / "hf")
    assert (weights.format, weights.arch.num_heads, weights.arch.swiglu) == ("hf", 2, gated)
    model = ours(ffn_layer="swiglu" if gated else "mlp")
    load_backbone(tmp_path / "hf", model)
    direct = ours(ffn_layer="swiglu" if gated else "mlp")  # the package's map on the module's keys
    direct.load_state_dict(from_hf_dinov3(theirs.state_dict()), strict=True)
    x = _images(gen, 32, 48)
    with torch.no_grad():
        tokens = theirs(pixel_values=x).last_hidden_state
    _close(_features(model, x), _tokens(tokens, 4), atol=1e-6)
    _close(_features(direct, x), _features(model, x), atol=0)


# ---------------------------------------------------------------- adaptations


def test_adaptations_keep_the_function(tmp_path, gen):
    x = _images(gen, 32, 32)
    local = ours(gen, untie_global_and_local_cls_norm=True)  # the 7B's local-crop class norm
    r = export_backbone(local, "timm", tmp_path / "t.safetensors")
    assert any("local crops' class norm left out" in n for n in r.notes)
    target = ours(untie_global_and_local_cls_norm=True)
    notes = load_backbone(r.path, target)
    assert any("local crops' class norm starts as the norm" in n for n in notes)
    assert torch.equal(target.local_cls_norm.weight, local.norm.weight)
    _close(_features(target, x), _features(local, x), atol=0)
    plain_bias = ours(gen, mask_k_bias=False)  # a learned key bias, zero here
    with torch.no_grad():
        for block in plain_bias.blocks:
            block.attn.qkv.bias[64:128] = 0
    path = export_backbone(plain_bias, "dinov3", tmp_path / "k.pth").path
    masked = ours()
    assert any("key bias of zero masked" in n for n in load_backbone(path, masked))
    _close(_features(masked, x), _features(plain_bias, x), atol=0)
    timm_path = export_backbone(plain_bias, "timm", tmp_path / "k.safetensors").path
    assert read_weights(timm_path).arch.mask_k_bias


# ---------------------------------------------------------------- errors


def _one_line(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message, message
    return message


def test_errors_name_the_problem(tmp_path, gen):
    model = ours(gen)
    path = export_backbone(model, "dinov3", tmp_path / "d.pth").path
    data = path.read_bytes()
    (tmp_path / "cut.pth").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="cut.pth: not a weights file") as e:
        read_weights(tmp_path / "cut.pth")
    _one_line(e)
    timm_path = export_backbone(model, "timm", tmp_path / "t.safetensors").path
    state = load_file(timm_path)
    del state["blocks.1.gamma_2"]
    save_file(state, tmp_path / "part.safetensors")
    with pytest.raises(ValueError, match=r"part.safetensors: .*missing keys.*blocks\.1\.ls2"):
        load_backbone(tmp_path / "part.safetensors", ours(use_mask_token=False))
    sw = export_backbone(ours(gen, ffn_layer="swiglu"), "timm", tmp_path / "s.safetensors").path
    state = load_file(sw)
    del state["blocks.0.mlp.fc1_x.weight"]
    save_file(state, tmp_path / "half.safetensors")
    with pytest.raises(ValueError, match="half.safetensors: a timm DINOv3 state dict without") as e:
        read_weights(tmp_path / "half.safetensors")
    _one_line(e)
    with pytest.raises(ValueError, match="the model is a vit with patch 16; DINOv3's ViT") as e:
        load_backbone(path, VisionTransformer(embed_dim=64, depth=2, num_heads=2))
    _one_line(e)
    dinov2 = export_backbone(
        VisionTransformer(embed_dim=64, depth=2, num_heads=2), "dinov2", tmp_path / "v2.pth"
    ).path
    with pytest.raises(
        ValueError,
        match="v2.pth: the weights hold a vit with patch 16, the model is a DINOv3 ViT of width 64",
    ) as e:
        load_backbone(dinov2, ours())
    _one_line(e)
    with pytest.raises(ValueError, match="SwiGLU 176 wide with patch 16, the model is a DINOv3"):
        load_backbone(sw, ours())
    based = export_backbone(ours(gen, pos_embed_rope_base=50.0), "dinov3", tmp_path / "b.pth")
    with pytest.raises(
        ValueError, match="RoPE has base 50, separate coordinates, the model's base 100"
    ):
        load_backbone(based.path, ours())


def test_export_refuses_what_a_format_cannot_hold(tmp_path, gen):
    model = ours(gen)
    for fmt in ("dino", "dinov2"):
        with pytest.raises(ValueError, match=f"--format {fmt} writes .* --format dinov3, timm"):
            export_backbone(model, fmt, tmp_path / "x.pth")
    untied = ours(gen, untie_cls_and_patch_norms=True)
    periods = ours(
        gen, pos_embed_rope_base=None, pos_embed_rope_min_period=0.5, pos_embed_rope_max_period=40.0
    )
    for bad, what in ((untied, "untie_cls_and_patch_norms"), (periods, "periods from 0.5 to 40")):
        for fmt in ("timm", "hf"):
            with pytest.raises(ValueError, match=what) as e:
                export_backbone(bad, fmt, tmp_path / "x")
            assert "--format dinov3 writes this one" in _one_line(e)
        r = export_backbone(bad, "dinov3", tmp_path / f"{what[:4]}.pth")
        fresh = ours(**({"untie_cls_and_patch_norms": True} if bad is untied else {}))
        if bad is periods:
            fresh = ours(
                pos_embed_rope_base=None,
                pos_embed_rope_min_period=0.5,
                pos_embed_rope_max_period=40.0,
            )
        load_backbone(r.path, fresh)  # the periods give the RoPE back
        x = _images(gen, 32, 32)
        _close(_features(fresh, x), _features(bad, x), atol=0)
    assert not (tmp_path / "x").exists() and not (tmp_path / "x.pth").exists()
    with pytest.raises(ValueError, match="--format dinov3 writes DINOv3's ViT"):
        export_backbone(
            VisionTransformer(embed_dim=64, depth=1, num_heads=2), "dinov3", tmp_path / "v.pth"
        )


# ---------------------------------------------------------------- a dino_opt run and gram_ckpt


@pytest.fixture(scope="module")
def dinov3_run(tmp_path_factory):
    """A checkpoint of a vit_small_dinov3 run (random weights), and its config."""
    cfg = apply_overrides(
        default_config(),
        [
            "model.backbone=vit_small_dinov3",
            "model.out_dim=16",
            "model.hidden_dim=16",
            "model.bottleneck_dim=8",
            "augmentation.global_crop_size=32",
            "augmentation.local_crop_size=16",
        ],
    )
    student, teacher = build_models(cfg)
    _randomize(teacher, torch.Generator().manual_seed(0))
    path = tmp_path_factory.mktemp("run") / "checkpoint.pth"
    torch.save(
        {"student": student.state_dict(), "teacher": teacher.state_dict(), "config": cfg.to_dict()},
        path,
    )
    return path, cfg, teacher


def test_a_runs_dinov3_backbone_exports_and_starts_a_run(dinov3_run, tmp_path, capsys, gen):
    source, cfg, teacher = dinov3_run
    assert read_weights(source).backbone == "vit_small_dinov3"
    x = torch.randn(1, 3, 32, 32, generator=gen)
    want = _features(teacher.backbone, x)
    student2, teacher2 = build_models(cfg)
    for fmt in FILES:
        capsys.readouterr()
        out = tmp_path / FILES[fmt]
        assert main(["export", str(source), "--format", fmt, "--output", str(out)]) == 0
        result = json.loads(capsys.readouterr().out)
        assert (result["format"], result["backbone"]) == (fmt, "vit_small_dinov3")
        weights = read_weights(out)
        assert weights.backbone == "vit_small_dinov3" and not weights.arch.options()
        notes = init_from(out, student2, teacher2)
        assert notes[0].startswith(f"{fmt} weights (vit_small_dinov3)")
        _close(_features(teacher2.backbone, x), want, atol=0)
    hub = dinov3.dinov3_vits16(weights=tmp_path / FILES["dinov3"])  # DINOv3's hub call
    _close(_features(hub, x), want, atol=0)
    r = export_weights(source, "timm", tmp_path / "named.safetensors")
    assert "vit_small_patch16_dinov3_qkvb" in r.load
    timm_model, _ = _timm_from_file(r.path)
    with torch.no_grad():
        tokens = timm_model.forward_features(x.double())
    backbone = copy.deepcopy(teacher.backbone).double()
    _close(_tokens(tokens, 4), _features(backbone, x.double()), atol=1e-10)
    with pytest.raises(ValueError, match="--format dinov2 writes DINOv2's ViT") as e:
        export_weights(source, "dinov2", tmp_path / "v2.pth")
    _one_line(e)


def test_init_from_refuses_another_size_in_one_line(dinov3_run, tmp_path, gen):
    tiny = export_backbone(ours(gen), "hf", tmp_path / "tiny").path
    student, teacher = build_models(dinov3_run[1])
    other = (
        r"tiny: the weights hold a DINOv3 ViT of width 64, depth 2, MLP 256 wide "
        r"with patch 16, the model is a vit_small_dinov3 with patch 16 \(set"
    )
    with pytest.raises(ValueError, match=other) as e:
        init_from(tiny, student, teacher)
    _one_line(e)
    head = ["model.out_dim=16", "model.hidden_dim=16", "model.bottleneck_dim=8"]
    vit = apply_overrides(default_config(), ["model.backbone=vit_small", *head])
    s2, t2 = build_models(vit)
    family = (
        "the weights hold a vit_small_dinov3 with patch 16, the model is a vit_small with "
        "patch 16; DINOv3's"
    )
    with pytest.raises(ValueError, match=family) as e:
        init_from(dinov3_run[0], s2, t2)
    _one_line(e)


@pytest.mark.parametrize("fmt", ["timm", "dinov3"])
def test_gram_ckpt_reads_timm_and_dinov3_files(fmt, tmp_path, gen):
    source = ours(gen, ffn_layer="swiglu").float()
    path = export_backbone(source, fmt, tmp_path / FILES[fmt]).path
    gram = GramTeacher(GramConfig(ckpt=str(path), it_load_ema_teacher=-1))
    gram.attach(
        DinoV3VisionTransformer(embed_dim=64, depth=2, num_heads=2, ffn_layer="swiglu"),
        load_backbone,
    )
    assert gram.loaded
    for key, value in gram.backbone.state_dict().items():
        assert torch.equal(value, source.state_dict()[key]), key
    wrong = GramTeacher(GramConfig(ckpt=str(path)))
    with pytest.raises(
        ValueError, match=f"recipe.gram.ckpt='.*{FILES[fmt]}' does not fit the Gram teacher"
    ) as e:
        wrong.attach(VisionTransformer(embed_dim=64, depth=2, num_heads=2), load_backbone)
    _one_line(e)
