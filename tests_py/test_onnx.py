"""`dino-opt export --format onnx`: every backbone kind (a ViT with a learned
position table at the size it was trained at, DINOv3's RoPE ViT, a ResNet,
a ConvNeXt) as an ONNX graph with a dynamic batch (and image size where the
network allows it), whose onnxruntime outputs are PyTorch's within 1e-4 on
real images; the input it was trained at in its metadata; bad requests in
one line."""

import json
import sys

import numpy as np
import pytest
import torch
from dino_opt.cli import main
from dino_opt.eval import EvalLoader
from dino_opt.models import build_backbone
from dino_opt.weights import export_backbone, export_onnx, open_backbone

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")


def _images(root, size: int, batch: int) -> torch.Tensor:
    with EvalLoader(root, size, batch, labelled=False, pin_memory=False) as loader:
        return next(iter(loader))[0]


def _outputs(net, images: torch.Tensor) -> list[np.ndarray]:
    with torch.no_grad():
        if hasattr(net, "forward_features"):
            out = net.forward_features(images)
            return [out["x_norm_clstoken"].numpy(), out["x_norm_patchtokens"].numpy()]
        return [net(images).numpy()]


def _largest_difference(path, net, images) -> float:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = session.run(None, {"images": images.numpy()})
    return max(float(np.abs(g - w).max()) for g, w in zip(got, _outputs(net, images), strict=True))


def test_a_run_exports_at_the_size_it_was_trained_at(run, tiny_data, tmp_path, capsys):
    capsys.readouterr()
    assert (
        main(
            [
                "export",
                str(run),
                "--format",
                "onnx",
                "--output",
                str(tmp_path / "m.onnx"),
                "--data",
                str(tiny_data / "val"),
            ]
        )
        == 0
    )
    result = json.loads(capsys.readouterr().out)
    assert result["image_size"] == 32 and result["dynamic"] == ["batch"]
    assert result["outputs"] == ["cls", "patch_tokens"] and result["max_abs_diff"] < 1e-4
    meta = {p.key: p.value for p in onnx.load(str(tmp_path / "m.onnx")).metadata_props}
    assert json.loads(meta["dino_opt_training"])["image_size"] == 32
    net = open_backbone(run).net
    for batch in (1, 5):  # any batch
        images = _images(tiny_data / "train", 32, batch)
        assert _largest_difference(tmp_path / "m.onnx", net, images) < 1e-4
    session = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    with pytest.raises(Exception, match="images"):  # the table holds 32 px: one size only
        session.run(None, {"images": _images(tiny_data / "train", 48, 2).numpy()})


@pytest.mark.parametrize(
    "name,options",
    [
        ("vit_small_dinov3", {"depth": 2}),
        ("resnet18", {}),
        ("convnext_tiny", {"depths": [1, 1, 1, 1], "dims": [16, 32, 64, 128]}),
    ],
)
def test_networks_without_a_position_table_take_any_size(name, options, tiny_data, tmp_path):
    torch.manual_seed(0)
    net, _ = build_backbone(name, **options)
    source = net
    if name.endswith("dinov3"):  # through a file, as a user's weights come
        source = export_backbone(net, "dinov3", tmp_path / "v3.pth").path
    result = export_onnx(source, tmp_path / "m.onnx", image_size=64, data=tiny_data / "val")
    assert result["dynamic"] == ["batch", "height", "width"] and result["max_abs_diff"] < 1e-4
    assert result["checked_sizes"] == [64, 64 + 2 * (16 if name.endswith("dinov3") else 32)]
    net = open_backbone(source).net if name.endswith("dinov3") else net.eval()
    for batch, size in ((1, 96), (4, 128)):
        images = _images(tiny_data / "train", size, batch)
        assert _largest_difference(tmp_path / "m.onnx", net, images) < 1e-4


def test_bad_requests_are_one_line(run, tmp_path, capsys, monkeypatch):
    out = tmp_path / "m.onnx"
    for args, message in (
        (["--image-size", "30"], "image_size 30 is not a multiple of the patch size 8"),
        (["--data", str(tmp_path / "none")], "does not exist"),
    ):
        capsys.readouterr()
        with pytest.raises(SystemExit) as e:
            main(["export", str(run), "--format", "onnx", "--output", str(out), *args])
        err = capsys.readouterr().err
        assert e.value.code == 2 and message in err and len(err.strip().splitlines()) == 1
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # not installed
    with pytest.raises(SystemExit) as e:
        main(["export", str(run), "--format", "onnx", "--output", str(out), "--force"])
    assert e.value.code == 2 and "pip install 'dino_opt[onnx]'" in capsys.readouterr().err
