"""The built-in data set: determinism, layout, manifest, cache reuse and
regeneration, safety of the root, and what the images hold."""

import json
import os
from pathlib import Path

import numpy as np
import pytest
from dino_opt.data import BUILTIN_CLASSES, BUILTIN_DOMAINS, builtin_dataset, render_image
from dino_opt.data import builtin as datasets
from dino_opt.data.builtin import SECOND_CLASSES
from PIL import Image

SMALL = dict(train_per_class=2, val_per_class=1, test_per_class=1, image_size=48)


def tree_bytes(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


@pytest.fixture(scope="module")
def small_root(tmp_path_factory) -> Path:
    return builtin_dataset(tmp_path_factory.mktemp("ds") / "builtin", num_workers=0, **SMALL)


def test_same_seed_gives_identical_bytes_whatever_the_workers(tmp_path, small_root, monkeypatch):
    monkeypatch.setattr(datasets, "_TASK_IMAGES", 1)  # many small tasks across 2 processes
    other = builtin_dataset(tmp_path / "other", num_workers=2, **SMALL)
    a, b = tree_bytes(small_root), tree_bytes(other)
    assert a.keys() == b.keys()
    assert all(a[k] == b[k] for k in a), [k for k in a if a[k] != b[k]]


def test_different_seeds_differ(tmp_path, small_root):
    other = builtin_dataset(tmp_path / "seed1", seed=1, num_workers=0, **SMALL)
    a, b = tree_bytes(small_root), tree_bytes(other)
    images = [k for k in a if k.endswith(".jpg")]
    assert a.keys() == b.keys()
    assert all(a[k] != b[k] for k in images)


def test_layout_manifest_and_images(small_root):
    assert list(BUILTIN_CLASSES) == sorted(BUILTIN_CLASSES)  # index = ImageFolder label
    assert len(set(BUILTIN_CLASSES)) == len(BUILTIN_CLASSES) >= 10
    manifest = json.loads((small_root / "manifest.json").read_text())
    assert manifest["version"] == datasets.BUILTIN_VERSION
    assert manifest["seed"] == 0
    assert manifest["image_size"] == 48
    assert manifest["classes"] == list(BUILTIN_CLASSES)
    n = len(BUILTIN_CLASSES)
    assert manifest["counts"] == {"train": 2 * n, "val": n, "test": n}
    assert sorted(p.name for p in small_root.iterdir()) == [
        "manifest.json",
        "masks",
        "test",
        "train",
        "val",
    ]
    for split, per_class in (("train", 2), ("val", 1), ("test", 1)):
        assert sorted(p.name for p in (small_root / split).iterdir()) == list(BUILTIN_CLASSES)
        for name in BUILTIN_CLASSES:
            files = sorted((small_root / split / name).iterdir())
            assert len(files) == per_class
            for f in files:
                assert f.suffix == ".jpg"
                with Image.open(f) as im:
                    assert im.format == "JPEG"
                    assert im.mode == "RGB"
                    assert im.size == (48, 48)
                    im.load()
    # train, val and test are different images (held out, from other seeds, not copies)
    train, val, test = (
        {f.read_bytes() for f in (small_root / split).rglob("*.jpg")}
        for split in ("train", "val", "test")
    )
    assert not train & val and not train & test and not val & test


def test_no_test_split_when_asked_for_none(tmp_path):
    root = builtin_dataset(tmp_path / "ds", num_workers=0, **{**SMALL, "test_per_class": 0})
    assert not (root / "test").exists()
    assert json.loads((root / "manifest.json").read_text())["counts"]["test"] == 0
    assert builtin_dataset(root, num_workers=0, **{**SMALL, "test_per_class": 0}) == root


def test_reused_when_parameters_match(small_root):
    probe = small_root / "train" / "circle" / "circle_00000.jpg"
    before = probe.stat()
    assert builtin_dataset(small_root, num_workers=0, **SMALL) == small_root
    after = probe.stat()
    assert (before.st_ino, before.st_mtime_ns) == (after.st_ino, after.st_mtime_ns)


def test_regenerated_when_parameters_change(tmp_path):
    root = builtin_dataset(tmp_path / "ds", num_workers=0, **SMALL)
    builtin_dataset(root, num_workers=0, **{**SMALL, "image_size": 32, "val_per_class": 2})
    manifest = json.loads((root / "manifest.json").read_text())
    assert (manifest["image_size"], manifest["val_per_class"]) == (32, 2)
    with Image.open(root / "val" / "star" / "star_00001.jpg") as im:
        assert im.size == (32, 32)
    assert len(list((root / "val" / "star").iterdir())) == 2
    # the old tree and the temporary one are gone
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds"]


def test_regenerated_when_incomplete_or_version_differs(tmp_path):
    root = builtin_dataset(tmp_path / "ds", num_workers=0, **SMALL)
    reference = tree_bytes(root)
    (root / "val" / "dots" / "dots_00000.jpg").unlink()
    builtin_dataset(root, num_workers=0, **SMALL)
    assert tree_bytes(root) == reference

    manifest = json.loads((root / "manifest.json").read_text())
    manifest["version"] = 0
    (root / "manifest.json").write_text(json.dumps(manifest))
    (root / "train" / "ring" / "stale.jpg").write_bytes(b"old")
    builtin_dataset(root, num_workers=0, **SMALL)
    assert tree_bytes(root) == reference


def test_never_overwrites_a_foreign_directory(tmp_path):
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "thesis.txt").write_text("precious")
    with pytest.raises(FileExistsError, match="mine"):
        builtin_dataset(foreign, num_workers=0, **SMALL)
    assert (foreign / "thesis.txt").read_text() == "precious"
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(FileExistsError, match="is a file"):
        builtin_dataset(a_file, num_workers=0, **SMALL)
    # an empty directory is fine
    empty = tmp_path / "empty"
    empty.mkdir()
    assert (builtin_dataset(empty, num_workers=0, **SMALL) / "manifest.json").is_file()


