"""DINOv3's ConvNeXt backbones: parameter counts against timm's, shapes for
several input sizes, the ViTs' forward_features keys, features equal to
timm's ConvNeXt with its weights converted (float64), DINOv3's layout,
gradients and drop path, the errors on bad input, the backbone registry and
config, and a 2-step `dino-opt train` with a tiny ConvNeXt on the CPU."""

import functools
import json

import pytest
import timm
import torch
import torch.nn.functional as F
from dino_opt.cli import main
from dino_opt.config import ConfigError, load_config
from dino_opt.data import builtin_dataset
from dino_opt.eval.dense import patch_feature_map
from dino_opt.eval.linear import ProbeFeatures
from dino_opt.models import (
    BACKBONES,
    CONVNEXT_SIZES,
    ConvNeXt,
    build_backbone,
    build_dino_models,
    convert_convnext_state_dict,
    convert_dinov3_convnext_state_dict,
    convert_timm_convnext_state_dict,
    vit_tiny,
)
from dino_opt.weights.export.cnn import export_cnn
from dino_opt.weights.load.reading import TRAINING_KEY, training_sidecar
from tiny import TINY
from torch import nn

try:
    import transformers
except ImportError:  # an optional test dependency; the GPU machine has none
    transformers = None

needs_transformers = pytest.mark.skipif(transformers is None, reason="needs transformers")

F64 = torch.float64
TINY_SIZE = dict(depths=(1, 1, 2, 1), dims=(8, 16, 24, 32))


def tiny(**kw) -> ConvNeXt:
    """A ConvNeXt small enough for a 2-core CPU."""
    return ConvNeXt(**(TINY_SIZE | kw))


