"""The native multi-crop loader: sampling statistics against torchvision,
resize against PIL, determinism, sharding, resume, bad input, shutdown."""

import gc
import io
import os
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision.transforms as T
from dino_opt import _C
from dino_opt.data import (
    DataLoadingOptimizer,
    LoaderError,
    MultiCropDataset,
    MultiCropLoader,
    find_images,
)
from dino_opt.data import loader as loader_module
from dino_opt.data.ahead import one_ahead
from PIL import Image

SMALL = dict(global_size=32, local_size=16, n_local=2)  # fast crops for behaviour tests


def natural_image(rng: np.random.Generator, height: int, width: int) -> np.ndarray:
    """Smooth colour fields, edges and a little texture: JPEG sizes and resize
    behaviour like a photograph's, unlike flat colour or white noise."""
    y, x = np.mgrid[0:height, 0:width] / max(height, width)
    img = np.zeros((height, width, 3))
    for c in range(3):
        fx, fy, phase = rng.uniform(1, 6), rng.uniform(1, 6), rng.uniform(0, 6.3)
        img[..., c] = 0.5 + 0.35 * np.sin(fx * 6.3 * x + phase) * np.cos(fy * 6.3 * y)
    for _ in range(4):
        cy, cx, r = rng.uniform(0, 1), rng.uniform(0, 1), rng.uniform(0.05, 0.3)
        img[(y - cy) ** 2 + (x - cx) ** 2 < r * r] = rng.uniform(0, 1, 3)
    img += rng.normal(0, 0.03, img.shape)
    return (np.clip(img, 0, 1) * 255).round().astype(np.uint8)


def save_jpeg(path: Path, array: np.ndarray, quality: int = 90, mode: str | None = None) -> Path:
    image = Image.fromarray(array)
    if mode:
        image = image.convert(mode)
    image.save(path, "JPEG", quality=quality)
    return path


@pytest.fixture(scope="module")
def image_folder(tmp_path_factory) -> Path:
    """3 classes x 6 JPEGs of 40..180 px."""
    root = tmp_path_factory.mktemp("folder")
    rng = np.random.default_rng(1)
    for c in range(3):
        (root / f"class{c}").mkdir()
        for i in range(6):
            h, w = rng.integers(40, 180, 2)
            save_jpeg(root / f"class{c}" / f"img{i}.jpg", natural_image(rng, h, w))
    return root


def all_batches(loader) -> list:
    return [(list(b.crops), b.labels.clone(), b.indices.clone()) for b in loader]


def assert_same_batches(a, b):
    assert len(a) == len(b)
    for (ca, la, ia), (cb, lb, ib) in zip(a, b, strict=True):
        assert torch.equal(ia, ib) and torch.equal(la, lb)
        for x, y in zip(ca, cb, strict=True):
            assert torch.equal(x, y)


def thread_count() -> int:
    return len(os.listdir("/proc/self/task"))


def threads_return_to(count: int) -> bool:
    """Whether the process is back to `count` threads within a generous
    bound (a thread that has been joined may linger in /proc for a moment)."""
    done = threading.Event()
    for _ in range(1000):
        if thread_count() <= count:
            return True
        done.wait(0.01)
    return False


# ---------------------------------------------------------------- sampling


def ks_statistic(a: np.ndarray, b: np.ndarray) -> float:
    """Two-sample Kolmogorov-Smirnov distance."""
    grid = np.sort(np.concatenate([a, b]))
    cdf_a = np.searchsorted(np.sort(a), grid, side="right") / len(a)
    cdf_b = np.searchsorted(np.sort(b), grid, side="right") / len(b)
    return float(np.abs(cdf_a - cdf_b).max())


