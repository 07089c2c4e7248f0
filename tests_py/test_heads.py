"""Probe heads kept and applied: `dino-opt eval linear|dense --head FILE`
saves the best head with the backbone's identity; `dino-opt predict`
reloads it and gives the probe's own predictions (the same classes, the
same validation figures), and refuses other weights."""

import csv
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from dino_opt.cli import main
from dino_opt.data import open_source
from dino_opt.data.segmentation import segmentation_splits
from dino_opt.eval import DenseLinearHead, ProbeFeatures, extract_features
from dino_opt.eval.dense import extract_dense_features
from dino_opt.weights import open_backbone
from dino_opt.weights.heads import load_head
from PIL import Image
from tiny import tiny_one_epoch


@pytest.fixture(scope="module")
def one_epoch(tmp_path_factory):
    """conftest's tiny run, on 3 training and 2 validation images a class."""
    return tiny_one_epoch(tmp_path_factory, train_per_class=3, val_per_class=2)


def _cli(capsys, *args: str) -> str:
    capsys.readouterr()
    assert main([*args, "--device", "cpu"]) == 0
    return capsys.readouterr().out


def test_a_saved_linear_head_predicts_as_the_probe(run, tiny_data, tmp_path, capsys):
    head = tmp_path / "linear.safetensors"
    _cli(
        capsys,
        "eval",
        "linear",
        str(run),
        "--data",
        str(tiny_data),
        "--epochs",
        "3",
        "--head",
        str(head),
        "--output",
        str(tmp_path / "probe.json"),
    )
    probe = json.loads((tmp_path / "probe.json").read_text())
    tensors, record = load_head(head)
    assert record["kind"] == "linear" and record["image_size"] == 32
    assert record["classifier"] == probe["best"]["name"] and record["classes"] == probe["classes"]
    assert record["backbone"]["which"] == "teacher" and len(record["backbone"]["fingerprint"]) == 64
    out = _cli(
        capsys,
        "predict",
        str(run),
        str(head),
        str(tiny_data / "val"),
        "-o",
        str(tmp_path / "p.csv"),
    )
    assert "classes and scores of 20 images (0 unreadable)" in out
    rows = list(csv.DictReader(open(tmp_path / "p.csv")))
    source = open_source(tiny_data / "val")
    assert [r["path"] for r in rows] == [source.describe(i) for i in range(len(source))]
    labels = source.labels().tolist()
    top1 = 100.0 * np.mean(
        [probe["classes"].index(r["class"]) == y for r, y in zip(rows, labels, strict=True)]
    )
    assert top1 == pytest.approx(probe["best"]["val_top1"], abs=1e-9)  # the probe's own figure
    # the classes are the saved classifier's argmax over the probe's features
    probe_net = ProbeFeatures(open_backbone(run).net, record["n_blocks"])
    feats, _ = extract_features(probe_net, tiny_data / "val", image_size=32, normalize=False)
    logits = feats @ tensors["weight"] + tensors["bias"]
    assert [r["class"] for r in rows] == [probe["classes"][k] for k in logits.argmax(1).tolist()]
    assert all(abs(sum(float(r[c]) for c in probe["classes"]) - 1) < 1e-4 for r in rows)


def test_a_saved_dense_head_gives_the_probes_masks(run, tiny_data, tmp_path, capsys):
    head = tmp_path / "dense.safetensors"
    _cli(
        capsys,
        "eval",
        "dense",
        str(run),
        "--data",
        str(tiny_data),
        "--epochs",
        "2",
        "--head",
        str(head),
        "--output",
        str(tmp_path / "probe.json"),
    )
    probe = json.loads((tmp_path / "probe.json").read_text())
    val = segmentation_splits(tiny_data)["val"]
    out = _cli(
        capsys, "predict", str(run), str(head), str(val.images_dir), "-o", str(tmp_path / "masks")
    )
    assert f"masks of {len(val)} images" in out
    tensors, record = load_head(head)
    dense = DenseLinearHead(record["in_dim"], record["num_classes"])
    dense.load_state_dict(tensors)
    feats, truth = extract_dense_features(open_backbone(run).net, val, 32)
    with torch.no_grad():
        want = dense.eval()(feats, (32, 32)).argmax(1)
    names = [Path(image).stem for image, _ in val.pairs]  # the probe's order
    got = torch.stack(
        [torch.from_numpy(np.array(Image.open(tmp_path / "masks" / f"{n}.png"))) for n in names]
    ).long()
    assert got.shape == want.shape and (got == want).float().mean() > 0.999
    accuracy = 100.0 * (got == truth).float().mean().item()
    assert accuracy == pytest.approx(probe["val"]["pixel_acc"], abs=0.1)


def test_a_head_refuses_other_weights(run, tiny_data, tmp_path, capsys):
    head = tmp_path / "linear.safetensors"
    _cli(
        capsys,
        "eval",
        "linear",
        str(run),
        "--data",
        str(tiny_data),
        "--epochs",
        "1",
        "--head",
        str(head),
    )
    with pytest.raises(SystemExit) as e:
        main(
            [
                "predict",
                str(run),
                str(head),
                str(tiny_data / "val"),
                "-o",
                str(tmp_path / "p.csv"),
                "--which",
                "student",
                "--device",
                "cpu",
            ]
        )
    err = capsys.readouterr().err
    assert e.value.code == 2 and "holds other weights (their fingerprints differ)" in err
    (tmp_path / "not_a_head.safetensors").write_bytes(b"nonsense")
    with pytest.raises(SystemExit) as e:
        main(
            [
                "predict",
                str(run),
                str(tmp_path / "not_a_head.safetensors"),
                str(tiny_data / "val"),
                "-o",
                str(tmp_path / "p.csv"),
            ]
        )
    assert e.value.code == 2 and "not a readable safetensors file" in capsys.readouterr().err
