"""`dino-opt embed` and dino_opt.eval.embed_images: every image's class token,
mean patch token and patch map with its path, equal to extract_features's
features, in every file type; unreadable images named and left out;
sharded over two processes as in one."""

import json
import shutil

import numpy as np
import pytest
import torch
import torchvision
from dino_opt.cli import main
from dino_opt.data import open_source
from dino_opt.eval import embed_images, extract_features, write_embeddings
from dino_opt.weights import open_backbone
from forked import run_cli
from safetensors import safe_open
from tiny import ranks_env


@pytest.fixture(scope="module")
def unlabelled(tiny_data, tmp_path_factory):
    """Six images in one folder (no class folders) and a file that is not one."""
    root = tmp_path_factory.mktemp("flat")
    for i, path in enumerate(sorted((tiny_data / "train").rglob("*.jpg"))[:6]):
        shutil.copy(path, root / f"{i}.jpg")
    (root / "3b.jpg").write_bytes(b"not an image at all")
    return root


def _embed(capsys, *args: str) -> tuple[str, str]:
    capsys.readouterr()
    assert main(["embed", *args, "--device", "cpu"]) == 0
    out = capsys.readouterr()
    return out.out, out.err


def test_embeddings_are_extract_features_with_their_paths(run, tiny_data, tmp_path, capsys):
    out, _ = _embed(
        capsys, str(run), str(tiny_data / "train"), "-o", str(tmp_path / "e.npy"), "--patch-maps"
    )
    assert "embedded 20 images (192 features each, at 32 px)" in out and "0 unreadable" in out
    opened = open_backbone(run)
    feats, _ = extract_features(opened.net, tiny_data / "train", image_size=32, normalize=False)
    cls = np.load(tmp_path / "e.npy")
    np.testing.assert_array_equal(cls, feats.numpy())
    source = open_source(tiny_data / "train")
    names = json.loads((tmp_path / "e.paths.json").read_text())
    assert names == [source.describe(i) for i in range(len(source))]
    patches = np.load(tmp_path / "e.patches.npy")
    assert patches.shape == (20, 192, 4, 4)  # 32 px at patch 8
    mean_patch = np.load(tmp_path / "e.mean_patch.npy")
    np.testing.assert_allclose(patches.mean(axis=(2, 3)), mean_patch, rtol=1e-5, atol=1e-6)
    meta = json.loads((tmp_path / "e.json").read_text())
    assert meta["image_size"] == 32 and meta["images"] == 20 and meta["failed"] == 0
    sides = ["mean_patch.npy", "patches.npy", "paths.json", "json"]
    assert meta["files"] == ["e.npy", *(f"e.{side}" for side in sides)]


def test_every_file_type_holds_the_same_rows(run, unlabelled, tmp_path):
    emb = embed_images(open_backbone(run).net, unlabelled, 32, batch_size=4)
    assert len(emb.names) == 6 and emb.patches is None
    write_embeddings(emb, tmp_path / "e.npz", {"k": 1})
    write_embeddings(emb, tmp_path / "e.safetensors", {"k": 1})
    write_embeddings(emb, tmp_path / "e.parquet", {"k": 1})
    npz = np.load(tmp_path / "e.npz")
    assert list(npz["paths"]) == emb.names and json.loads(str(npz["meta"])) == {"k": 1}
    np.testing.assert_array_equal(npz["cls"], emb.cls.numpy())
    with safe_open(str(tmp_path / "e.safetensors"), "pt") as f:
        assert json.loads(f.metadata()["paths"]) == emb.names
        torch.testing.assert_close(f.get_tensor("mean_patch"), emb.mean_patch, rtol=0, atol=0)
    pq = pytest.importorskip("pyarrow.parquet")
    table = pq.read_table(tmp_path / "e.parquet")
    assert table.column("path").to_pylist() == emb.names
    np.testing.assert_array_equal(np.array(table.column("cls").to_pylist()), emb.cls.numpy())
    with_maps = embed_images(open_backbone(run).net, unlabelled, 32, patch_maps=True)
    with pytest.raises(ValueError, match="Parquet holds the class and mean patch tokens"):
        write_embeddings(with_maps, tmp_path / "m.parquet")
    with pytest.raises(ValueError, match=r"the file type must be one of \.npy"):
        write_embeddings(emb, tmp_path / "e.csv")


def test_an_unreadable_image_is_named_and_the_rest_embedded(run, unlabelled, tmp_path, capsys):
    out, err = _embed(capsys, str(run), str(unlabelled), "-o", str(tmp_path / "e.npy"))
    assert "embedded 6 images" in out and "1 unreadable" in out
    lines = [x for x in err.splitlines() if x.startswith("unreadable: ")]  # the rest: the bar
    assert len(lines) == 1 and lines[0].startswith(f"unreadable: {unlabelled / '3b.jpg'}: ")
    names = json.loads((tmp_path / "e.paths.json").read_text())
    assert names == [str(unlabelled / f"{i}.jpg") for i in range(6)]
    # each row is that image's alone: the same as embedding the readable ones by themselves
    readable = tmp_path / "readable"
    readable.mkdir()
    for i in range(6):
        shutil.copy(unlabelled / f"{i}.jpg", readable / f"{i}.jpg")
    alone = embed_images(open_backbone(run).net, readable, 32)
    np.testing.assert_array_equal(np.load(tmp_path / "e.npy"), alone.cls.numpy())


def test_two_processes_embed_as_one(run, unlabelled, tmp_path):
    one = embed_images(open_backbone(run).net, unlabelled, 32)
    done = run_cli(
        [
            "embed",
            str(run),
            str(unlabelled),
            "-o",
            str(tmp_path / "e.safetensors"),
            "--nproc",
            "2",
            "--device",
            "cpu",
            "--batch-size",
            "2",
        ],
        ranks_env(),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "embedded 6 images" in done.stdout and "1 unreadable" in done.stdout
    with safe_open(str(tmp_path / "e.safetensors"), "pt") as f:
        assert json.loads(f.metadata()["paths"]) == one.names
        torch.testing.assert_close(f.get_tensor("cls"), one.cls, rtol=1e-5, atol=1e-6)


def test_a_network_without_tokens_gives_its_pooled_feature(unlabelled):
    net = torchvision.models.resnet18(weights=None, num_classes=8).eval()
    emb = embed_images(net, unlabelled, 32, batch_size=4)
    assert emb.cls.shape == (6, 8) and emb.mean_patch is None
    with pytest.raises(ValueError, match="patch maps need a ViT's patch tokens; ResNet has none"):
        embed_images(net, unlabelled, 32, patch_maps=True)


def test_bad_arguments_are_one_line(run, unlabelled, tmp_path, capsys):
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(["embed", str(run), str(unlabelled), "-o", str(tmp_path / "e.csv")])
    assert e.value.code == 2 and "the file type must be one of .npy" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["embed", str(run), str(tmp_path / "missing"), "-o", str(tmp_path / "e.npy")])
    assert e.value.code == 2 and "missing" in capsys.readouterr().err