@pytest.mark.parametrize("crop,scale", [(0, (0.4, 1.0)), (2, (0.05, 0.4))])
@pytest.mark.parametrize("height,width", [(300, 500), (640, 200)])
def test_crop_distribution_matches_torchvision(crop, scale, height, width):
    n = 10_000
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed={seed}")
    rects, _ = _C.sample_crops(seed, n, height, width)
    ours = rects[:, crop].numpy().astype(np.float64)
    torch.manual_seed(seed)
    image = torch.empty(3, height, width)
    ref = np.array(
        [T.RandomResizedCrop.get_params(image, scale, (3 / 4, 4 / 3)) for _ in range(n)],
        dtype=np.float64,
    )
    # Critical two-sample KS distance sqrt(-ln(alpha / 2) / 2) * sqrt(2 / n) with
    # alpha = 6e-6 per check: 16 checks per run (4 statistics x 4 cases) keep the
    # false-alarm rate of the whole test near 1e-4 (alpha = 0.001 per check failed
    # about one CI run in 60); a wrong sampler is off by far more than 0.036.
    critical = np.sqrt(-np.log(6e-6 / 2) / 2) * np.sqrt(2 / n)
    area = height * width
    for name, f in [
        ("area", lambda r: r[:, 2] * r[:, 3] / area),
        ("aspect", lambda r: np.log(r[:, 3] / r[:, 2])),
        ("top", lambda r: r[:, 0] / np.maximum(height - r[:, 2], 1)),
        ("left", lambda r: r[:, 1] / np.maximum(width - r[:, 3], 1)),
    ]:
        d = ks_statistic(f(ours), f(ref))
        assert d < critical, f"{name}: KS distance {d:.4f} >= {critical:.4f}"
    assert (ours[:, 0] >= 0).all() and (ours[:, 0] + ours[:, 2] <= height).all()
    assert (ours[:, 1] >= 0).all() and (ours[:, 1] + ours[:, 3] <= width).all()


def test_crop_fallback_for_extreme_aspect_ratio():
    # A 10000 x 3 image: no try fits, so torchvision's centre fallback applies.
    rects, _ = _C.sample_crops(0, 200, 3, 10000)
    r = rects[:, 0]
    assert (r[:, 2] >= 1).all() and (r[:, 2] <= 3).all()
    assert (r[:, 1] + r[:, 3] <= 10000).all()
    ref = T.RandomResizedCrop.get_params(torch.empty(3, 3, 10000), (0.4, 1.0), (3 / 4, 4 / 3))
    assert tuple(r[0].tolist()) == tuple(ref)


def within_binomial(hits: int, n: int, p: float) -> bool:
    if p in (0.0, 1.0):
        return hits == n * p
    return abs(hits / n - p) <= 5 * np.sqrt(p * (1 - p) / n)


def test_photometric_rates_follow_dino():
    n = 20_000
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed={seed}")
    _, params = _C.sample_crops(seed, n, 256, 256)
    p = params.numpy()
    blur = [1.0, 0.1] + [0.5] * 8
    solarize = [0.0, 0.2] + [0.0] * 8
    for crop in range(10):
        q = p[:, crop]
        assert within_binomial(int(q[:, 0].sum()), n, 0.5), f"flip rate, crop {crop}"
        assert within_binomial(int(q[:, 1].sum()), n, 0.8), f"jitter rate, crop {crop}"
        assert within_binomial(int(q[:, 10].sum()), n, 0.2), f"grayscale rate, crop {crop}"
        assert within_binomial(int((q[:, 11] > 0).sum()), n, blur[crop]), f"blur rate, crop {crop}"
        assert within_binomial(int(q[:, 12].sum()), n, solarize[crop]), f"solarize, crop {crop}"
        sigma = q[q[:, 11] > 0, 11]
        # drawn in double in [0.1, 2.0), kept as float32: the largest round to 2.0
        # (torchvision's random.uniform(0.1, 2.0) includes it too)
        assert sigma.min() >= 0.1 and sigma.max() <= 2.0
    jittered = p[:, 0][p[:, 0, 1] == 1]
    for col, lo, hi in [(2, 0.6, 1.4), (3, 0.6, 1.4), (4, 0.8, 1.2), (5, -0.1, 0.1)]:
        v = jittered[:, col]
        assert v.min() >= lo and v.max() <= hi
        assert abs(v.mean() - (lo + hi) / 2) < 5 * (hi - lo) / np.sqrt(12 * len(v))
    orders = {tuple(o) for o in jittered[:, 6:10].astype(int)}
    assert len(orders) == 24  # every order of ColorJitter's four ops occurs
    counts = np.unique(jittered[:, 6:10].astype(int), axis=0, return_counts=True)[1]
    assert within_binomial(int(counts.min()), len(jittered), 1 / 24) or counts.min() > 0