def test_default_root(monkeypatch, tmp_path):
    monkeypatch.setenv("DINO_OPT_DATA", str(tmp_path / "here"))
    assert datasets.default_root() == tmp_path / "here"
    monkeypatch.delenv("DINO_OPT_DATA")
    monkeypatch.setenv("HOME", str(tmp_path))
    expected = tmp_path / ".cache" / "dino_opt" / f"builtin-v{datasets.BUILTIN_VERSION}"
    assert datasets.default_root() == expected


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(train_per_class=0), "train_per_class"),
        (dict(val_per_class=-1), "val_per_class"),
        (dict(image_size=8), "image_size"),
        (dict(image_size=64.0), "image_size"),
        (dict(seed=-1), "seed"),
        (dict(num_workers=-2), "num_workers"),
    ],
)
def test_bad_arguments_name_themselves(tmp_path, kwargs, name):
    with pytest.raises(ValueError, match=name):
        builtin_dataset(tmp_path / "ds", **kwargs)
    assert not (tmp_path / "ds").exists()


def test_polygon_sdf():
    square = np.array([(-1.0, -1.0), (1.0, -1.0), (1.0, 1.0), (-1.0, 1.0)])
    px = np.array([0.0, 0.5, 3.0, 2.0, 1.0])
    py = np.array([0.0, 0.0, 0.0, 2.0, 0.0])
    d = datasets._polygon_sdf(px, py, square)
    np.testing.assert_allclose(d, [-1.0, -0.5, 2.0, np.sqrt(2.0), 0.0], atol=1e-12)
    star = datasets._star(5, 1.0, 0.4)
    # the centre and a tip's inner part are inside; the notch between tips is outside
    tip, notch = np.pi / 2, np.pi / 2 + np.pi / 5
    pts_x = np.array([0.0, 0.8 * np.cos(tip), 0.7 * np.cos(notch)])
    pts_y = np.array([0.0, 0.8 * np.sin(tip), 0.7 * np.sin(notch)])
    assert list(datasets._polygon_sdf(pts_x, pts_y, star) < 0) == [True, True, False]


@pytest.mark.parametrize("domain", ["default", "second"])
def test_images_hold_a_visible_class_and_colour_is_not_the_class(domain):
    """Every image has ink that differs from a smooth background, and a
    nearest-centroid classifier on mean colour is near chance: colour is a
    nuisance, not the label (in both domains)."""
    rng = np.random.default_rng(0)
    n, size = 24, 40
    means, labels = [], []
    for label, name in enumerate(BUILTIN_DOMAINS[domain]):
        for i in range(n):
            img = render_image(name, np.random.default_rng([7, label, i]), size).astype(float)
            # ink: strong local edges somewhere (backgrounds are smooth, noise is small)
            across = np.abs(np.diff(img, axis=1)).max(axis=2)
            down = np.abs(np.diff(img, axis=0)).max(axis=2)  # horizontal stripes
            assert (across > 60).sum() + (down > 60).sum() >= 4, (name, i)
            means.append(img.mean(axis=(0, 1)))
            labels.append(label)
    means, labels = np.array(means), np.array(labels)
    order = rng.permutation(len(labels))
    train, test = order[: len(order) // 2], order[len(order) // 2 :]
    centroids = np.stack([means[train][labels[train] == c].mean(0) for c in range(10)])
    pred = np.argmin(((means[test][:, None] - centroids[None]) ** 2).sum(-1), axis=1)
    assert (pred == labels[test]).mean() < 0.3


def test_render_rejects_unknown_class():
    with pytest.raises(ValueError, match="heptagon"):
        render_image("heptagon", np.random.default_rng(0), 32)


def test_the_second_domain_has_its_own_classes_and_masks(tmp_path):
    root = builtin_dataset(
        tmp_path / "second",
        train_per_class=1,
        val_per_class=1,
        test_per_class=0,
        image_size=32,
        domain="second",
    )
    manifest = json.loads((root / "manifest.json").read_text())
    assert manifest["domain"] == "second" and manifest["classes"] == list(SECOND_CLASSES)
    assert manifest["mask_classes"] == ["background", *SECOND_CLASSES]
    assert sorted(p.name for p in (root / "train").iterdir()) == list(SECOND_CLASSES)
    assert not set(SECOND_CLASSES) & set(BUILTIN_CLASSES)
    for label, name in enumerate(SECOND_CLASSES, start=1):
        mask = np.array(Image.open(root / "masks" / "val" / name / f"{name}_00000.png"))
        assert set(np.unique(mask)) <= {0, label} and (mask == label).any()
    assert (
        builtin_dataset(
            tmp_path / "second",
            train_per_class=1,
            val_per_class=1,
            test_per_class=0,
            image_size=32,
            domain="second",
        )
        == root
    )  # reused
    with pytest.raises(ValueError, match="domain must be one of default, second"):
        builtin_dataset(tmp_path / "x", domain="third")


def test_no_leftovers_after_a_failed_generation(tmp_path, monkeypatch):
    def boom(task):
        raise RuntimeError("disk full")

    monkeypatch.setattr(datasets, "_write_images", boom)
    with pytest.raises(RuntimeError, match="disk full"):
        builtin_dataset(tmp_path / "ds", num_workers=0, **SMALL)
    assert os.listdir(tmp_path) == []
