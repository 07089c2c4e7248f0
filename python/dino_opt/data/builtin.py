"""The built-in data set: synthetic shapes and textures, made by the package.

``builtin_dataset()`` gives a small labelled image data set that needs no
download, so that ``dino-opt train`` runs anywhere. It is an ImageFolder tree::

    <root>/manifest.json
    <root>/train/<class>/<class>_00000.jpg ...   (train_per_class per class)
    <root>/val/<class>/<class>_00000.jpg ...     (val_per_class per class, held out)
    <root>/test/<class>/<class>_00000.jpg ...    (test_per_class per class, held out)
    <root>/masks/<split>/<class>/<class>_00000.png ...   (one label mask per image)

``val`` is what recipes are tuned on (the demo's was); ``test`` is drawn from
other seeds and never used to choose anything, so the k-NN accuracy on it is
the honest one.

What is in it: ten classes, six silhouettes (``circle``, ``ring``, ``triangle``,
``square``, ``star``, ``cross``: five to nine instances spread over the frame,
each light or dark at random on a mid-grey background) and four textures
(``stripes``, ``checkerboard``, ``dots``, ``waves``: light and dark over the
whole frame). What varies inside each class, independently of the class:
the background (a 1/f brightness field with a smooth colour tint), the
position, size, rotation, aspect and shade of each instance, the period,
orientation and duty cycle of a texture, and additive pixel noise. Every
image spans the same range of brightness and colour; they vary inside an
image, not between images. So no global statistic (overall colour or
brightness) tells images apart, and two crops of one image agree on little
but the class: what DINO's self-distillation between crops can pick up is
shape and texture, which k-NN on its features then measures.

Why it is made so: a statistic that every crop of an image shares is what a
crop-matching objective learns first (the first version's story is in
docs/training.md, the entry of ``builtin_dataset()``).

Per-pixel labels: the generator knows every instance, so each image has a
mask (PNG, mode ``L``, the image's size) in the parallel tree ``masks/``,
outside the image splits (an ImageFolder of ``<root>/train`` sees only
images). A pixel's label is 0 (background) or ``1 +`` the index of its class
in :data:`BUILTIN_CLASSES` (1..10; :data:`BUILTIN_MASK_CLASSES` names them).
A shape image's pixel takes its class where the pixel's centre lies inside
an instance (signed distance < 0, which is where the anti-aliased edge is
more than half ink); a texture covers the whole frame, so every pixel of a
texture image takes its class.

Variants (``variant=``), the same scenes written otherwise, to show and test
images that are not 8-bit RGB (``data.image_mode: native``):

- ``gray16``: one channel, 16-bit PNG: the scene's luminance in a narrow band
  of 600 levels around 30,000 (about 2.3 levels of an 8-bit image: cut to 8
  bits, most of each picture is gone);
- ``multichannel``: six channels, uint16 ``.npy`` arrays ``(H, W, 6)``: fixed
  mixtures of the scene's red, green and blue (as spectral bands would be),
  each with its own gain, offset and noise.

Every image is a pure function of ``(seed, image stream, split, class,
index)``; JPEGs (PIL, quality 90) are byte-identical for the same parameters,
whatever the number of workers. The tree is written into a temporary
directory beside ``root`` and renamed into place, and ``manifest.json`` records
the parameters, so a call reuses a complete cache and regenerates it only when
it is missing, incomplete or made with other parameters.
"""

from __future__ import annotations

import functools
import json
import math
import multiprocessing
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
from PIL import Image

__all__ = [
    "BUILTIN_CLASSES",
    "BUILTIN_DOMAINS",
    "BUILTIN_MASK_CLASSES",
    "BUILTIN_MASKS",
    "BUILTIN_VERSION",
    "builtin_dataset",
    "default_root",
    "render_image",
    "render_image_and_mask",
    "render_variant",
    "BUILTIN_VARIANTS",
]