# ---------------------------------------------------------------- resize


@pytest.mark.parametrize(
    "box,size",
    [
        ((0, 0, 400, 300), (224, 224)),  # 1.8x down
        ((37, 21, 397, 281), (96, 96)),  # 3.75x down: anti-aliasing matters
        ((100, 50, 150, 90), (96, 96)),  # upscale
        ((5, 7, 229, 231), (224, 224)),  # same size: a copy
        ((0, 0, 400, 300), (61, 173)),  # mixed
    ],
)
def test_resize_matches_pil_bicubic(box, size):
    rng = np.random.default_rng(int.from_bytes(os.urandom(4), "little"))
    array = natural_image(rng, 300, 400)
    left, top, right, bottom = box
    ours = _C.resize_crop(torch.from_numpy(array), top, left, bottom - top, right - left, *size)
    ours = ours.numpy()
    ref = np.asarray(Image.fromarray(array).crop(box).resize(size, Image.BICUBIC))
    diff = np.abs(ours.astype(int) - ref.astype(int))
    print(f"mean abs diff {diff.mean():.4f}, max {diff.max()}")
    assert diff.max() == 0  # the same fixed-point arithmetic as Pillow


# ---------------------------------------------------------------- loader


def test_batches_have_the_expected_layout(image_folder):
    with MultiCropLoader(image_folder, 4, num_threads=2, **SMALL) as loader:
        assert len(loader) == 18 // 4
        batches = list(loader)
    assert len(batches) == 4
    for b in batches:
        assert [tuple(c.shape) for c in b.crops] == [(4, 3, 32, 32)] * 2 + [(4, 3, 16, 16)] * 2
        assert all(c.dtype == torch.float32 and torch.isfinite(c).all() for c in b.crops)
        assert b.labels.dtype == torch.long and b.indices.dtype == torch.long
    seen = torch.cat([b.indices for b in batches])
    assert len(set(seen.tolist())) == 16  # 18 samples, last partial batch dropped
    paths, labels, classes = find_images(image_folder)
    assert classes == ["class0", "class1", "class2"]
    for b in batches:
        assert b.labels.tolist() == [labels[i] for i in b.indices.tolist()]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("channels_last", [False, True])
def test_dtype_and_memory_format(image_folder, dtype, channels_last):
    kw = dict(num_threads=2, seed=3, shuffle=False, **SMALL)
    with MultiCropLoader(image_folder, 6, **kw) as ref_loader:
        ref = next(iter(ref_loader))
    with MultiCropLoader(image_folder, 6, dtype=dtype, channels_last=channels_last, **kw) as loader:
        got = next(iter(loader))
    for a, b in zip(ref.crops, got.crops, strict=True):
        assert b.dtype == dtype
        fmt = torch.channels_last if channels_last else torch.contiguous_format
        assert b.is_contiguous(memory_format=fmt)
        torch.testing.assert_close(b.float(), a, atol=0.02, rtol=0.01)


def test_group_by_resolution_matches_list(image_folder):
    kw = dict(num_threads=2, seed=5, **SMALL)
    with (
        MultiCropLoader(image_folder, 4, **kw) as a,
        MultiCropLoader(image_folder, 4, group_by_resolution=True, **kw) as b,
    ):
        for x, y in zip(a, b, strict=True):
            assert torch.equal(torch.cat(x.crops[:2]), y.crops[0])
            assert torch.equal(torch.cat(x.crops[2:]), y.crops[1])


