"""Images that are not 8-bit RGB through the native loader (docs/loader.md,
"Images that are not 8-bit RGB"): 16-bit PNG/TIFF and .npy sources of 1, 2,
4 and 13 channels cropped and resized bit for bit as a plain NumPy reference
of Pillow's bicubic does at the source depth; sources mixing layouts refused;
the per-channel photometric stage against a float64 reference; RGB-only
options refused."""

import io
import math

import numpy as np
import pytest
import torch
from dino_opt import _C
from dino_opt.data import LoaderError, MultiCropLoader, open_source
from dino_opt.ops.channel_photometric_torch import channel_photometric_torch
from PIL import Image

SMALL = dict(global_size=24, local_size=12, n_local=2)
SEED = 5


# ------------------------------------------------------------------ the reference resampler


def _bicubic(x: float) -> float:
    a = -0.5
    x = abs(x)
    if x < 1.0:
        return ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0
    if x < 2.0:
        return (((x - 5.0) * x + 8.0) * x - 4.0) * a
    return 0.0


def _taps(in0: float, in1: float, clamp0: int, clamp1: int, out_size: int):
    """Pillow's bicubic coefficients (Resample.c precompute_coeffs, 22-bit
    fixed point) of one axis: per output, the first input and the int taps."""
    scale = (in1 - in0) / out_size
    filter_scale = max(scale, 1.0)
    support = 2.0 * filter_scale
    taps = int(math.ceil(support)) * 2 + 1
    window, lo = clamp1 - clamp0, in0 - clamp0
    out = []
    for i in range(out_size):
        center = lo + (i + 0.5) * scale
        first = max(int(center - support + 0.5), 0)
        last = min(int(center + support + 0.5), window)
        n = min(max(last - first, 1), taps)
        w = [_bicubic((k + first - center + 0.5) / filter_scale) for k in range(n)]
        total = 0.0
        for v in w:
            total += v
        fixed = []
        for v in w:
            v = v / total if total != 0.0 else 0.0
            fixed.append(int(-0.5 + v * (1 << 22)) if v < 0 else int(0.5 + v * (1 << 22)))
        out.append((clamp0 + min(first, window - 1), fixed))
    return out


def _pass(x: np.ndarray, taps, axis: int) -> np.ndarray:
    """One pass along ``axis`` (0 rows, 1 columns) at x's depth: int64 sums
    rounded by a shift and clipped, or float64 sums rounded to float32."""
    outs = []
    for start, w in taps:
        if x.dtype == np.float32:
            acc = np.zeros(np.take(x, 0, axis=axis).shape, np.float64)
            for k, wk in enumerate(w):
                acc += np.float64(wk) * np.take(x, start + k, axis=axis).astype(np.float64)
            outs.append((acc * 2.0**-22).astype(np.float32))
        else:
            acc = np.full(np.take(x, 0, axis=axis).shape, 1 << 21, np.int64)
            for k, wk in enumerate(w):
                acc += wk * np.take(x, start + k, axis=axis).astype(np.int64)
            top = np.iinfo(x.dtype).max
            outs.append(np.clip(acc >> 22, 0, top).astype(x.dtype))
    return np.stack(outs, axis=axis)


def reference_crop(image: np.ndarray, top: int, left: int, height: int, width: int, out: int):
    """torchvision's resized_crop (crop, then resize) with Pillow's bicubic,
    horizontal pass first, at the image's own depth."""
    crop = image[top : top + height, left : left + width]
    tx = _taps(0.0, float(width), 0, width, out)
    ty = _taps(0.0, float(height), 0, height, out)
    rows = sorted({s + k for s, w in ty for k in range(len(w))})
    first, last = rows[0], rows[-1] + 1
    mid = _pass(crop[first:last], tx, axis=1)
    return _pass(mid, [(s - first, w) for s, w in ty], axis=0)


# ------------------------------------------------------------------ data


def random_image(rng, h, w, channels, dtype):
    if dtype == np.float32:
        return rng.uniform(-1, 2, (h, w, channels)).astype(np.float32)
    return rng.integers(0, np.iinfo(dtype).max + 1, (h, w, channels), dtype=dtype)