def randomize(model: nn.Module, gen: torch.Generator) -> nn.Module:
    """Every parameter random (the LayerScale and the norms too, so that
    each block's branch counts)."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.3)
    return model


# ------------------------------------------------------------------ sizes


@pytest.mark.parametrize(
    "name, dim, count",
    [
        ("convnext_tiny", 768, 27_820_128),
        ("convnext_small", 768, 49_454_688),
        ("convnext_base", 1024, 87_566_464),
        ("convnext_large", 1536, 196_230_336),
    ],
)
def test_parameter_counts_equal_timms(name, dim, count):
    with torch.device("meta"):
        model, embed = build_backbone(name, drop_path_rate=0.0)
        reference = timm.create_model(name, num_classes=0)
    assert embed == dim == model.embed_dim and model.patch_size == 32
    assert list(model.depths) == [3, 3, 9 if name == "convnext_tiny" else 27, 3]
    assert sum(p.numel() for p in model.parameters()) == count
    assert sum(p.numel() for p in reference.parameters()) == count


def test_sizes_are_dinov3s():
    assert CONVNEXT_SIZES["convnext_tiny"] == dict(depths=(3, 3, 9, 3), dims=(96, 192, 384, 768))
    assert CONVNEXT_SIZES["convnext_small"]["dims"] == (96, 192, 384, 768)
    assert CONVNEXT_SIZES["convnext_base"]["dims"] == (128, 256, 512, 1024)
    assert CONVNEXT_SIZES["convnext_large"]["dims"] == (192, 384, 768, 1536)
    model = tiny(layer_scale_init=1e-6)
    block = model.stages[0][0]
    assert block.dwconv.kernel_size == (7, 7) and block.dwconv.groups == 8
    assert block.pwconv1.out_features == 32 and torch.all(block.gamma == 1e-6)
    assert model.downsample_layers[0][0].stride == (4, 4)
    assert all(model.downsample_layers[i][1].stride == (2, 2) for i in (1, 2, 3))
    assert tiny(layer_scale_init=None).stages[0][0].gamma is None


# ------------------------------------------------------------------ shapes


@pytest.mark.parametrize("size", [(32, 32), (64, 96), (96, 96), (100, 70), (224, 224)])
def test_shapes_for_several_input_sizes(size):
    model = tiny().eval()
    x = torch.randn(2, 3, *size)
    h, w = size[0] // 32, size[1] // 32
    with torch.no_grad():
        pooled = model(x)
        out = model.forward_features(x)
        maps = model.forward_maps(x)
    assert pooled.shape == (2, 32)
    assert out["x_norm_clstoken"].shape == (2, 32)
    assert out["x_norm_patchtokens"].shape == (2, h * w, 32)
    assert out["x_norm_regtokens"].shape == (2, 0, 32)
    assert out["x_prenorm"].shape == (2, 1 + h * w, 32)
    assert [tuple(m.shape[1:]) for m in maps] == [
        (d, size[0] // s, size[1] // s)
        for d, s in zip((8, 16, 24, 32), (4, 8, 16, 32), strict=True)
    ]
    torch.testing.assert_close(pooled, out["x_norm_clstoken"])


def test_forward_features_as_the_vits(gen):
    model = randomize(tiny(), gen).double().eval()
    vit = vit_tiny(patch_size=16)
    x = torch.randn(2, 3, 64, 96, generator=gen, dtype=F64)
    with torch.no_grad():
        out = model.forward_features(x)
        ref = vit.forward_features(torch.randn(2, 3, 64, 96))
        last = model.forward_maps(x)[-1]
    assert out.keys() == ref.keys()
    # class token: the average of the last map through the final norm; patch
    # tokens: the map flattened row by row, each through the final norm.
    norm = functools.partial(
        F.layer_norm,
        normalized_shape=(32,),
        weight=model.norm.weight,
        bias=model.norm.bias,
        eps=1e-6,
    )
    torch.testing.assert_close(out["x_norm_clstoken"], norm(last.mean((-2, -1))))
    tokens = last.permute(0, 2, 3, 1).reshape(2, 6, 32)
    torch.testing.assert_close(out["x_norm_patchtokens"], norm(tokens))
    torch.testing.assert_close(out["x_prenorm"][:, 1:], tokens)
    # lists of batches, as the ViTs take them
    small = torch.randn(3, 3, 32, 32, dtype=F64)
    outs = model.forward_features([x, small])
    assert [o["x_norm_patchtokens"].shape[1] for o in outs] == [6, 1]
    torch.testing.assert_close(model([x, small]), torch.cat([model(x), model(small)]))
    no_mask = torch.zeros(2, 6, dtype=torch.bool)
    assert model.forward_features(x, no_mask)["masks"] is no_mask


def test_the_eval_code_takes_its_features():
    model = tiny().eval()
    images = torch.randn(2, 3, 96, 64)
    with torch.no_grad():
        fmap = patch_feature_map(model, images)
        probe = ProbeFeatures(model)
        rows = probe(images)
    assert fmap.shape == (2, 32, 3, 2)
    assert probe.layout == {"dim": 32, "n_blocks": 1, "avgpool": False}
    assert rows.shape == (2, 32)


# ------------------------------------------------------------------ weights


def test_timm_weights_give_timms_features_float64(gen):
    """``timm.create_model("convnext_tiny")``'s state dict (its classifier
    included), all random, loads strictly; features equal timm's exactly."""
    reference = randomize(timm.create_model("convnext_tiny"), gen).double().eval()
    model = ConvNeXt(**CONVNEXT_SIZES["convnext_tiny"]).double().eval()
    model.load_state_dict(convert_timm_convnext_state_dict(reference.state_dict()), strict=True)
    x = torch.randn(2, 3, 64, 96, generator=gen, dtype=F64)
    with torch.no_grad():  # one pass each: float64 depthwise convolutions are slow on CPUs
        fmap = reference.forward_features(x)  # last map, before the head's norm
        pooled = reference.forward_head(fmap, pre_logits=True)
        out = model.forward_features(x)
    tokens = fmap.permute(0, 2, 3, 1).flatten(1, 2)
    torch.testing.assert_close(out["x_prenorm"][:, 1:], tokens, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out["x_norm_clstoken"], pooled, rtol=1e-12, atol=1e-12)
    head_norm = reference.head.norm
    normed = F.layer_norm(tokens, (768,), head_norm.weight, head_norm.bias, head_norm.eps)
    torch.testing.assert_close(out["x_norm_patchtokens"], normed, rtol=1e-12, atol=1e-12)


