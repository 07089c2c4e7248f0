"""Evaluation features through the native loader: its centre crop against
the PIL evaluation transform, order and labels of every source kind, sharded
extraction on two gloo ranks against one process, and one-line errors."""

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from dino_opt import _C
from dino_opt.data import open_source, write_shards
from dino_opt.eval.features import EvalImageFolder, EvalLoader, extract_features
from dino_opt.eval.knn import extract_features as knn_extract_features
from gloo_ranks import launch_ranks
from PIL import Image

CLASSES = ("ant", "bee", "cat")
WORKER = Path(__file__).parent / "workers" / "dist_eval_features_worker.py"


def random_images(root: Path, gen: torch.Generator, per_class: int, suffix: str) -> Path:
    """Random pixels of random sizes (portrait, landscape, square), any mode."""
    for name in CLASSES:
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            h, w = (int(v) for v in torch.randint(17, 97, (2,), generator=gen))
            if i == 0:
                w = h  # a square one
            pixels = torch.randint(0, 256, (h, w, 3), generator=gen, dtype=torch.uint8).numpy()
            image = Image.fromarray(pixels)
            if suffix == ".png" and i % 3 == 2:
                image = image.convert("RGBA")
            image.save(
                root / name / f"{i}{suffix}", **({"quality": 90} if suffix == ".jpg" else {})
            )
    return root


@pytest.fixture(scope="module")
def module_gen():
    seed = int.from_bytes(np.random.default_rng().bytes(4), "little")
    print(f"module seed={seed}")
    return torch.Generator().manual_seed(seed)


@pytest.fixture(scope="module")
def png_folder(tmp_path_factory, module_gen) -> Path:
    return random_images(tmp_path_factory.mktemp("png") / "train", module_gen, 7, ".png")


@pytest.fixture(scope="module")
def jpg_folder(tmp_path_factory, module_gen) -> Path:
    return random_images(tmp_path_factory.mktemp("jpg") / "train", module_gen, 7, ".jpg")


