"""Per-pixel labels of the built-in data set and the segmentation data source:
masks that agree with the images, images unchanged since version 2, the two
layouts of a segmentation root, and bad input in one line."""

import json
from pathlib import Path

import numpy as np
import pytest
from dino_opt.data import builtin, open_source
from dino_opt.data.builtin import (
    BUILTIN_CLASSES,
    BUILTIN_MASK_CLASSES,
    builtin_dataset,
    render_image,
    render_image_and_mask,
)
from dino_opt.data.segmentation import SegmentationSource, segmentation_splits
from PIL import Image

SMALL = dict(train_per_class=2, val_per_class=1, test_per_class=1, image_size=48)
GOLDEN = Path(__file__).parent / "data" / "builtin_v2_images.npz"


@pytest.fixture(scope="module")
def small_root(tmp_path_factory) -> Path:
    return builtin_dataset(tmp_path_factory.mktemp("seg") / "builtin", num_workers=0, **SMALL)


# ---------------------------------------------------------------- built-in masks


def torch_seed(gen) -> int:
    """A numpy seed drawn from the test's printed torch seed."""
    return int(gen.initial_seed()) % (2**31)


def test_images_are_those_of_version_2():
    """Renderings made with the version-2 generator (before masks existed),
    stored at six (seed, split, class, index, size): the images are the same."""
    golden = np.load(GOLDEN)
    for i, case in enumerate(golden["cases"]):
        seed, split, label, index, size = (int(v) for v in case)
        rng = builtin._image_rng(seed, split, label, index)
        image = render_image(BUILTIN_CLASSES[label], rng, size)
        expected = golden[f"image{i}"]
        diff = np.abs(image.astype(int) - expected.astype(int))
        # bit-identical here; one level on a few pixels allowed for another CPU's float rounding
        assert diff.max() <= 1 and (diff > 0).mean() < 1e-3, (case, diff.max())
    assert builtin.BUILTIN_VERSION == 3


def test_mask_does_not_change_the_image(gen):
    seed = torch_seed(gen)
    for name in BUILTIN_CLASSES:
        a = render_image(name, np.random.default_rng(seed), 40)
        b, mask = render_image_and_mask(name, np.random.default_rng(seed), 40)
        assert np.array_equal(a, b)
        assert mask.shape == (40, 40) and mask.dtype == np.uint8


def _deviation_from_background(name: str, seed: int, size: int):
    """The image, its mask, and each pixel's largest channel difference
    from the image's background (drawn first from the same stream)."""
    image, mask = render_image_and_mask(name, np.random.default_rng(seed), size)
    background = builtin._colour_field(np.random.default_rng(seed), size) * 255.0
    return mask, np.abs(image.astype(float) - background).max(-1)


def test_mask_agrees_with_the_drawn_shapes(gen):
    """Where the mask says an instance is, the image differs from its
    background (ink is light or dark, the background mid-grey); elsewhere
    only noise. The same check on the mask shifted by 3 px agrees clearly less."""
    seed = torch_seed(gen)
    agree, agree_shifted = [], []
    for k, name in enumerate(n for n in BUILTIN_CLASSES if n in builtin._SHAPES):
        mask, dev = _deviation_from_background(name, seed + k, 64)
        label = 1 + BUILTIN_CLASSES.index(name)
        assert set(np.unique(mask)) == {0, label}
        drawn = dev > 40
        agree.append((drawn == (mask > 0)).mean())
        agree_shifted.append((drawn == np.roll(mask > 0, 3, axis=1)).mean())
    assert np.mean(agree) > 0.95, agree
    assert np.mean(agree_shifted) < np.mean(agree) - 0.04, (agree, agree_shifted)


def test_texture_masks_cover_the_frame(gen):
    for name in ("stripes", "checkerboard", "dots", "waves"):
        _, mask = render_image_and_mask(name, np.random.default_rng(torch_seed(gen)), 32)
        assert (mask == 1 + BUILTIN_CLASSES.index(name)).all()


def test_builtin_tree_has_masks_beside_the_images(small_root):
    manifest = json.loads((small_root / "manifest.json").read_text())
    assert manifest["version"] == 3
    assert (
        manifest["mask_classes"] == list(BUILTIN_MASK_CLASSES) == ["background", *BUILTIN_CLASSES]
    )
    for split in ("train", "val", "test"):
        images = sorted((small_root / split).rglob("*.jpg"))
        masks = sorted((small_root / "masks" / split).rglob("*.png"))
        assert [p.relative_to(small_root / split).with_suffix("") for p in images] == [
            p.relative_to(small_root / "masks" / split).with_suffix("") for p in masks
        ]
        for image, mask in zip(images, masks, strict=True):
            with Image.open(mask) as m, Image.open(image) as im:
                assert m.mode == "L" and m.size == im.size == (48, 48)
                values = set(np.unique(np.asarray(m)))
            label = 1 + BUILTIN_CLASSES.index(image.parent.name)
            assert values <= {0, label} and label in values