def test_timm_tiny_variant_and_conv_mlp_weights(gen):
    from timm.models.convnext import ConvNeXt as TimmConvNeXt

    for conv_mlp in (False, True):
        reference = TimmConvNeXt(num_classes=0, conv_mlp=conv_mlp, **TINY_SIZE)
        reference = randomize(reference, gen).double().eval()
        model = tiny().double().eval()
        model.load_state_dict(convert_convnext_state_dict(reference.state_dict()), strict=True)
        x = torch.randn(2, 3, 96, 64, generator=gen, dtype=F64)
        with torch.no_grad():
            expected = reference.forward_head(reference.forward_features(x), pre_logits=True)
            torch.testing.assert_close(model(x), expected, rtol=1e-10, atol=1e-10)


@needs_transformers
def test_written_for_timm_and_hugging_face_as_their_own_float64(gen, tmp_path):
    """A random ConvNeXt written as a student is exported (`dino-opt export
    --format timm|hf`): timm's ConvNeXt and transformers' ConvNextModel load
    it strictly, and their pooled features equal this model's (float64);
    each keeps the input it was trained at; both read back as they were."""
    from timm.models.convnext import ConvNeXt as TimmConvNeXt

    model = randomize(tiny(), gen).double().eval()
    training = {"image_size": 64, "mean": [0.5] * 3, "std": [0.25] * 3}
    meta = {TRAINING_KEY: json.dumps(training)}
    x = torch.randn(2, 3, 64, 96, generator=gen, dtype=F64)
    load, _ = export_cnn(
        "timm", model.state_dict(), "convnext_tiny", tmp_path / "t.pth", meta, lambda: None
    )
    assert load.startswith("net = timm.create_model('convnext_tiny', num_classes=0)")
    theirs = TimmConvNeXt(num_classes=0, **TINY_SIZE).double().eval()
    theirs.load_state_dict(torch.load(tmp_path / "t.pth", weights_only=True), strict=True)
    assert json.loads(training_sidecar(tmp_path / "t.pth").read_text())[TRAINING_KEY] == training
    folder = tmp_path / "hf"
    load, _ = export_cnn("hf", model.state_dict(), "convnext_tiny", folder, meta, lambda: None)
    assert load == "transformers.ConvNextModel.from_pretrained(path)"
    hf = transformers.ConvNextModel.from_pretrained(folder, dtype=F64).eval()
    assert json.loads((folder / "config.json").read_text())[TRAINING_KEY] == training
    classifier = {f"convnext.{k}": v for k, v in hf.state_dict().items()}  # its prefix
    for written in (theirs.state_dict(), classifier):
        back = convert_convnext_state_dict(written)  # read back: the same tensors
        assert back.keys() == model.state_dict().keys()
        assert all(torch.equal(back[k], v) for k, v in model.state_dict().items())
    with torch.no_grad():
        expected = model(x)
        torch.testing.assert_close(theirs(x), expected, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(
            hf(pixel_values=x).pooler_output, expected, rtol=1e-10, atol=1e-10
        )


@needs_transformers
def test_written_without_layer_scale_or_refused_in_one_line(gen, tmp_path):
    """Without LayerScale the Hugging Face config says so (its blocks then
    have none); a state dict with a foreign key is refused naming it."""
    model = randomize(tiny(layer_scale_init=None), gen).double().eval()
    export_cnn("hf", model.state_dict(), "convnext_tiny", tmp_path / "hf", {}, lambda: None)
    hf = transformers.ConvNextModel.from_pretrained(tmp_path / "hf", dtype=F64).eval()
    x = torch.randn(1, 3, 64, 64, generator=gen, dtype=F64)
    with torch.no_grad():
        torch.testing.assert_close(
            hf(pixel_values=x).pooler_output, model(x), rtol=1e-10, atol=1e-10
        )
    sd = model.state_dict() | {"extra.weight": torch.zeros(1)}
    with pytest.raises(ValueError, match="not a dino_opt ConvNeXt state dict: unknown keys extra"):
        export_cnn("timm", sd, "convnext_tiny", tmp_path / "x.pth", {}, lambda: None)


def _dinov3_keys(depths) -> list[str]:
    """The names of DINOv3's ConvNeXt (``dinov3/models/convnext.py``): the
    stem and downsampling layers, the blocks, ``norm`` and its ``norms.3`` alias."""
    keys = [
        f"downsample_layers.{i}.{j}.{p}"
        for i in range(4)
        for j in (0, 1)
        for p in ("weight", "bias")
    ]
    for i, n in enumerate(depths):
        for b in range(n):
            keys.append(f"stages.{i}.{b}.gamma")
            for layer in ("dwconv", "norm", "pwconv1", "pwconv2"):
                keys += [f"stages.{i}.{b}.{layer}.weight", f"stages.{i}.{b}.{layer}.bias"]
    return keys + ["norm.weight", "norm.bias", "norms.3.weight", "norms.3.bias"]


def test_dinov3_layout_loads(gen):
    source = randomize(tiny(), gen)
    shapes = {k: v.shape for k, v in source.state_dict().items()}
    theirs = {}
    for key in _dinov3_keys(TINY_SIZE["depths"]):
        own = key.replace("norms.3.", "norm.")
        theirs[key] = source.state_dict()[own] if key != own else torch.randn(shapes[own])
    model = tiny()
    converted = convert_dinov3_convnext_state_dict(theirs)
    model.load_state_dict(converted, strict=True)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, theirs[key])
    # our own state dict is DINOv3's without the alias
    assert convert_convnext_state_dict(model.state_dict()).keys() == model.state_dict().keys()
    # the alias alone stands for the norm
    alone = {k: v for k, v in theirs.items() if not k.startswith("norm.")}
    tiny().load_state_dict(convert_dinov3_convnext_state_dict(alone), strict=True)