@pytest.fixture(scope="module")
def jpg_list(jpg_folder) -> Path:
    lines = ["path,label"] + [
        f"{p.relative_to(jpg_folder.parent).as_posix()},{p.parent.name}"
        for p in sorted(jpg_folder.rglob("*.jpg"), reverse=True)  # not the folder's order
    ]
    path = jpg_folder.parent / "train.csv"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def jpg_shards(jpg_folder, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("shards") / "train"
    result = write_shards(jpg_folder, out, shard_size_mb=0.02, progress=False)
    assert result["written"] == 21 and not result["failed"] and len(result["shards"]) >= 3
    return out


def native_all(spec, size: int, **kw) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    with EvalLoader(spec, size, batch_size=4, num_threads=2, **kw) as loader:
        batches = [(x.clone(), y.clone(), i.clone()) for x, y, i in loader]
    return tuple(torch.cat(parts) for parts in zip(*batches, strict=True))


def pil_all(spec, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    ds = EvalImageFolder(spec, size)
    return torch.stack([ds[i][0] for i in range(len(ds))]), torch.tensor(ds.targets)


# ---------------------------------------------------------------- the crops


def reference_crop(path: Path, size: int) -> torch.Tensor:
    """DINO's evaluation transform written out with PIL: shorter side to
    round(S * 256 / 224) (the longer one truncated), bicubic with PIL's
    anti-aliasing, horizontal pass then vertical pass (Pillow's order up to
    version 12; Pillow 13 may run the vertical pass first), the central S x S
    (offsets rounded half to even), ImageNet normalisation; float64."""
    with Image.open(path) as im:
        im = im.convert("RGB")
    w, h = im.size
    r = round(size * 256 / 224)
    nw, nh = (r, int(r * h / w)) if w <= h else (int(r * w / h), r)
    im = im.resize((nw, h), Image.Resampling.BICUBIC).resize((nw, nh), Image.Resampling.BICUBIC)
    left, top = round((nw - size) / 2), round((nh - size) / 2)
    x = torch.from_numpy(np.asarray(im.crop((left, top, left + size, top + size))).copy())
    mean = torch.tensor([0.485, 0.456, 0.406], dtype=torch.float64)
    std = torch.tensor([0.229, 0.224, 0.225], dtype=torch.float64)
    return ((x.double() / 255 - mean) / std).permute(2, 0, 1)


@pytest.mark.parametrize("size", [16, 24, 32])
def test_native_crops_equal_pil_resampling_on_png(png_folder, size):
    """Lossless images of random pixels (the hardest case for any rounding
    difference), so both sides see the same pixels: the crops agree with PIL's
    arithmetic to float32 rounding of the normalisation."""
    if not _C.other_formats_available():
        pytest.skip("this build reads no PNG (no OpenCV)")
    native, labels, indices = native_all(png_folder, size)
    ds = EvalImageFolder(png_folder, size)
    reference = torch.stack([reference_crop(Path(p), size) for p, _ in ds.samples])
    assert native.shape == (21, 3, size, size) and native.dtype == torch.float32
    assert indices.tolist() == list(range(21))
    assert labels.tolist() == ds.targets == [0] * 7 + [1] * 7 + [2] * 7
    diff = (native.double() - reference).abs().max().item()
    print(f"max |native - PIL two-pass| at {size} px: {diff:.2e}")
    assert diff < 1e-5  # one uint8 level would be 0.017
    # against EvalImageFolder (one resize call): equal where Pillow keeps the
    # horizontal-first order, otherwise a few levels on noise (printed)
    pil = torch.stack([ds[i][0] for i in range(len(ds))])
    per_image = (native - pil).abs().flatten(1).max(dim=1).values
    print(
        f"max |native - EvalImageFolder| at {size} px: {per_image.max().item():.2e}, "
        f"{int((per_image < 1e-5).sum())} of 21 images equal"
    )


def test_native_crops_near_eval_image_folder_on_smooth_images(jpg_folder, tmp_path):
    """Photograph-like images (gradients and mild noise), PNG: the native crop
    is within a uint8 level or two of EvalImageFolder whatever Pillow's order."""
    if not _C.other_formats_available():
        pytest.skip("this build reads no PNG (no OpenCV)")
    rng = np.random.default_rng(0)
    for c, name in enumerate(CLASSES):
        (tmp_path / name).mkdir()
        for i in range(5):
            h, w = (int(v) for v in rng.integers(40, 160, 2))
            y, x = np.mgrid[0:h, 0:w]
            img = np.stack([x * 255 / w, y * 255 / h, (x + y + 40 * c) % 256], -1)
            img = img + rng.normal(0, 6, (h, w, 3))
            Image.fromarray(img.clip(0, 255).astype(np.uint8)).save(tmp_path / name / f"{i}.png")
    native, _, _ = native_all(tmp_path, 32)
    pil, _ = pil_all(tmp_path, 32)
    level = 1 / 255 / 0.225  # one uint8 level after normalisation (the largest step)
    diff = (native - pil).abs().max().item()
    print(f"max |native - EvalImageFolder| on smooth PNGs: {diff:.2e} ({diff / level:.2f} levels)")
    assert diff < 3 * level


def test_native_crops_on_jpeg_match_pil_decoding(jpg_folder):
    """JPEG: libjpeg-turbo here, PIL's decoder there; the same crops as the
    PIL two-pass reference up to decoding differences (printed)."""
    native, _, _ = native_all(jpg_folder, 24)
    ds = EvalImageFolder(jpg_folder, 24)
    reference = torch.stack([reference_crop(Path(p), 24) for p, _ in ds.samples])
    level = 1 / 255 / 0.225
    diff = (native.double() - reference).abs()
    print(
        f"max |native - PIL two-pass| on JPEG: {diff.max().item():.2e}, "
        f"{(diff > 1e-5).double().mean().item():.2%} of values differ"
    )
    assert diff.max().item() < 3 * level


def two_pass_crop(path: Path, size: int, resize_to: int) -> torch.Tensor:
    """The evaluation crop by Pillow's bicubic passes, the horizontal one
    first (what the native loader computes, byte for byte), normalised."""
    with Image.open(path) as im:
        im = im.convert("RGB")
    w, h = im.size
    nw, nh = (resize_to, int(resize_to * h / w)) if w <= h else (int(resize_to * w / h), resize_to)
    im = im.resize((nw, h), Image.Resampling.BICUBIC).resize((nw, nh), Image.Resampling.BICUBIC)
    left, top = int(round((nw - size) / 2.0)), int(round((nh - size) / 2.0))
    x = torch.from_numpy(np.asarray(im.crop((left, top, left + size, top + size))).copy())
    mean, std = torch.tensor([0.485, 0.456, 0.406]), torch.tensor([0.229, 0.224, 0.225])
    return ((x.float() / 255 - mean) / std).permute(2, 0, 1)


def test_bfloat16_batches_and_resize_size(png_folder):
    # Pillow 13's one-call resize runs the vertical pass first for some
    # shapes (narrow portraits here): on noise, up to a dozen uint8 levels
    # from the two passes in Pillow's classic order, which the loader
    # computes; the exact check is against those, for every image.
    if not _C.other_formats_available():
        pytest.skip("this build reads no PNG (no OpenCV)")
    full, _, _ = native_all(png_folder, 16, resize_size=16)  # the whole shorter side
    half, _, _ = native_all(png_folder, 16, resize_size=16, dtype=torch.bfloat16)
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half.float(), full, atol=0.02, rtol=0.01)
    for i, (path, _) in enumerate(EvalImageFolder(png_folder, 16).samples):
        torch.testing.assert_close(full[i], two_pass_crop(Path(path), 16, 16), atol=1e-5, rtol=0)


# ---------------------------------------------------------------- sources and order


@pytest.mark.parametrize("kind", ["folder", "list", "shards"])
def test_every_source_in_its_order_with_its_labels(kind, jpg_folder, jpg_list, jpg_shards):
    spec = {"folder": jpg_folder, "list": jpg_list, "shards": jpg_shards}[kind]
    source = open_source(spec)
    images, labels, indices = native_all(source, 16)
    assert indices.tolist() == list(range(len(source)))
    assert labels.tolist() == source.labels().tolist()
    # the same images as the PIL transform of the same source, in its order
    pil, targets = pil_all(spec, 16)
    assert targets.tolist() == labels.tolist()
    assert torch.corrcoef(torch.stack([images.flatten(), pil.flatten()]))[0, 1] > 0.99


class TinyNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 6, 3, stride=2)
        self.drop = torch.nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(torch.tanh(self.conv(x)).mean(dim=(2, 3)))