def test_output_is_independent_of_thread_count(image_folder):
    kw = dict(seed=11, batch_size=5, drop_last=False, **SMALL)
    with MultiCropLoader(image_folder, num_threads=1, **kw) as one:
        a = all_batches(one)
    with MultiCropLoader(image_folder, num_threads=3, prefetch=2, **kw) as three:
        b = all_batches(three)
    assert_same_batches(a, b)


def test_seed_and_epoch_change_the_batches(image_folder):
    kw = dict(num_threads=2, batch_size=6, **SMALL)
    with (
        MultiCropLoader(image_folder, seed=1, **kw) as x,
        MultiCropLoader(image_folder, seed=2, **kw) as y,
    ):
        bx, by = next(iter(x)), next(iter(y))
        assert not torch.equal(bx.indices, by.indices)
        x.set_epoch(1)
        bx1 = next(iter(x))
        assert not torch.equal(bx.indices, bx1.indices)


def test_photometric_operator_path_matches_cpu_path(image_folder):
    kw = dict(num_threads=2, seed=7, batch_size=6, **SMALL)
    with (
        MultiCropLoader(image_folder, **kw) as cpu,
        MultiCropLoader(image_folder, photometric="gpu", device="cpu", **kw) as op,
    ):
        for a, b in zip(cpu, op, strict=True):
            assert torch.equal(a.indices, b.indices)
            for x, y in zip(a.crops, b.crops, strict=True):
                torch.testing.assert_close(y, x, atol=1e-5, rtol=0)


@pytest.mark.cuda
def test_photometric_on_cuda_matches_cpu(image_folder):
    kw = dict(num_threads=2, seed=7, batch_size=6, **SMALL)
    with (
        MultiCropLoader(image_folder, **kw) as cpu,
        MultiCropLoader(image_folder, photometric="gpu", **kw) as gpu,
    ):
        for a, b in zip(cpu, gpu, strict=True):
            for x, y in zip(a.crops, b.crops, strict=True):
                assert y.is_cuda
                torch.testing.assert_close(y.cpu(), x, atol=1e-4, rtol=0)


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("pad", [True, False])
def test_shards_cover_the_data_set_like_distributed_sampler(image_folder, world_size, pad):
    shards = []
    for rank in range(world_size):
        shard = dict(rank=rank, world_size=world_size, pad_shards=pad, num_threads=1)
        with MultiCropLoader(image_folder, 2, **shard, **SMALL) as loader:
            sampler = torch.utils.data.DistributedSampler(
                range(18), num_replicas=world_size, rank=rank, drop_last=not pad
            )
            assert loader._native.samples_per_rank == len(sampler)
            shards.append(loader.epoch_indices(0))
    flat = [i for s in shards for i in s]
    if pad:
        assert set(flat) == set(range(18))
        assert len(flat) - len(set(flat)) == (-18) % world_size  # only the padding repeats
    else:
        assert len(flat) == len(set(flat)) == 18 // world_size * world_size


def test_resume_mid_epoch_gives_the_remaining_batches(image_folder):
    kw = dict(num_threads=2, seed=9, batch_size=3, **SMALL)
    with MultiCropLoader(image_folder, **kw) as full:
        full.set_epoch(2)
        expected = all_batches(full)
    with MultiCropLoader(image_folder, **kw) as first:
        first.set_epoch(2)
        it = iter(first)
        next(it), next(it)
        state = first.state_dict()
    assert state["next_batch"] == 2 and state["epoch"] == 2
    with MultiCropLoader(image_folder, **kw) as resumed:
        resumed.load_state_dict(state)
        rest = all_batches(resumed)
    assert_same_batches(rest, expected[2:])
    with MultiCropLoader(image_folder, **dict(kw, batch_size=4)) as other:
        with pytest.raises(ValueError, match="batch_size"):
            other.load_state_dict(state)