def test_foreign_keys_are_refused_in_one_line():
    sd = tiny().state_dict()
    with pytest.raises(
        ValueError,
        match=r"not a DINOv3 ConvNeXt state dict: unknown keys "
        r"cls_token",
    ) as e:
        convert_dinov3_convnext_state_dict(sd | {"cls_token": torch.zeros(1)})
    assert "\n" not in str(e.value)
    from timm.models.convnext import ConvNeXt as TimmConvNeXt

    hnf = TimmConvNeXt(num_classes=0, head_norm_first=True, **TINY_SIZE).state_dict()
    with pytest.raises(ValueError, match="not a timm ConvNeXt state dict: unknown keys norm_pre"):
        convert_timm_convnext_state_dict(hnf)


# ------------------------------------------------------------------ training


def test_gradients_flow_and_drop_path(gen):
    model = randomize(tiny(drop_path_rate=0.0), gen).train()
    x = torch.randn(4, 3, 64, 64, generator=gen)
    out = model.forward_features(x)
    (out["x_norm_clstoken"].square().sum() + out["x_norm_patchtokens"].square().sum()).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name

    # DINOv3's ramp: 0 at the first block to the rate at the last, over all stages
    rates = [getattr(b.drop_path, "p", 0.0) for s in tiny(drop_path_rate=0.3).stages for b in s]
    assert rates == pytest.approx([0.3 * i / 4 for i in range(5)])
    model = tiny(drop_path_rate=0.5, layer_scale_init=1.0)  # branches that count
    torch.manual_seed(0)
    a = model(x)
    b = model(x)
    assert not torch.allclose(a, b)  # a block's branch dropped for some samples
    model.eval()
    torch.testing.assert_close(model(x), model(x))