def test_extract_features_from_a_source_equals_the_dataset_path(png_folder):
    if not _C.other_formats_available():
        pytest.skip("this build reads no PNG (no OpenCV)")
    torch.manual_seed(0)
    net = TinyNet().train()
    assert knn_extract_features is extract_features  # the old import keeps working
    feats, labels = extract_features(net, png_folder, batch_size=5, image_size=24)
    assert net.training
    ds = EvalImageFolder(png_folder, 24)
    crops = torch.stack([reference_crop(Path(p), 24) for p, _ in ds.samples]).float()
    reference = torch.utils.data.TensorDataset(crops, torch.tensor(ds.targets))
    ref, ref_labels = extract_features(net, reference, batch_size=5)
    assert labels.tolist() == ref_labels.tolist() == ds.targets
    torch.testing.assert_close(feats, ref, atol=1e-5, rtol=1e-5)
    raw, _ = extract_features(net, str(png_folder), image_size=24, normalize=False, num_workers=1)
    torch.testing.assert_close(torch.nn.functional.normalize(raw, dim=1), feats)


# ---------------------------------------------------------------- two ranks


@pytest.mark.parametrize("kind", ["folder", "shards"])
def test_two_gloo_ranks_give_the_features_of_one_process(kind, jpg_folder, jpg_shards, tmp_path):
    spec = {"folder": jpg_folder, "shards": jpg_shards}[kind]
    torch.manual_seed(1)
    net = TinyNet()
    torch.save(net.state_dict(), tmp_path / "net.pt")
    single, labels = extract_features(net, spec, image_size=24, batch_size=4)
    launch_ranks(
        WORKER, 2, lambda r: [str(tmp_path / "init"), str(tmp_path), str(spec)], timeout=300
    )
    # 21 images: rank 0 takes 11, rank 1 takes 10, no padding, nothing twice
    expected = {
        "folder": [list(range(0, 21, 2)), list(range(1, 21, 2))],  # strided
        "shards": [list(range(0, 11)), list(range(11, 21))],  # contiguous runs
    }[kind]
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got["shard"] == expected[rank]
        assert got["labels"].tolist() == labels.tolist()
        torch.testing.assert_close(got["features"], single, atol=1e-6, rtol=1e-6)


# ---------------------------------------------------------------- bad input


def test_bad_input_is_one_line(tmp_path, png_folder):
    flat = tmp_path / "flat"
    flat.mkdir()
    Image.new("RGB", (8, 8)).save(flat / "a.jpg")
    with pytest.raises(ValueError, match="without a label"):
        EvalLoader(flat, 16)
    with pytest.raises(FileNotFoundError):
        extract_features(TinyNet(), tmp_path / "missing", image_size=16)
    (tmp_path / "broken" / "a").mkdir(parents=True)
    Image.new("RGB", (8, 8)).save(tmp_path / "broken" / "a" / "good.jpg")
    (tmp_path / "broken" / "a" / "x.jpg").write_bytes(b"not a jpeg")
    with pytest.raises(ValueError, match=r"x\.jpg") as info:
        extract_features(TinyNet(), tmp_path / "broken", image_size=16)
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match=r"\[B, D\]"):
        extract_features(torch.nn.Identity(), png_folder, image_size=8)
    with pytest.raises(ValueError, match="image_size"):
        EvalLoader(png_folder, 0)
    with pytest.raises(ValueError, match="batch_size"):
        EvalLoader(png_folder, 16, batch_size=0)
    with pytest.raises(ValueError, match="resize_size"):
        EvalLoader(png_folder, 16, resize_size=8)
    with pytest.raises(ValueError, match="process group"):
        extract_features(TinyNet(), png_folder, image_size=16, distributed=True)
    with pytest.raises(ValueError, match="data source only"):
        extract_features(TinyNet(), EvalImageFolder(png_folder, 16), dct_scaling=True)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
