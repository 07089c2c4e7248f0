"""Seed corpus for the libFuzzer target (fuzz/fuzz_multicrop.cpp): small
images in every format and colour mode the loader meets, each prefixed with
the mode byte the target reads first (photometric on/off, DCT scaling on/off)."""

import io
import sys
from pathlib import Path

import numpy as np
from PIL import Image


def images() -> dict[str, bytes]:
    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:48, 0:64]
    rgb = np.stack([x * 4, y * 5, (x + y) * 2], axis=-1).astype(np.uint8)
    rgb[10:30, 20:40] = rng.integers(0, 255, (20, 20, 3), dtype=np.uint8)
    img = Image.fromarray(rgb)
    out = {}

    def save(name, image, fmt, **kwargs):
        buf = io.BytesIO()
        image.save(buf, fmt, **kwargs)
        out[name] = buf.getvalue()

    save("baseline.jpg", img, "JPEG", quality=90)
    save("progressive.jpg", img, "JPEG", quality=75, progressive=True)
    save("gray.jpg", img.convert("L"), "JPEG")
    save("cmyk.jpg", img.convert("CMYK"), "JPEG")
    save("tiny.jpg", img.resize((1, 1)), "JPEG")
    save("rgba.png", img.convert("RGBA"), "PNG")
    save("gray16.png", Image.fromarray((y * 1000).astype(np.uint16)), "PNG")
    save("palette.png", img.convert("P"), "PNG")
    save("image.bmp", img, "BMP")
    save("image.tiff", img, "TIFF")
    try:
        save("image.webp", img, "WEBP")
    except (KeyError, OSError):  # Pillow built without WebP
        pass
    return out


def main(dst: str) -> None:
    root = Path(dst)
    root.mkdir(parents=True, exist_ok=True)
    for name, data in images().items():
        for mode in range(4):
            (root / f"{mode}-{name}").write_bytes(bytes([mode]) + data)


if __name__ == "__main__":
    main(sys.argv[1])
