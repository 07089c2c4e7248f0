"""A synthetic ImageNet-like ImageFolder data set for the loader benchmark.

    python bench/synthetic_images.py [--count 2000] [--seed 0] [--out DIR]

Every image is a JPEG (quality 90, 4:2:0 like most photographs) with width and
height drawn independently from 300..600 px. The content is built so that the
JPEG coder sees what it sees in photographs: smooth 1/f ("pink") colour fields
with correlated channels, objects with edges of varying sharpness, and a little
fine texture. Flat colour would make files tiny and decoding cheap; white
noise would make them huge; either would flatter or penalise a loader.

The set is cached in DIR (default build/bench-data/synthetic-<count>) with a
manifest.json; it is rebuilt only when the manifest is missing or was made
with another count, seed or generator version. Output is deterministic from
the seed (each image draws from its own stream, so worker count and order do
not matter).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

# Bump when the generator changes so that cached sets are rebuilt.
GENERATOR_VERSION = 1
DEFAULT_ROOT = Path(__file__).resolve().parent.parent / "build" / "bench-data"
N_CLASSES = 10
MIN_SIDE, MAX_SIDE = 300, 600
QUALITY = 90


@dataclass
class SyntheticSet:
    root: Path
    samples: list[tuple[str, int]]  # (path, label), ImageFolder order
    classes: list[str]
    mean_bytes: float
    mean_pixels: float
    mean_width: float
    mean_height: float


def pink_noise(rng: np.random.Generator, h: int, w: int, alpha: float) -> np.ndarray:
    """Zero-mean, unit-variance field whose amplitude spectrum falls as 1/f**alpha
    (natural images sit near alpha = 1)."""
    # Made on a grid of a fast FFT size (multiple of 32) and cropped: sides like
    # 457 are several times slower, and a crop of a stationary field is fine.
    fh, fw = -(-h // 32) * 32, -(-w // 32) * 32
    spectrum = np.fft.rfft2(rng.standard_normal((fh, fw), dtype=np.float32))
    fy = np.fft.fftfreq(fh).astype(np.float32)[:, None]
    fx = np.fft.rfftfreq(fw).astype(np.float32)[None, :]
    f = np.sqrt(fx * fx + fy * fy)
    f[0, 0] = 1.0  # the mean is removed below; avoid dividing by zero
    field = np.fft.irfft2(spectrum / f**alpha, s=(fh, fw))[:h, :w].astype(np.float32)
    field -= field.mean()
    return field / (field.std() + 1e-12)


def upsample(field: np.ndarray, w: int, h: int) -> np.ndarray:
    return np.asarray(
        Image.fromarray(field.astype(np.float32), mode="F").resize((w, h), Image.BICUBIC)
    )


def colour_field(rng: np.random.Generator, w: int, h: int, base: np.ndarray) -> np.ndarray:
    """An H x W x 3 float image: a pink luminance field plus weaker chroma
    fields, mixed so that the channels are strongly correlated as in photos.
    Drawn at a quarter of the resolution (cheap; large-scale structure only)."""
    lh, lw = max(8, h // 4), max(8, w // 4)
    lum = pink_noise(rng, lh, lw, rng.uniform(0.9, 1.4))
    c1 = pink_noise(rng, lh, lw, rng.uniform(1.1, 1.6))
    c2 = pink_noise(rng, lh, lw, rng.uniform(1.1, 1.6))
    fields = np.stack([upsample(x, w, h) for x in (lum, c1, c2)], axis=-1)
    # Row k: how much of field k (luminance, chroma 1, chroma 2) goes into R, G, B.
    mix = np.empty((3, 3), dtype=np.float32)
    mix[0] = rng.uniform(28, 55)  # luminance contrast, same for R, G, B
    mix[1] = rng.normal(0, 10, 3)
    mix[2] = rng.normal(0, 10, 3)
    return base.astype(np.float32) + fields @ mix


def draw_shape(
    rng: np.random.Generator, w: int, h: int, draw: list, fill: tuple, scale: tuple, bands: bool
) -> None:
    """A random ellipse, polygon or band, drawn with the matching fill on every
    ImageDraw in ``draw`` (the paint layer and its mask)."""
    cx, cy = rng.uniform(0, w), rng.uniform(0, h)
    size = rng.uniform(*scale) * min(w, h)
    kind = rng.integers(3 if bands else 2)
    if kind == 0:
        rx, ry = size * rng.uniform(0.5, 1.5), size * rng.uniform(0.5, 1.5)
        for d, f in zip(draw, fill, strict=True):
            d.ellipse([cx - rx, cy - ry, cx + rx, cy + ry], fill=f)
    elif kind == 1:
        n = int(rng.integers(3, 9))
        angles = np.sort(rng.uniform(0, 2 * np.pi, n))
        radii = size * rng.uniform(0.4, 1.2, n)
        pts = [
            (float(cx + r * np.cos(a)), float(cy + r * np.sin(a)))
            for a, r in zip(angles, radii, strict=True)
        ]
        for d, f in zip(draw, fill, strict=True):
            d.polygon(pts, fill=f)
    else:
        # A long straight band (a horizon, a branch, a table edge).
        angle = rng.uniform(0, np.pi)
        dx, dy = np.cos(angle) * 2 * max(w, h), np.sin(angle) * 2 * max(w, h)
        for d, f in zip(draw, fill, strict=True):
            d.line([(cx - dx, cy - dy), (cx + dx, cy + dy)], fill=f, width=int(size * 0.4) + 2)


def make_image(seed: int, index: int, label: int) -> Image.Image:
    rng = np.random.default_rng([seed, index])
    w = int(rng.integers(MIN_SIDE, MAX_SIDE + 1))
    h = int(rng.integers(MIN_SIDE, MAX_SIDE + 1))
    # The class sets the palette, so labels mean something (e.g. for a k-NN check).
    class_base = np.random.default_rng([seed, 10**9, label]).uniform(60, 190, 3)
    background = colour_field(rng, w, h, class_base + rng.normal(0, 20, 3))
    # Objects: flat-coloured shapes on a paint layer and a mask, edges softened
    # by a per-image blur (0 = sharp focus), then shaded by a second colour field
    # so that their insides are not flat.
    paint = Image.new("RGB", (w, h))
    mask = Image.new("L", (w, h), 0)
    layers = [ImageDraw.Draw(paint), ImageDraw.Draw(mask)]
    # A few large objects, then many small ones (leaves, pebbles, print):
    # photographs are full of small edges, and these set much of the file size.
    n_large, n_small = int(rng.integers(2, 9)), int(rng.integers(10, 80))
    for k in range(n_large + n_small):
        grey = rng.uniform(40, 215)
        colour = tuple(int(grey + c) for c in rng.normal(0, 30, 3).clip(-40, 40))
        scale = (0.1, 0.5) if k < n_large else (0.01, 0.06)
        draw_shape(rng, w, h, layers, (colour, 255), scale, bands=k < n_large)
    radius = float(rng.uniform(0.0, 2.5))
    if radius > 0.3:
        paint = paint.filter(ImageFilter.GaussianBlur(radius))
        mask = mask.filter(ImageFilter.GaussianBlur(radius))
    alpha = np.asarray(mask, dtype=np.float32)[..., None] * np.float32(1 / 255)
    shade = colour_field(rng, w, h, np.zeros(3)) * np.float32(rng.uniform(0.3, 0.8))
    objects = np.asarray(paint, dtype=np.float32) + shade
    img = background + alpha * (objects - background)
    # Fine texture (grain, fabric, foliage): full-resolution 1/f noise on the
    # luminance, strength varying per image as sharpness does between photos.
    grain = pink_noise(rng, h, w, rng.uniform(0.2, 0.5))
    img += grain[..., None] * np.float32(rng.uniform(8.0, 18.0))
    return Image.fromarray(np.clip(img + 0.5, 0, 255).astype(np.uint8), mode="RGB")


def _work(job: tuple[int, int, int, str]) -> tuple[int, int, int, int]:
    seed, index, label, path = job
    im = make_image(seed, index, label)
    im.save(path, format="JPEG", quality=QUALITY)
    return index, im.width, im.height, os.path.getsize(path)


def _load_manifest(out: Path) -> dict | None:
    try:
        return json.loads((out / "manifest.json").read_text())
    except (OSError, ValueError):
        return None


def _as_set(out: Path, manifest: dict) -> SyntheticSet:
    files = manifest["files"]
    return SyntheticSet(
        root=out,
        samples=[(str(out / rel), label) for rel, label, *_ in files],
        classes=manifest["classes"],
        mean_bytes=float(np.mean([f[4] for f in files])),
        mean_pixels=float(np.mean([f[2] * f[3] for f in files])),
        mean_width=float(np.mean([f[2] for f in files])),
        mean_height=float(np.mean([f[3] for f in files])),
    )


def ensure_synthetic_set(
    count: int = 2000,
    seed: int = 0,
    out: Path | None = None,
    processes: int | None = None,
    verbose: bool = True,
) -> SyntheticSet:
    """Returns the cached set, generating it first if needed."""
    out = Path(out) if out is not None else DEFAULT_ROOT / f"synthetic-{count}"
    manifest = _load_manifest(out)
    if (
        manifest is not None
        and manifest.get("version") == GENERATOR_VERSION
        and manifest.get("count") == count
        and manifest.get("seed") == seed
        and all((out / f[0]).is_file() for f in manifest["files"])
    ):
        return _as_set(out, manifest)

    if out.exists():
        shutil.rmtree(out)  # stale or partial: this directory is ours alone
    classes = [f"class_{c:02d}" for c in range(N_CLASSES)]
    for c in classes:
        (out / c).mkdir(parents=True, exist_ok=True)
    rels = [f"{classes[i % N_CLASSES]}/img_{i:05d}.jpg" for i in range(count)]
    jobs = [(seed, i, i % N_CLASSES, str(out / rels[i])) for i in range(count)]
    processes = processes or len(os.sched_getaffinity(0))
    t0 = time.perf_counter()
    # spawn, not fork: the caller may have torch (and its thread pools) loaded.
    with mp.get_context("spawn").Pool(processes) as pool:
        results = sorted(pool.imap_unordered(_work, jobs, chunksize=16))
    files = [[rels[i], i % N_CLASSES, w, h, nbytes] for i, w, h, nbytes in results]
    # ImageFolder order: by class folder, then by file name.
    files.sort(key=lambda f: f[0])
    manifest = {
        "version": GENERATOR_VERSION,
        "count": count,
        "seed": seed,
        "quality": QUALITY,
        "classes": classes,
        "files": files,
    }
    (out / "manifest.json").write_text(json.dumps(manifest) + "\n")  # last: marks it complete
    ds = _as_set(out, manifest)
    if verbose:
        print(
            f"generated {count} JPEGs in {out} in {time.perf_counter() - t0:.1f} s "
            f"({processes} processes): mean {ds.mean_bytes / 1e3:.1f} KB, "
            f"mean {ds.mean_width:.0f}x{ds.mean_height:.0f} px"
        )
    return ds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="default build/bench-data/synthetic-<count>")
    parser.add_argument("--processes", type=int)
    args = parser.parse_args()
    ds = ensure_synthetic_set(args.count, args.seed, args.out, args.processes)
    print(
        f"{len(ds.samples)} images in {ds.root}: mean {ds.mean_bytes / 1e3:.1f} KB, "
        f"mean {ds.mean_pixels / 1e3:.0f} kpixels ({ds.mean_width:.0f}x{ds.mean_height:.0f}), "
        f"{ds.mean_bytes * 8 / ds.mean_pixels:.2f} bits/pixel"
    )


if __name__ == "__main__":
    main()