#: Generator version: bump it whenever the tree would change, so caches regenerate
#: (3: label masks beside the images, which are those of version 2).
BUILTIN_VERSION = 3
#: The seed of every image's random stream. It stays 2 when the version moves
#: on without changing what is drawn: the demo's committed results were
#: measured on these images (version 3 added masks, not new images).
_IMAGE_STREAM = 2
#: Class names, sorted, so that the index of a name is its ImageFolder label.
BUILTIN_CLASSES = (
    "checkerboard",
    "circle",
    "cross",
    "dots",
    "ring",
    "square",
    "star",
    "stripes",
    "triangle",
    "waves",
)
#: The second domain's classes (``domain="second"``): other silhouettes and
#: textures, in saturated colours on coloured backgrounds; sorted.
SECOND_CLASSES = (
    "arrow",
    "bricks",
    "crescent",
    "diamond",
    "ellipse",
    "grid",
    "hexagon",
    "pentagon",
    "rings",
    "zigzag",
)
#: The domains the generator makes, by name: their classes.
BUILTIN_DOMAINS = {"default": BUILTIN_CLASSES, "second": SECOND_CLASSES}
#: Names of the mask labels: 0 is the background, ``1 + i`` is ``BUILTIN_CLASSES[i]``.
BUILTIN_MASK_CLASSES = ("background", *BUILTIN_CLASSES)
#: The folder under the root that holds the masks, one tree per split.
BUILTIN_MASKS = "masks"
_SHAPES = (
    "circle",
    "ring",
    "triangle",
    "square",
    "star",
    "cross",
    "arrow",
    "crescent",
    "diamond",
    "ellipse",
    "hexagon",
    "pentagon",
)
_SPLITS = ("train", "val", "test")
_JPEG_QUALITY = 90
_GENERATOR = "dino_opt.builtin"
#: The ways the scenes are written: name -> (file extension, channels).
BUILTIN_VARIANTS = {"rgb": (".jpg", 3), "gray16": (".png", 1), "multichannel": (".npy", 6)}
# gray16: the luminance's band (levels of 65535).
_GRAY16_CENTER, _GRAY16_SPAN = 30000.0, 600.0
# multichannel: each band's weights of R, G, B, its gain and offset (of 65535), its noise.
_BANDS = np.array(
    [
        [0.9, 0.1, 0.0, 20000, 5000, 0.01],
        [0.1, 0.8, 0.1, 30000, 8000, 0.01],
        [0.0, 0.2, 0.8, 25000, 3000, 0.02],
        [0.3, 0.4, 0.3, 12000, 20000, 0.01],
        [0.6, 0.0, 0.4, 8000, 30000, 0.03],
        [0.2, 0.5, 0.3, 40000, 1000, 0.02],
    ]
)
_TASK_IMAGES = 50


def default_root() -> Path:
    """``$DINO_OPT_DATA`` if set, else ``~/.cache/dino_opt/builtin-v3``
    (``builtin-v<BUILTIN_VERSION>``)."""
    env = os.environ.get("DINO_OPT_DATA")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "dino_opt" / f"builtin-v{BUILTIN_VERSION}"


# ---------------------------------------------------------------- rendering


def _polygon_sdf(px: np.ndarray, py: np.ndarray, vertices: np.ndarray) -> np.ndarray:
    """Signed distance from points to a closed polygon (negative inside):
    distance to the nearest edge, sign from the even-odd crossing rule."""
    dist2 = np.full(px.shape, np.inf)
    inside = np.zeros(px.shape, dtype=bool)
    m = len(vertices)
    for i in range(m):
        ax, ay = vertices[i]
        bx, by = vertices[(i + 1) % m]
        ex, ey = bx - ax, by - ay
        wx, wy = px - ax, py - ay
        h = np.clip((wx * ex + wy * ey) / (ex * ex + ey * ey), 0.0, 1.0)
        dist2 = np.minimum(dist2, (wx - ex * h) ** 2 + (wy - ey * h) ** 2)
        crosses = (ay > py) != (by > py)
        with np.errstate(divide="ignore", invalid="ignore"):
            x_at = ax + ex * (py - ay) / ey
        inside ^= crosses & (px < x_at)
    d = np.sqrt(dist2)
    return np.where(inside, -d, d)