def test_one_ahead_starts_the_next_item_before_yielding_this_one():
    events = []

    def start(item):
        events.append(f"start {item}")
        return item * 10

    for item, started in one_ahead(iter([1, 2, 3]), start):
        events.append(f"use {item} {started}")
    assert events == [
        "start 1",
        "start 2",
        "use 1 10",
        "start 3",
        "use 2 20",
        "use 3 30",
    ]
    assert list(one_ahead([], start)) == [] and list(one_ahead([4], start)) == [(4, 40)]


class _CopyOnTheCPU:
    """DeviceCopy's stand-in on the CPU: the copies are the tensors
    themselves, counted, with wait() handing them over."""

    made: list = []

    def __init__(self, tensors, device, stream):
        self.tensors = [None if t is None else t.clone() for t in tensors]
        _CopyOnTheCPU.made.append(self)

    def wait(self):
        return self.tensors


def test_a_loader_copying_ahead_gives_the_same_batches_and_resume_position(
    image_folder, monkeypatch
):
    """The copy-ahead path (a GPU's; here with a stand-in copy on the CPU):
    the batches of the plain path, each batch's copy started before the one
    before it is yielded, and ``state_dict`` at the batch yielded, not the
    one copied ahead (so a resume repeats and skips nothing)."""
    kw = dict(num_threads=2, seed=9, batch_size=3, photometric="gpu", device="cpu", **SMALL)
    masks = dict(patch_size=16)
    with MultiCropLoader(image_folder, masks=masks, **kw) as plain:
        assert not plain.copies_ahead  # the CPU: nothing to overlap
        plain.set_epoch(1)
        expected = [(b, b.masks.clone()) for b in plain]
    monkeypatch.setattr(loader_module, "DeviceCopy", _CopyOnTheCPU)
    monkeypatch.setattr(loader_module.torch.cuda, "Stream", lambda device: None)
    monkeypatch.setattr(MultiCropLoader, "copies_ahead", property(lambda self: True))
    _CopyOnTheCPU.made.clear()
    with MultiCropLoader(image_folder, masks=masks, **kw) as ahead:
        ahead.set_epoch(1)
        it = iter(ahead)
        first = next(it)
        assert len(_CopyOnTheCPU.made) == 2  # this batch's copy and the next one's
        second = next(it)
        state = ahead.state_dict()
        rest = list(it)
    assert state["next_batch"] == 2 and state["epoch"] == 1
    got = [first, second, *rest]
    assert len(got) == len(expected) == len(_CopyOnTheCPU.made)
    for b, (e, e_masks) in zip(got, expected, strict=True):
        assert torch.equal(b.indices, e.indices) and torch.equal(b.masks, e_masks)
        for x, y in zip(b.crops, e.crops, strict=True):
            assert torch.equal(x, y)
    assert ahead.state_dict()["next_batch"] == 0  # the epoch iterated to its end


@pytest.mark.cuda
def test_a_loader_on_cuda_copies_ahead_and_gives_the_plain_batches(image_folder, monkeypatch):
    kw = dict(num_threads=2, seed=7, batch_size=6, photometric="gpu", **SMALL)
    with MultiCropLoader(image_folder, **kw) as ahead:
        assert ahead.copies_ahead
        got = [[c.cpu() for c in b.crops] for b in ahead]
    monkeypatch.setattr(MultiCropLoader, "copies_ahead", property(lambda self: False))
    with MultiCropLoader(image_folder, **kw) as plain:
        expected = [[c.cpu() for c in b.crops] for b in plain]
    assert len(got) == len(expected) > 1
    for a, b in zip(got, expected, strict=True):
        for x, y in zip(a, b, strict=True):
            assert torch.equal(x, y)


# ---------------------------------------------------------------- bad input