def test_bad_input_is_one_line():
    model = tiny()
    cases = [
        (torch.randn(3, 64, 64), r"takes images \(B, 3, H, W\), got \(3, 64, 64\)"),
        (torch.randn(1, 4, 64, 64), "takes 3 channels, got images"),
        (torch.randn(1, 3, 16, 64), "at least 32 x 32 pixels"),
        ("images", r"takes images \(B, 3, H, W\), got str"),
    ]
    for x, words in cases:
        for call in (model, model.forward_features):
            with pytest.raises(ValueError, match=words) as e:
                call(x)
            assert "\n" not in str(e.value)
    masks = torch.zeros(1, 4, dtype=torch.bool)
    masks[0, 1] = True
    with pytest.raises(ValueError, match="no mask token"):
        model.forward_features(torch.randn(1, 3, 64, 64), masks)
    with pytest.raises(ValueError, match="4 positive depths"):
        ConvNeXt(depths=(3, 3, 9), dims=(96, 192, 384))


# ------------------------------------------------------------------ registry, config, train


def test_registered_as_backbones(monkeypatch):
    names = ("convnext_tiny", "convnext_small", "convnext_base", "convnext_large")
    assert BACKBONES[-4:] == names
    for name in names:
        assert load_config(None, [f"model.backbone={name}"]).model.backbone == name
    with pytest.raises(
        ValueError, match="ConvNeXt; the ViT options num_register_tokens, img_size do not apply"
    ) as e:
        build_backbone("convnext_tiny", num_register_tokens=4, img_size=96)
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="use distributed.strategy=ddp"):
        load_config(None, ["model.backbone=convnext_tiny", "distributed.strategy=fsdp"])
    with pytest.raises(ConfigError, match="needs a ViT backbone"):
        load_config({"recipe": "dinov2", "model": {"backbone": "convnext_small"}})
    with pytest.raises(ConfigError, match="model.patch_size applies to ViT backbones only"):
        load_config(None, ["model.backbone=convnext_base", "model.patch_size=8"])
    with torch.device("meta"):
        model, dim = build_backbone("convnext_small", drop_path_rate=0.2)
    assert dim == 768 and model.stages[-1][-1].drop_path.p == pytest.approx(0.2)


def test_multicrop_models_take_global_and_local_crops(monkeypatch):
    import dino_opt.models as models

    monkeypatch.setitem(models._CONVNEXTS, "convnext_tiny", tiny)
    student, teacher = build_dino_models(
        "convnext_tiny", out_dim=64, hidden_dim=32, bottleneck_dim=16, drop_path_rate=0.1
    )
    assert student.backbone.stages[-1][-1].drop_path.p == pytest.approx(0.1)
    assert isinstance(teacher.backbone.stages[-1][-1].drop_path, nn.Identity)
    assert not any(p.requires_grad for p in teacher.parameters())
    crops = [torch.randn(2, 3, 224, 224)] * 2 + [torch.randn(2, 3, 96, 96)] * 3
    out = student(crops)
    assert out.shape == (10, 64)
    out.sum().backward()
    assert student.backbone.downsample_layers[0][0].weight.grad is not None
    with torch.no_grad():
        assert teacher(crops[:2]).shape == (4, 64)


def test_dino_train_two_steps_with_a_tiny_convnext(monkeypatch, tmp_path):
    """`dino-opt train` with model.backbone=convnext_tiny (a tiny one in its
    place) and the dino recipe: 10 images at batch 4, 2 steps, no val split."""
    import dino_opt.models as models

    monkeypatch.setitem(models._CONVNEXTS, "convnext_tiny", tiny)
    root = builtin_dataset(
        tmp_path / "data", train_per_class=1, val_per_class=1, test_per_class=0, image_size=40
    )
    train = tmp_path / "trainonly" / "train"
    train.parent.mkdir()
    train.symlink_to(root / "train")
    out = tmp_path / "run"
    overrides = [
        *TINY,
        "model.backbone=convnext_tiny",
        "model.patch_size=16",
        "augmentation.global_crop_size=64",
        "augmentation.local_crop_size=32",
        "data.batch_size=4",
        "schedule.epochs=1",
        "schedule.warmup_epochs=0",
        "recipe.name=dino",
    ]
    assert (
        main(["train", "--output-dir", str(out), "--quiet", f"data.root={train}", *overrides]) == 0
    )
    report = json.loads((out / "report.json").read_text())
    assert report["steps"] == 2
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