def as_numpy(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.uint16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def to_tensor(a: np.ndarray) -> torch.Tensor:
    if a.dtype == np.uint16:
        return torch.from_numpy(a.view(np.int16)).view(torch.uint16)
    return torch.from_numpy(a)


def write_set(folder, rng, channels, dtype, fmt, count=5):
    """``count`` random images of one layout, as ``fmt`` files; their arrays."""
    folder.mkdir(parents=True, exist_ok=True)
    arrays = []
    for i in range(count):
        h, w = rng.integers(30, 70, 2)
        a = random_image(rng, int(h), int(w), channels, dtype)
        (folder / f"img{i}.{fmt}").write_bytes(_C.encode_raw(to_tensor(a), fmt))
        arrays.append(a)
    return arrays


def native_loader(folder, channels, photometric=False, augment=None, **kw):
    """The native loader itself (photometric off: crops at the source depth
    and their parameter rows), one batch holding the whole folder in order."""
    options = dict(
        batch_size=5,
        augment=dict(SMALL, **(augment or {})),
        num_threads=2,
        prefetch=1,
        seed=SEED,
        rank=0,
        world_size=1,
        shuffle=False,
        drop_last=False,
        pad_shards=True,
        dtype="float32",
        channels_last=False,
        photometric=photometric,
        pin_memory=False,
        skip_errors=False,
        max_pixels=178956970,
        mean=[0.5] * channels,
        std=[0.25] * channels,
        dct_scaling=True,
        image_mode="native",
    )
    options.update(kw)
    return _C.MultiCropLoader(open_source(folder).native, **options)


def crops_of(raw, b: int):
    """Sample r's crops from a raw batch: [global_1, global_2, local_1, ...]."""
    groups, params = raw[0], raw[1]
    out = []
    for r in range(b):
        crops = [groups[0][c * b + r] for c in range(2)]
        rows = [params[0][c * b + r] for c in range(2)]
        if len(groups) > 1:
            n_local = groups[1].shape[0] // b
            crops += [groups[1][c * b + r] for c in range(n_local)]
            rows += [params[1][c * b + r] for c in range(n_local)]
        out.append((crops, rows))
    return out


def arrays_by_index(folder, arrays):
    source = open_source(folder)
    names = [f"img{i}" for i in range(len(arrays))]
    return {
        i: arrays[names.index(source.describe(i).rsplit("/", 1)[1].split(".")[0])]
        for i in range(len(source))
    }


# ------------------------------------------------------------------ tests


LAYOUTS = [(1, np.uint16), (2, np.uint16), (4, np.uint16), (13, np.uint16), (3, np.float32)]


@pytest.mark.parametrize("channels,dtype", LAYOUTS)
def test_resize_crop_raw_is_the_numpy_reference_bit_for_bit(channels, dtype):
    rng = np.random.default_rng()
    for _ in range(4):
        h, w = rng.integers(20, 90, 2)
        image = random_image(rng, int(h), int(w), channels, dtype)
        ch, cw = int(rng.integers(1, h + 1)), int(rng.integers(1, w + 1))
        top, left = int(rng.integers(0, h - ch + 1)), int(rng.integers(0, w - cw + 1))
        out = int(rng.integers(1, 40))
        got = as_numpy(_C.resize_crop_raw(to_tensor(image), top, left, ch, cw, out, out))
        want = reference_crop(image, top, left, ch, cw, out)
        assert got.dtype == want.dtype and np.array_equal(got, want), (top, left, ch, cw, out)


# Every format at the layouts it holds: PNG and TIFF through OpenCV (which writes
# 1, 3 or 4 channels; a gray + alpha PNG is test_gray_alpha_png_is_two_channels'),
# .npy for any.
SOURCES = [
    ("png", 1, np.uint16),
    ("png", 4, np.uint16),
    ("tiff", 1, np.uint16),
    ("tiff", 4, np.uint16),
    ("npy", 1, np.uint16),
    ("npy", 2, np.uint16),
    ("npy", 4, np.uint16),
    ("npy", 13, np.uint16),
    ("npy", 6, np.float32),
]


@pytest.mark.parametrize("fmt,channels,dtype", SOURCES)
def test_loader_crops_at_the_source_depth_are_the_reference(tmp_path, fmt, channels, dtype):
    rng = np.random.default_rng()
    arrays = write_set(tmp_path / "set", rng, channels, dtype, fmt)
    by_index = arrays_by_index(tmp_path / "set", arrays)
    native = native_loader(tmp_path / "set", channels)
    assert native.layout[:2] == (channels, np.dtype(dtype).name)
    native.start_epoch(0)
    raw = native.next()
    indices = raw[3].tolist()
    for position, (crops, _) in enumerate(crops_of(raw, len(indices))):
        image = by_index[indices[position]]
        rects, _ = _C.sample_crops(SEED, position + 1, image.shape[0], image.shape[1], SMALL)
        for c, crop in enumerate(crops):
            top, left, h, w = rects[position, c].tolist()
            want = reference_crop(image, top, left, h, w, crop.shape[0])
            got = as_numpy(crop)
            assert got.dtype == want.dtype
            assert np.array_equal(got, want), (fmt, position, c)
    native.close()


def test_decode_raw_keeps_the_stored_samples(tmp_path):
    rng = np.random.default_rng()
    for fmt, channels, dtype in SOURCES:
        a = random_image(rng, 9, 7, channels, dtype)
        back = as_numpy(_C.decode_raw(_C.encode_raw(to_tensor(a), fmt)))
        assert back.shape == a.shape and np.array_equal(back, a), (fmt, channels)


def test_a_source_mixing_layouts_is_refused_naming_the_file(tmp_path):
    rng = np.random.default_rng()
    folder = tmp_path / "mixed"
    write_set(folder, rng, 1, np.uint16, "png", count=3)
    odd = random_image(rng, 40, 40, 1, np.uint8)
    (folder / "img1.png").write_bytes(_C.encode_raw(to_tensor(odd), "png"))
    kw = dict(batch_size=3, shuffle=False, image_mode="native", mean=[0.5], std=[0.2])
    with MultiCropLoader(folder, **kw, **SMALL) as loader:
        with pytest.raises(LoaderError) as info:
            next(iter(loader))
    message = str(info.value)
    assert "img1.png" in message and "1-channel uint8" in message
    assert "1-channel uint16" in message and "img0.png" in message
    assert "mixing channel counts or depths" in message and "\n" not in message


# ------------------------------------------------------------------ the per-channel stage


def _lowbias32(x: np.ndarray) -> np.ndarray:
    x = x ^ (x >> np.uint32(16))
    x = x * np.uint32(0x7FEB352D)
    x = x ^ (x >> np.uint32(15))
    x = x * np.uint32(0x846CA68B)
    return x ^ (x >> np.uint32(16))


def reference_noise(key: int, count: int) -> np.ndarray:
    """Box-Muller on lowbias32 (Wellons' integer hash) of (2 i) ^ key and (2 i + 1) ^ key."""
    i2 = (np.arange(count, dtype=np.uint64) * 2).astype(np.uint32)
    k = np.uint32(key)
    a = _lowbias32(i2 ^ k).astype(np.float64)
    b = _lowbias32((i2 + np.uint32(1)) ^ k).astype(np.float64)
    return np.sqrt(-2.0 * np.log((a + 0.5) / 2.0**32)) * np.cos(2.0 * np.pi * b / 2.0**32)


def reference_blur(plane: np.ndarray, sigma: float) -> np.ndarray:
    """Separable Gaussian, 2 ceil(3 sigma) + 1 taps clamped to the side, reflect padding."""
    for axis in (0, 1):
        n = plane.shape[axis]
        r = min(math.ceil(3 * sigma), n - 1)
        if r <= 0:
            continue
        k = np.exp(-0.5 * (np.arange(-r, r + 1) / sigma) ** 2)
        k /= k.sum()
        pad = [(0, 0), (0, 0)]
        pad[axis] = (r, r)
        padded = np.pad(plane, pad, mode="reflect")
        plane = sum(
            k[j] * np.take(padded, np.arange(j, j + n), axis=axis) for j in range(2 * r + 1)
        )
    return plane


def reference_stage(crop: np.ndarray, row: np.ndarray, mean, std) -> np.ndarray:
    """The per-channel stage from its definition, in float64: [C, H, W]."""
    integer = crop.dtype != np.float32
    scale = {np.uint8: 255.0, np.uint16: 65535.0}.get(crop.dtype.type, 1.0)
    c = crop.shape[2]
    x = crop.astype(np.float64).transpose(2, 0, 1) / scale
    flip, sigma, noise_std, key_hi, key_lo = row[:5].tolist()
    bright, contrast = row[5 : 5 + c], row[5 + c : 5 + 2 * c]

    def bound(v):
        return np.clip(v, 0.0, 1.0) if integer else v

    for ch in range(c):
        if bright[ch] != 1:
            x[ch] = bound(x[ch] * bright[ch])
        if contrast[ch] != 1:
            x[ch] = bound(contrast[ch] * x[ch] + (1 - contrast[ch]) * x[ch].mean())
        if sigma > 0:
            x[ch] = reference_blur(x[ch], sigma)
    x = (x - np.asarray(mean)[:, None, None]) / np.asarray(std)[:, None, None]
    if noise_std > 0:
        z = reference_noise(int(key_hi) * 65536 + int(key_lo), x.size).reshape(x.shape)
        x = x + noise_std * z
    return x[..., ::-1] if flip else x


STAGE_AUGMENT = dict(
    jitter_p=1.0,
    blur_p_global1=1.0,
    blur_p_global2=1.0,
    blur_p_local=1.0,
    noise_p=1.0,
    noise_std=(0.05, 0.2),
)


@pytest.mark.parametrize("channels,dtype", [(4, np.uint16), (1, np.uint16), (2, np.float32)])
def test_channel_stage_is_the_float64_reference(tmp_path, channels, dtype):
    rng = np.random.default_rng()
    arrays = write_set(tmp_path / "set", rng, channels, dtype, "npy")
    by_index = arrays_by_index(tmp_path / "set", arrays)
    mean = rng.uniform(0.2, 0.6, channels).tolist()
    std = rng.uniform(0.1, 0.4, channels).tolist()
    kw = dict(augment=STAGE_AUGMENT, mean=mean, std=std)
    done = native_loader(tmp_path / "set", channels, photometric=True, **kw)
    deferred = native_loader(tmp_path / "set", channels, photometric=False, **kw)
    done.start_epoch(0)
    deferred.start_epoch(0)
    out, raw = done.next(), deferred.next()
    b = len(raw[3])
    for position, (crops, rows) in enumerate(crops_of(raw, b)):
        groups = out[0]
        finished = [groups[0][c * b + position] for c in range(2)]
        finished += [groups[1][c * b + position] for c in range(len(crops) - 2)]
        h, w = by_index[int(raw[3][position])].shape[:2]
        rgb_rows = _C.sample_crops(SEED, position + 1, h, w, dict(SMALL, **STAGE_AUGMENT))[1]
        for c, (crop, row, got) in enumerate(zip(crops, rows, finished, strict=True)):
            want = reference_stage(as_numpy(crop), row.numpy(), mean, std)
            np.testing.assert_allclose(got.numpy(), want, atol=2e-5, rtol=0)
            # The torch form on the same crops and rows (the device stage).
            torch_form = channel_photometric_torch(crop[None], row[None], mean, std)[0]
            torch.testing.assert_close(torch_form, got, atol=1e-5, rtol=0)
            # The geometric part is the RGB recipe's: its flip and its blur sigma.
            assert row[0] == rgb_rows[position, c, 0] and row[1] == rgb_rows[position, c, 11]
            assert row[2] > 0  # noise_p = 1
    done.close()
    deferred.close()


def test_rgb_only_options_are_refused_for_other_layouts(tmp_path):
    rng = np.random.default_rng()
    write_set(tmp_path / "set", rng, 1, np.uint16, "png", count=2)
    kw = dict(batch_size=2, image_mode="native", mean=[0.5], std=[0.2], **SMALL)
    for key, value in (("hue", 0.1), ("saturation", 0.3), ("grayscale_p", 0.2)):
        with pytest.raises(ValueError, match=rf"\['{key}'\] are RGB colour operations.*1-channel"):
            MultiCropLoader(tmp_path / "set", augment={key: value}, **kw)
    # Zero (not asked for) is accepted, as are brightness, contrast, blur and noise.
    extra = dict(hue=0.0, brightness=0.3, contrast=0.2, noise_p=0.5, noise_std=(0.0, 0.05))
    MultiCropLoader(tmp_path / "set", augment=extra, **kw).close()
    with pytest.raises(ValueError, match="mean and std have 3 and 3 values, but 1-channel"):
        MultiCropLoader(tmp_path / "set", 2, image_mode="native", mean=[0.1] * 3, std=[0.2] * 3)


def test_native_mode_measures_the_statistics_and_records_the_layout(tmp_path):
    rng = np.random.default_rng()
    arrays = write_set(tmp_path / "set", rng, 2, np.uint16, "npy", count=4)
    with MultiCropLoader(tmp_path / "set", batch_size=2, image_mode="native", **SMALL) as loader:
        assert loader.layout.channels == 2 and loader.layout.dtype == "uint16"
        assert loader.layout.first.endswith(".npy")
        values = np.concatenate([a.reshape(-1, 2) for a in arrays]).astype(np.float64) / 65535
        np.testing.assert_allclose(loader.mean, values.mean(0), rtol=1e-9)
        np.testing.assert_allclose(loader.std, values.std(0), rtol=1e-6)
        batch = next(iter(loader))
        assert batch.crops[0].shape[1] == 2 and batch.crops[2].shape[1:] == (2, 12, 12)


def test_native_mode_on_8bit_rgb_is_the_rgb_path(tmp_path):
    rng = np.random.default_rng()
    (tmp_path / "jpg").mkdir()
    for i in range(4):
        pixels = rng.integers(0, 256, (50, 60, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(tmp_path / "jpg" / f"{i}.jpg", quality=90)
    kw = dict(batch_size=4, seed=3, num_threads=2, **SMALL)
    with (
        MultiCropLoader(tmp_path / "jpg", **kw) as rgb,
        MultiCropLoader(tmp_path / "jpg", image_mode="native", **kw) as native,
    ):
        assert native.layout.rgb8
        for a, b in zip(rgb, native, strict=True):
            for x, y in zip(a.crops, b.crops, strict=True):
                assert torch.equal(x, y)


def test_gray_alpha_png_is_two_channels():
    rng = np.random.default_rng()
    a = rng.integers(0, 256, (5, 7, 2), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(a, "LA").save(buffer, "PNG")
    assert np.array_equal(_C.decode_raw(buffer.getvalue()).numpy(), a)