def jpeg_bytes(rng, h=64, w=80, **kw) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(natural_image(rng, h, w)).save(buf, "JPEG", **kw)
    return buf.getvalue()


def huge_header_jpeg(rng) -> bytes:
    """A valid small JPEG whose frame header claims 60000 x 60000."""
    data = bytearray(jpeg_bytes(rng))
    i = data.index(b"\xff\xc0")  # SOF0
    data[i + 5 : i + 9] = (60000).to_bytes(2, "big") + (60000).to_bytes(2, "big")
    return bytes(data)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict:
    """Files that must fail cleanly, and odd files that must load."""
    root = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(2)
    good = jpeg_bytes(rng)
    bad = {
        "empty.jpg": b"",
        "truncated.jpg": good[: len(good) // 2],
        "random.jpg": rng.integers(0, 256, 5000, dtype=np.uint8).tobytes(),
        "huge_header.jpg": huge_header_jpeg(rng),
        "text.png": b"not a png at all",
    }
    paths = {}
    for name, data in bad.items():
        (root / name).write_bytes(data)
        paths[name] = root / name
    (root / "directory.jpg").mkdir()
    paths["directory.jpg"] = root / "directory.jpg"
    (root / "dangling.jpg").symlink_to(root / "nowhere.jpg")
    paths["dangling.jpg"] = root / "dangling.jpg"

    odd = {}
    array = natural_image(rng, 50, 70)
    Image.fromarray(array).convert("RGBA").save(root / "alpha.png")
    Image.fromarray((np.mgrid[0:40, 0:60][1] * 1000).astype(np.uint16)).save(root / "gray16.png")
    save_jpeg(root / "gray.jpg", array, mode="L")
    save_jpeg(root / "cmyk.jpg", array, mode="CMYK")
    save_jpeg(root / "one_pixel.jpg", array[:1, :1])
    save_jpeg(root / "wide.jpg", natural_image(rng, 3, 10000))
    Image.fromarray(array).convert("P").save(root / "palette.png")
    for name in [
        "alpha.png",
        "gray16.png",
        "gray.jpg",
        "cmyk.jpg",
        "one_pixel.jpg",
        "wide.jpg",
        "palette.png",
    ]:
        odd[name] = root / name
    return {"bad": paths, "odd": odd, "root": root}


BAD_CAUSES = {
    "empty.jpg": "empty",
    "truncated.jpg": "",
    "random.jpg": "",
    "huge_header.jpg": "60000",
    "text.png": "",
    "directory.jpg": "directory",
    "dangling.jpg": "",
}


@pytest.mark.parametrize("name", sorted(BAD_CAUSES))
def test_bad_file_raises_naming_the_path(corpus, name):
    path = corpus["bad"][name]
    loader = MultiCropLoader([path], 1, num_threads=1, drop_last=False, **SMALL)
    with pytest.raises(LoaderError) as err:
        next(iter(loader))
    message = str(err.value)
    assert str(path) in message and BAD_CAUSES[name] in message.lower()
    loader.close()  # still closable after the error
    with pytest.raises(LoaderError, match="closed"):
        next(iter(loader))


@pytest.mark.parametrize(
    "name",
    ["alpha.png", "gray16.png", "gray.jpg", "cmyk.jpg", "one_pixel.jpg", "wide.jpg", "palette.png"],
)
def test_odd_images_load(corpus, name):
    if name.endswith(".png") and not _C.other_formats_available():
        pytest.skip("built without OpenCV imgcodecs")
    path = corpus["odd"][name]
    with MultiCropLoader([path], 1, num_threads=1, drop_last=False, **SMALL) as loader:
        (batch,) = list(loader)
    for crop in batch.crops:
        assert torch.isfinite(crop).all()
    if name.startswith("gray"):
        # Grey in, grey out: every photometric op keeps R = G = B.
        mean = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
        std = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
        for crop in batch.crops:
            x = crop * std + mean
            torch.testing.assert_close(x[:, 0], x[:, 1], atol=1e-5, rtol=0)


def test_pixel_limit_is_configurable(image_folder):
    paths, _, _ = find_images(image_folder)
    with MultiCropLoader(
        paths[:1], 1, num_threads=1, max_pixels=100, drop_last=False, **SMALL
    ) as loader:
        with pytest.raises(LoaderError, match="pixel"):
            next(iter(loader))


def test_skip_replaces_bad_files_deterministically(corpus, image_folder):
    good, _, _ = find_images(image_folder)
    bad = [corpus["bad"][n] for n in sorted(BAD_CAUSES)]
    paths = good[:8] + bad
    kw = dict(num_threads=2, batch_size=3, drop_last=False, on_error="skip", seed=4, **SMALL)
    runs = []
    for _ in range(2):
        with MultiCropLoader(paths, **kw) as loader:
            batches = all_batches(loader)
            stats = loader.stats()
        runs.append(batches)
        assert sum(b[2].numel() for b in batches) == len(paths)
        assert all(i < 8 for b in batches for i in b[2].tolist())  # only good files served
        assert stats["skipped"] >= len(bad)
        listed = " ".join(stats["skipped_files"])
        assert all(str(p) in listed for p in bad)
    assert_same_batches(runs[0], runs[1])


def test_skip_gives_up_on_a_data_set_without_readable_files(corpus):
    bad = [corpus["bad"]["empty.jpg"], corpus["bad"]["random.jpg"]]
    with MultiCropLoader(
        bad, 1, num_threads=1, on_error="skip", drop_last=False, **SMALL
    ) as loader:
        with pytest.raises(LoaderError, match="no readable replacement"):
            next(iter(loader))


def test_missing_and_empty_directories(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        MultiCropLoader(tmp_path / "missing", 2)
    with pytest.raises(ValueError, match="no image files"):
        MultiCropLoader(tmp_path, 2)
    (tmp_path / "class_a").mkdir()
    (tmp_path / "class_a" / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match="no image files"):
        MultiCropLoader(tmp_path, 2)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(batch_size=0), "batch_size"),
        (dict(rank=2, world_size=2), "rank"),
        (dict(photometric="tpu"), "photometric"),
        (dict(on_error="ignore"), "on_error"),
        (dict(dtype=torch.int32), "dtype"),
        (dict(global_scale=(0.5, 0.2)), "global_scale"),
        (dict(n_local=-1), "n_local"),
        (dict(prefetch=0), "prefetch"),
        (dict(augment={"blur_p": 0.5}), "blur_p"),
        (dict(augment={"flip_p": 2.0}), "flip_p"),
        (dict(mean=(0.5, 0.5)), "mean"),
    ],
)
def test_bad_arguments_name_themselves(image_folder, kwargs, match):
    args = dict(batch_size=2, **SMALL)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        MultiCropLoader(image_folder, **args)