def test_image_folders_see_no_masks(small_root):
    """The training loader and the k-NN read <root>/train as an ImageFolder:
    the masks are not in it."""
    source = open_source(small_root / "train")
    assert list(source.classes) == list(BUILTIN_CLASSES)
    assert len(source) == 2 * len(BUILTIN_CLASSES)
    assert not list((small_root / "train").rglob("*.png"))


def test_builtin_root_as_segmentation_splits(small_root):
    splits = segmentation_splits(small_root)
    assert set(splits) == {"train", "val", "test"}
    train = splits["train"]
    assert train.classes == list(BUILTIN_MASK_CLASSES) and train.num_classes == 11
    assert len(train) == 20 and len(splits["val"]) == 10
    image, mask = train.read(0)
    assert image.size == (48, 48) and mask.shape == (48, 48)
    # the k-NN's plain image root has no masks
    assert segmentation_splits(small_root / "train") is None


# ---------------------------------------------------------------- the source


def _pair(images: Path, masks: Path, stem: str, size=(12, 10), mask_size=None, value=1):
    (images / stem).parent.mkdir(parents=True, exist_ok=True)
    (masks / stem).parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, (90, 20, 200)).save(images / f"{stem}.jpg")
    mask = np.full(mask_size or size, value, dtype=np.uint8).T
    Image.fromarray(mask).save(masks / f"{stem}.png")


def _layout(root: Path, classes=("sky", "road", "car")) -> Path:
    for split, n in (("train", 3), ("val", 2)):
        for i in range(n):
            _pair(root / split / "images", root / split / "masks", f"d{i % 2}/im{i}", value=i % 3)
    if classes is not None:
        (root / "classes.txt").write_text("\n".join(classes) + "\n")
    return root


def test_generic_layout(tmp_path):
    root = _layout(tmp_path / "seg")
    splits = segmentation_splits(root)
    assert set(splits) == {"train", "val"}
    train = splits["train"]
    assert train.classes == ["sky", "road", "car"] and len(train) == 3
    assert [p[0].name for p in train.pairs] == ["im0.jpg", "im2.jpg", "im1.jpg"]
    image, mask = train.read(2)
    assert image.mode == "RGB" and mask.dtype == np.uint8 and (mask == 1).all()


def test_no_masks_means_none(tmp_path):
    (tmp_path / "plain" / "train" / "cat").mkdir(parents=True)
    assert segmentation_splits(tmp_path / "plain") is None
    assert segmentation_splits(tmp_path / "missing") is None


def test_missing_mask_is_named(tmp_path):
    root = _layout(tmp_path / "seg")
    (root / "val" / "masks" / "d1" / "im1.png").unlink()
    with pytest.raises(ValueError, match=r"im1\.jpg' has no mask: expected .*d1/im1'\.png"):
        segmentation_splits(root)


def test_mask_without_image_is_named(tmp_path):
    root = _layout(tmp_path / "seg")
    (root / "train" / "images" / "d0" / "im0.jpg").unlink()
    with pytest.raises(ValueError, match=r"mask '.*im0\.png' has no image"):
        segmentation_splits(root)


def test_size_mismatch_names_both_files(tmp_path):
    images, masks = tmp_path / "images", tmp_path / "masks"
    _pair(images, masks, "a", size=(12, 10), mask_size=(12, 9))
    source = SegmentationSource(images, masks, num_classes=2)
    with pytest.raises(
        ValueError, match=r"mask '.*a\.png' is 12x9 but its image '.*a\.jpg' is 12x10"
    ):
        source.read(0)


def test_label_out_of_range_names_file_and_value(tmp_path):
    images, masks = tmp_path / "images", tmp_path / "masks"
    _pair(images, masks, "a", value=7)
    _pair(images, masks, "b", value=255)  # ignore: allowed
    source = SegmentationSource(images, masks, classes=["x", "y", "z"])
    source.read(1)
    with pytest.raises(
        ValueError, match=r"mask '.*a\.png' holds label 7, out of range: labels are 0\.\.2"
    ):
        source.read(0)


def test_empty_and_missing_folders(tmp_path):
    (tmp_path / "images").mkdir()
    (tmp_path / "masks").mkdir()
    with pytest.raises(ValueError, match=r"images folder '.*images' holds no images"):
        SegmentationSource(tmp_path / "images", tmp_path / "masks")
    with pytest.raises(FileNotFoundError, match=r"masks folder '.*nowhere' does not exist"):
        SegmentationSource(tmp_path / "images", tmp_path / "nowhere")


def test_classes_differ_between_splits(tmp_path):
    root = _layout(tmp_path / "seg", classes=None)
    (root / "train" / "classes.txt").write_text("sky\nroad\ncar\n")
    (root / "val" / "classes.txt").write_text("sky\nroad\nbus\n")
    with pytest.raises(
        ValueError, match=r"classes differ between splits of .*: train has .*car.*, val has .*bus"
    ):
        segmentation_splits(root)


def test_rgb_mask_is_refused(tmp_path):
    images, masks = tmp_path / "images", tmp_path / "masks"
    _pair(images, masks, "a")
    Image.new("RGB", (12, 10)).save(masks / "a.png")
    with pytest.raises(ValueError, match=r"mask '.*a\.png' has mode 'RGB'"):
        SegmentationSource(images, masks).read(0)