def _regular(n: int, radius: float, phase: float = math.pi / 2) -> np.ndarray:
    a = phase + 2 * math.pi * np.arange(n) / n
    return np.stack([radius * np.cos(a), radius * np.sin(a)], axis=1)


def _star(points: int, outer: float, inner: float) -> np.ndarray:
    a = math.pi / 2 + math.pi * np.arange(2 * points) / points
    r = np.where(np.arange(2 * points) % 2 == 0, outer, inner)
    return np.stack([r * np.cos(a), r * np.sin(a)], axis=1)


def _cross(arm: float, half_width: float) -> np.ndarray:
    a, w = arm, half_width
    return np.array(
        [(w, w), (a, w), (a, -w), (w, -w), (w, -a), (-w, -a), (-w, -w), (-a, -w), (-a, w), (-w, w)]
        + [(-w, a), (w, a)]
    )


def _shape_sdf(name: str, u: np.ndarray, v: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Signed distance (in units of the instance radius) to one shape in its
    own frame; sizes are chosen so that all shapes have a similar area."""
    if name == "circle":
        return np.hypot(u, v) - 0.95
    if name == "ring":
        w = rng.uniform(0.14, 0.24)  # half thickness: the hole stays clearly visible
        return np.abs(np.hypot(u, v) - (1.0 - w)) - w
    if name == "triangle":
        return _polygon_sdf(u, v, _regular(3, 1.15))
    if name == "square":
        return _polygon_sdf(u, v, _regular(4, 1.15, math.pi / 4))
    if name == "star":
        return _polygon_sdf(u, v, _star(5, 1.15, rng.uniform(0.42, 0.52)))
    if name == "cross":
        return _polygon_sdf(u, v, _cross(1.0, rng.uniform(0.26, 0.36)))
    return _second_shape_sdf(name, u, v, rng)


_ARROW = np.array(
    [
        (0, 1.2),
        (0.85, 0.25),
        (0.32, 0.25),
        (0.32, -1.1),
        (-0.32, -1.1),
        (-0.32, 0.25),
        (-0.85, 0.25),
    ]
)
_DIAMOND = np.array([(0, 1.35), (0.62, 0), (0, -1.35), (-0.62, 0)])


def _second_shape_sdf(name: str, u: np.ndarray, v: np.ndarray, rng: np.random.Generator):
    """The second domain's silhouettes (distances approximate for the ellipse)."""
    if name == "pentagon":
        return _polygon_sdf(u, v, _regular(5, 1.1))
    if name == "hexagon":
        return _polygon_sdf(u, v, _regular(6, 1.05))
    if name == "diamond":
        return _polygon_sdf(u, v, _DIAMOND)
    if name == "arrow":
        return _polygon_sdf(u, v, _ARROW)
    if name == "ellipse":
        return (np.hypot(u / 1.3, v / 0.68) - 1.0) * 0.68
    if name == "crescent":
        bite = rng.uniform(0.4, 0.55)
        return np.maximum(np.hypot(u, v) - 1.05, 0.85 - np.hypot(u - bite, v))
    raise ValueError(f"unknown shape {name!r}")


@functools.lru_cache(maxsize=8)
def _log_frequency(size: int) -> np.ndarray:
    fy = np.fft.fftfreq(size)[:, None]
    fx = np.fft.rfftfreq(size)[None, :]
    f = np.hypot(fx, fy)
    f[0, 0] = 1.0
    return np.log(f)


@functools.lru_cache(maxsize=8)
def _pixel_grid(size: int) -> tuple[np.ndarray, np.ndarray]:
    y, x = np.mgrid[0:size, 0:size].astype(np.float32) + np.float32(0.5)  # pixel centres
    x.flags.writeable = False
    y.flags.writeable = False
    return x, y


def _smooth_noise(rng: np.random.Generator, size: int) -> np.ndarray:
    """A 1/f^a random field in [0, 1] (a in [1.3, 2.2]: clouds, not grain),
    drawn directly in the frequency domain (white complex noise times the
    power law; irfft2 keeps the Hermitian part, so the field is real)."""
    log_f = _log_frequency(size)
    white = rng.standard_normal((2, *log_f.shape))
    spectrum = (white[0] + 1j * white[1]) * np.exp(-rng.uniform(1.3, 2.2) * log_f)
    spectrum[0, 0] = 0.0
    field = np.fft.irfft2(spectrum, s=(size, size))
    lo, hi = field.min(), field.max()
    return ((field - lo) / max(hi - lo, 1e-12)).astype(np.float32)


def _vivid_field(rng: np.random.Generator, size: int) -> np.ndarray:
    """The second domain's backgrounds: a darker 1/f brightness field
    (0.2 to 0.5) under a strong smooth tint per channel (+-0.25)."""
    brightness = 0.2 + 0.3 * _smooth_noise(rng, size)
    tint = np.stack([_smooth_noise(rng, size) for _ in range(3)], axis=-1) - 0.5
    return np.clip(brightness[..., None] + 0.5 * tint, 0.0, 1.0)


def _vivid_ink(rng: np.random.Generator) -> np.ndarray:
    """A saturated colour of any hue (HSV: saturation 0.7-1, value 0.6-1)."""
    h, sat, val = rng.uniform(0, 6), rng.uniform(0.7, 1.0), rng.uniform(0.6, 1.0)
    rgb = np.clip(np.abs(np.mod(h + np.array([0.0, 4.0, 2.0]), 6) - 3) - 1, 0, 1)
    return (val * (1 - sat + sat * rgb)).astype(np.float32)


def _colour_field(rng: np.random.Generator, size: int) -> np.ndarray:
    """``[size, size, 3]`` background colours: a 1/f field of brightness
    that spans the same range (0.3 to 0.7) in every image, tinted by a
    smooth field per channel (+-0.1). Every image has about the same overall
    brightness and colour; they vary inside an image instead. So no global
    statistic tells one image from another, and two crops of an image share
    little but its class (a model trained on crops of images that differ in
    overall colour learns colour first)."""
    brightness = 0.3 + 0.4 * _smooth_noise(rng, size)
    tint = np.stack([_smooth_noise(rng, size) for _ in range(3)], axis=-1) - 0.5
    return np.clip(brightness[..., None] + 0.2 * tint, 0.0, 1.0)


def _ink(rng: np.random.Generator) -> np.ndarray:
    """An instance's colour: light or dark at random (the background lies in
    between), mildly tinted, so every instance stands out by its shape."""
    level = rng.uniform(0.82, 0.97) if rng.uniform() < 0.5 else rng.uniform(0.03, 0.18)
    return np.clip(level + rng.uniform(-0.06, 0.06, 3), 0.0, 1.0).astype(np.float32)


def _sharpen(s: np.ndarray, period_px: float, offset: float) -> np.ndarray:
    """Turn a periodic wave in [-1, 1] into a near-binary pattern whose edges
    are about one pixel wide (anti-aliased at any period)."""
    return np.clip(0.5 + (s - offset) * (period_px / (2 * math.pi)), 0.0, 1.0)


def _texture(name: str, rng: np.random.Generator, x: np.ndarray, y: np.ndarray, size: int):
    period = rng.uniform(0.07, 0.16) * size  # pixels
    a = rng.uniform(0, math.pi)
    u = math.cos(a) * x + math.sin(a) * y
    v = -math.sin(a) * x + math.cos(a) * y
    k = 2 * math.pi / period
    if name == "stripes":
        return _sharpen(np.sin(k * u), period, rng.uniform(-0.3, 0.3))
    if name == "checkerboard":
        return _sharpen(np.sin(k * u) * np.sin(k * v), period, 0.0)
    if name == "waves":
        amplitude = rng.uniform(0.35, 0.7) * period
        wavelength = rng.uniform(2.0, 4.0) * period
        s = np.sin(k * (u + amplitude * np.sin(2 * math.pi * v / wavelength)))
        return _sharpen(s, period, rng.uniform(-0.3, 0.3))
    if name == "dots":
        du = (u / period - np.round(u / period)) * period
        dv = (v / period - np.round(v / period)) * period
        radius = rng.uniform(0.2, 0.34) * period
        return np.clip(radius - np.hypot(du, dv) + 0.5, 0.0, 1.0)
    return _second_texture(name, rng, u, v, (x, y, size, period, k))


def _second_texture(name: str, rng: np.random.Generator, u, v, frame: tuple) -> np.ndarray:
    """The second domain's textures, in the rotated frame ``(u, v)``."""
    x, y, size, period, k = frame
    if name == "grid":  # thin lines both ways
        return np.maximum(
            _sharpen(np.cos(k * u), period, 0.6), _sharpen(np.cos(k * v), period, 0.6)
        )
    if name == "rings":  # concentric around a point anywhere in the frame
        cx, cy = rng.uniform(0, size, 2)
        return _sharpen(np.sin(k * np.hypot(x - cx, y - cy)), period, rng.uniform(-0.3, 0.3))
    if name == "zigzag":
        t = v / (rng.uniform(1.5, 3.0) * period)
        tri = 2 * np.abs(2 * (t - np.floor(t + 0.5))) - 1
        return _sharpen(np.sin(k * (u + rng.uniform(0.4, 0.8) * period * tri)), period, 0.0)
    if name == "bricks":  # mortar lines, the joints of every other row shifted half a brick
        row = np.floor(v / period)
        joints = np.cos(math.pi * (u / period + 0.5 * (row % 2)))
        mortar = np.maximum(
            _sharpen(np.cos(2 * math.pi * v / period), period, 0.8),
            _sharpen(joints, 2 * period, 0.9),
        )
        return 1.0 - mortar
    raise ValueError(f"unknown texture {name!r}")


def _draw_shapes(
    class_name: str, rng: np.random.Generator, img: np.ndarray, mask: np.ndarray, label: int
) -> None:
    """Draw five to nine instances of a shape into ``img`` (in place) and
    set ``mask`` to ``label`` where a pixel's centre is inside one."""
    size = img.shape[0]
    x, y = _pixel_grid(size)
    # Instances spread over the whole frame, so that nearly every crop,
    # local ones included, shows the class.
    count = int(rng.integers(5, 10))
    placed: list[tuple[float, float, float]] = []
    for _ in range(count):
        radius = rng.uniform(0.08, 0.15) * size
        for _attempt in range(24):  # instances may touch, but not hide one another
            cx, cy = rng.uniform(0.5 * radius, size - 0.5 * radius, 2)
            if all(math.hypot(cx - qx, cy - qy) > 1.05 * (radius + qr) for qx, qy, qr in placed):
                break
        else:
            continue
        placed.append((cx, cy, radius))
        theta = rng.uniform(0, 2 * math.pi)
        aspect = math.exp(rng.uniform(-0.1, 0.1))
        # Only the instance's bounding box is drawn: every shape lies within
        # 1.2 radii (times the aspect) of its centre.
        reach = 1.2 * radius * max(aspect, 1 / aspect) + 2
        y0, y1 = max(0, int(cy - reach)), min(size, int(cy + reach) + 1)
        x0, x1 = max(0, int(cx - reach)), min(size, int(cx + reach) + 1)
        dx, dy = x[y0:y1, x0:x1] - cx, y[y0:y1, x0:x1] - cy
        u = (math.cos(theta) * dx + math.sin(theta) * dy) / (radius * aspect)
        v = (-math.sin(theta) * dx + math.cos(theta) * dy) * aspect / radius
        d_px = _shape_sdf(class_name, u, v, rng) * (radius * min(aspect, 1 / aspect))
        alpha = np.clip(0.5 - d_px, 0.0, 1.0)[..., None]
        box = img[y0:y1, x0:x1]
        box += ((_vivid_ink if class_name in SECOND_CLASSES else _ink)(rng) - box) * alpha
        mask[y0:y1, x0:x1][d_px < 0] = label  # the pixel centre is inside the shape


def render_image_and_mask(
    class_name: str, rng: np.random.Generator, size: int
) -> tuple[np.ndarray, np.ndarray]:
    """One ``[size, size, 3]`` uint8 image of ``class_name`` drawn with
    ``rng`` and its ``[size, size]`` uint8 label mask (0: background,
    ``1 +`` the class's index in its domain's classes where the class is: inside a
    shape's instances, everywhere for a texture). Drawing the mask takes
    nothing from ``rng``: the image is the same as :func:`render_image`'s."""
    img, mask = _render_scene(class_name, rng, size)
    return np.clip(img * 255.0 + 0.5, 0, 255).astype(np.uint8), mask


def render_variant(
    class_name: str, rng: np.random.Generator, size: int, variant: str
) -> tuple[np.ndarray, np.ndarray]:
    """The image of ``class_name`` in ``variant`` (:data:`BUILTIN_VARIANTS`)
    and its mask: ``rgb`` as :func:`render_image_and_mask`; ``gray16`` uint16
    ``[size, size]``; ``multichannel`` uint16 ``[size, size, 6]``. The scene
    is the one ``rgb`` draws from the same ``rng``; the bands' noise comes after."""
    if variant == "rgb":
        return render_image_and_mask(class_name, rng, size)
    img, mask = _render_scene(class_name, rng, size)
    img = np.clip(img, 0.0, 1.0).astype(np.float64)
    if variant == "gray16":
        lum = img @ np.array([0.299, 0.587, 0.114])
        values = _GRAY16_CENTER + _GRAY16_SPAN * (lum - 0.5)
    elif variant == "multichannel":
        mixed = img @ _BANDS[:, :3].T
        noise = rng.standard_normal(mixed.shape) * _BANDS[:, 5]
        values = _BANDS[:, 4] + _BANDS[:, 3] * (mixed + noise)
    else:
        raise ValueError(f"variant must be one of {', '.join(BUILTIN_VARIANTS)}, got {variant!r}")
    return np.clip(np.round(values), 0, 65535).astype(np.uint16), mask


def _render_scene(class_name: str, rng: np.random.Generator, size: int):
    """The scene of ``class_name`` as float RGB (before quantisation) and its mask."""
    second = class_name in SECOND_CLASSES
    if class_name not in BUILTIN_CLASSES and not second:
        raise ValueError(
            f"class_name must be one of {BUILTIN_CLASSES + SECOND_CLASSES}, got {class_name!r}"
        )
    label = 1 + (SECOND_CLASSES if second else BUILTIN_CLASSES).index(class_name)
    img = (_vivid_field if second else _colour_field)(rng, size)
    if class_name in _SHAPES:
        mask = np.zeros((size, size), dtype=np.uint8)
        _draw_shapes(class_name, rng, img, mask, label)
    else:
        x, y = _pixel_grid(size)
        alpha = _texture(class_name, rng, x, y, size)
        if second:  # two saturated colours
            light, dark = _vivid_ink(rng), 0.35 * _vivid_ink(rng)
        else:  # light and dark ink across the whole frame, tinted like the background
            tint = _colour_field(rng, size) - 0.5
            light, dark = 0.85 + 0.5 * tint, 0.15 + 0.5 * tint
        img = dark + (light - dark) * alpha[..., None]
        mask = np.full((size, size), label, dtype=np.uint8)
    sigma = rng.uniform(0.0, 0.04)
    img += rng.standard_normal(img.shape, dtype=np.float32) * np.float32(sigma)
    return img, mask


def render_image(class_name: str, rng: np.random.Generator, size: int) -> np.ndarray:
    """One ``[size, size, 3]`` uint8 image of ``class_name`` drawn with ``rng``."""
    return render_image_and_mask(class_name, rng, size)[0]


# ---------------------------------------------------------------- the cache


def _image_rng(seed: int, split: int, label: int, index: int) -> np.random.Generator:
    # One independent stream per image: the output does not depend on the
    # order or the process in which images are made.
    return np.random.default_rng([_IMAGE_STREAM, seed, split, label, index])


def _save(pixels: np.ndarray, path: Path, variant: str) -> None:
    if variant == "rgb":
        Image.fromarray(pixels).save(path, "JPEG", quality=_JPEG_QUALITY)
    elif variant == "gray16":
        Image.fromarray(pixels).save(path, "PNG")  # uint16 [H, W]: mode I;16
    else:
        np.save(path, pixels)


def _write_images(task: tuple[str, int, int, int, int, int, int, str, str]) -> int:
    """Render and save images ``start..stop-1`` of one class of one split
    and their masks; returns the number of images."""
    out_dir, seed, split, label, start, stop, size, domain, variant = task
    ext = BUILTIN_VARIANTS[variant][0]
    name = BUILTIN_DOMAINS[domain][label]
    folder = Path(out_dir) / _SPLITS[split] / name
    masks = Path(out_dir) / BUILTIN_MASKS / _SPLITS[split] / name
    folder.mkdir(parents=True, exist_ok=True)
    masks.mkdir(parents=True, exist_ok=True)
    for index in range(start, stop):
        rng = _image_rng(seed, split, label, index)
        pixels, mask = render_variant(name, rng, size, variant)
        stem = f"{name}_{index:05d}"
        _save(pixels, folder / f"{stem}{ext}", variant)
        Image.fromarray(mask).save(masks / f"{stem}.png", "PNG")  # uint8 [H, W]: mode L
    return stop - start


def _manifest(
    seed: int, image_size: int, per_class: dict[str, int], domain: str, variant: str = "rgb"
) -> dict:
    classes = BUILTIN_DOMAINS[domain]
    n = len(classes)
    return {
        **({"domain": domain} if domain != "default" else {}),
        **({"variant": variant} if variant != "rgb" else {}),
        "generator": _GENERATOR,
        "version": BUILTIN_VERSION,
        "seed": seed,
        "image_size": image_size,
        "jpeg_quality": _JPEG_QUALITY,
        **{f"{split}_per_class": count for split, count in per_class.items()},
        "counts": {split: n * count for split, count in per_class.items()},
        "classes": list(classes),
        "masks": f"{BUILTIN_MASKS}/<split>/<class>/<name>.png",
        "mask_classes": ["background", *classes],
        "mask_edge": "a pixel is its instance's class where its centre is inside the shape",
    }


def _read_manifest(root: Path) -> dict | None:
    try:
        with open(root / "manifest.json") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _is_complete(root: Path, manifest: dict) -> bool:
    """The manifest matches and every class folder holds its files (a cache
    that someone pruned by hand is remade rather than trusted)."""
    if _read_manifest(root) != manifest:
        return False
    for split in _SPLITS:
        per_class = manifest[f"{split}_per_class"]
        if per_class == 0:
            continue
        for name in manifest["classes"]:
            image_ext = BUILTIN_VARIANTS[manifest.get("variant", "rgb")][0]
            for folder, ext in (
                (root / split / name, image_ext),
                (root / BUILTIN_MASKS / split / name, ".png"),
            ):
                if _count_files(folder, ext) != per_class:
                    return False
    return True


def _count_files(folder: Path, ext: str) -> int:
    try:
        return sum(1 for e in os.scandir(folder) if e.name.endswith(ext))
    except OSError:
        return -1


def _check_count(name: str, value: int, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def _default_workers() -> int:
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    return max(1, min(cpus, 16))


def _generate(tasks: Sequence[tuple], workers: int) -> None:
    if workers <= 1 or len(tasks) <= 1:
        for task in tasks:
            _write_images(task)
        return
    # fork where it exists: workers start in milliseconds and only run numpy
    # and PIL code; elsewhere spawn (macOS, Windows), where fork is unsafe.
    method = "fork" if sys.platform.startswith("linux") else "spawn"
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context(method)) as pool:
        for _ in pool.map(_write_images, tasks):
            pass


def _refuse_foreign(root: Path) -> None:
    """Raises FileExistsError when ``root`` is a file, or a folder that
    holds files but no data set made here: never overwritten."""
    if not root.exists():
        return
    if not root.is_dir():
        raise FileExistsError(f"built-in data set root {str(root)!r} is a file")
    ours = (_read_manifest(root) or {}).get("generator") == _GENERATOR
    if not ours and any(os.scandir(root)):
        raise FileExistsError(
            f"built-in data set root {str(root)!r} exists and holds other files; "
            "choose an empty or new directory (root=..., or $DINO_OPT_DATA)"
        )


def builtin_dataset(
    root: str | os.PathLike | None = None,
    train_per_class: int = 200,
    val_per_class: int = 50,
    test_per_class: int = 50,
    image_size: int = 112,
    seed: int = 0,
    num_workers: int | None = None,
    domain: str = "default",
    variant: str = "rgb",
) -> Path:
    """The built-in data set's root, generated on first use (see the module
    docstring for what it holds).

    ``root`` defaults to :func:`default_root` (``$DINO_OPT_DATA`` or
    ``~/.cache/dino_opt/builtin-v3``); ``root / "train"``, ``root / "val"``
    and ``root / "test"`` (none with ``test_per_class=0``) are ImageFolder
    trees with one folder per name in :data:`BUILTIN_CLASSES` (folder order =
    label); ``root / "masks" / split`` holds each image's label mask at the
    same relative path (``.png``). The tree is reused when its ``manifest.json``
    matches the parameters and no file is missing; otherwise it is generated
    again in ``num_workers`` processes (default: the usable CPUs) into a
    temporary directory and renamed into place. An existing ``root`` that is
    not a data set made by this function (no manifest of ours, not empty) is
    never overwritten: that raises ``FileExistsError``. ``domain="second"``
    makes the second domain instead (:data:`BUILTIN_DOMAINS`): ten other
    classes (six silhouettes, four textures) in saturated colours on coloured
    backgrounds, drawn the same way: a data set to adapt a model trained on
    the first one to. ``variant`` (:data:`BUILTIN_VARIANTS`): ``gray16`` or
    ``multichannel`` writes the same scenes as 16-bit one-channel PNGs or
    6-channel uint16 ``.npy`` arrays (the module docstring), by default
    under ``default_root()`` with ``-<variant>`` added to its name.
    """
    if domain not in BUILTIN_DOMAINS:
        raise ValueError(f"domain must be one of {', '.join(BUILTIN_DOMAINS)}, got {domain!r}")
    if variant not in BUILTIN_VARIANTS:
        raise ValueError(f"variant must be one of {', '.join(BUILTIN_VARIANTS)}, got {variant!r}")
    train_per_class = _check_count("train_per_class", train_per_class, 1)
    val_per_class = _check_count("val_per_class", val_per_class, 1)
    test_per_class = _check_count("test_per_class", test_per_class, 0)
    image_size = _check_count("image_size", image_size, 16)
    seed = _check_count("seed", seed, 0)
    workers = (
        _default_workers() if num_workers is None else _check_count("num_workers", num_workers, 0)
    )
    if root is None:
        root = default_root()
        root = root if variant == "rgb" else root.with_name(f"{root.name}-{variant}")
    root = Path(root).expanduser()
    per_class = {"train": train_per_class, "val": val_per_class, "test": test_per_class}
    manifest = _manifest(seed, image_size, per_class, domain, variant)

    if _is_complete(root, manifest):
        return root
    _refuse_foreign(root)
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{root.name}.tmp-", dir=root.parent))
    try:
        # Tasks of at most _TASK_IMAGES images, so that workers stay busy to the end.
        tasks = [
            (
                str(tmp),
                seed,
                split,
                label,
                start,
                min(start + _TASK_IMAGES, count),
                image_size,
                domain,
                variant,
            )
            for split, count in enumerate(per_class.values())
            for label in range(len(BUILTIN_DOMAINS[domain]))
            for start in range(0, count, _TASK_IMAGES)
        ]
        _generate(tasks, workers)
        # The manifest is written last: a tree without one is never trusted.
        with open(tmp / "manifest.json", "w") as f:
            json.dump(manifest, f, indent=2)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        _install(tmp, root, manifest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return root


def _install(tmp: Path, root: Path, manifest: dict) -> None:
    """Rename the finished tree onto ``root``; an old tree (ours, checked by
    the caller) is moved aside first and removed after."""
    old = None
    if root.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{root.name}.old-", dir=root.parent))
        os.replace(root, old / "tree")
    try:
        os.rename(tmp, root)
    except OSError:
        # Another process installed a tree in between; keep it if it is the
        # one we were making, else the error is real.
        if not _is_complete(root, manifest):
            raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