# ---------------------------------------------------------------- lifetime


def test_close_mid_epoch_joins_threads(image_folder):
    before = thread_count()
    loader = MultiCropLoader(image_folder, 2, num_threads=3, prefetch=8, **SMALL)
    it = iter(loader)
    next(it)
    closer = threading.Thread(target=loader.close)
    closer.start()
    closer.join(timeout=60)
    assert not closer.is_alive()
    assert threads_return_to(before)
    with pytest.raises(LoaderError, match="closed"):
        next(it)


def test_dropping_a_loader_with_a_full_queue_joins_threads(image_folder):
    before = thread_count()
    loader = MultiCropLoader(image_folder, 2, num_threads=2, prefetch=3, **SMALL)
    it = iter(loader)
    next(it)
    deadline = threading.Event()
    while loader.stats()["images"] < 2 * 4 and not deadline.wait(0.01):
        pass  # until the queue is full: 1 consumed + 3 prefetched batches of 2
    del it, loader
    gc.collect()
    assert threads_return_to(before)


def test_stats_report_throughput_and_stages(image_folder):
    with MultiCropLoader(image_folder, 3, num_threads=2, **SMALL) as loader:
        n = sum(1 for _ in loader)
        s = loader.stats()
    assert s["batches"] == n and s["images"] >= n * 3
    assert s["images_per_second"] > 0 and s["num_threads"] == 2
    assert s["decode_seconds"] > 0 and s["crop_seconds"] > 0 and s["augment_seconds"] > 0
    assert 0 <= s["starvation"] and s["skipped"] == 0


# ---------------------------------------------------------------- Dataset route


def test_dataset_is_deterministic_and_collates(image_folder):
    ds = MultiCropDataset(image_folder, seed=3, **SMALL)
    assert len(ds) == 18
    a, b = ds[5], ds[5]
    assert a["index"] == 5 and a["label"] == find_images(image_folder)[1][5]
    assert [tuple(c.shape) for c in a["crops"]] == [(3, 32, 32)] * 2 + [(3, 16, 16)] * 2
    assert all(torch.equal(x, y) for x, y in zip(a["crops"], b["crops"], strict=True))
    ds.set_epoch(1)
    assert not torch.equal(ds[5]["crops"][0], a["crops"][0])
    loader = DataLoadingOptimizer.create_optimized_dataloader(ds, 4, num_workers=2)
    batch = next(iter(loader))
    assert [tuple(c.shape) for c in batch["crops"]] == [(4, 3, 32, 32)] * 2 + [(4, 3, 16, 16)] * 2
    assert batch["labels"].shape == (4,)


def test_dct_scaled_decoding_stays_close_to_full_decoding(tmp_path):
    rng = np.random.default_rng(0)
    paths = [save_jpeg(tmp_path / f"big{i}.jpg", natural_image(rng, 1200, 1600)) for i in range(3)]
    kw = dict(num_threads=2, seed=1, batch_size=3, n_local=2)
    with (
        MultiCropLoader(paths, dct_scaling=True, **kw) as fast,
        MultiCropLoader(paths, dct_scaling=False, **kw) as exact,
    ):
        a, b = next(iter(fast)), next(iter(exact))
    for x, y in zip(a.crops, b.crops, strict=True):
        diff = (x - y).abs().mean().item()
        print(f"mean abs diff (normalised units) {diff:.4f}")
        assert diff < 0.05


def test_prepare_reencodes_at_a_bounded_size(image_folder, tmp_path, corpus):
    from dino_opt.cli import main

    src = tmp_path / "src"
    for c in ("a", "b"):
        (src / c).mkdir(parents=True)
    rng = np.random.default_rng(3)
    save_jpeg(src / "a" / "big.jpg", natural_image(rng, 300, 500))
    save_jpeg(src / "a" / "small.jpg", natural_image(rng, 30, 20))
    Image.fromarray(natural_image(rng, 200, 120)).save(src / "b" / "pic.png")
    (src / "b" / "broken.jpg").write_bytes(b"\xff\xd8\xff garbage")
    dst = tmp_path / "dst"
    assert main(["prepare", str(src), str(dst), "--max-side", "64", "--quiet"]) == 1  # one failure
    sizes = {p.relative_to(dst).as_posix(): Image.open(p).size for p in dst.rglob("*.jpg")}
    assert sizes["a/big.jpg"] == (64, 38)
    assert sizes["a/small.jpg"] == (20, 30)  # never enlarged
    if _C.other_formats_available():
        assert sizes["b/pic.jpg"] == (38, 64)
    assert "b/broken.jpg" not in sizes
    assert not list(dst.rglob("*.tmp*"))  # atomic writes leave no temporaries
    with MultiCropLoader(dst, 1, num_threads=1, drop_last=False, **SMALL) as loader:
        assert sum(b.labels.numel() for b in loader) == len(sizes)
    with pytest.raises(SystemExit):
        main(["prepare", str(src), str(src)])
