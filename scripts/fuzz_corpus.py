"""Seed corpora for the libFuzzer targets: for fuzz/fuzz_multicrop.cpp,
small images in every format and colour mode the loader meets, each prefixed
with the mode byte the target reads first (photometric on/off, DCT scaling
on/off); with --tar, for fuzz/fuzz_tar.cpp, shards in the WebDataset layout
in every tar header format (ustar, GNU, pax; long names, links, directories,
labels) and damaged ones.

    python scripts/fuzz_corpus.py [--tar] DIR
"""

import io
import sys
import tarfile
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


def tars() -> dict[str, bytes]:
    jpeg = images()["baseline.jpg"]
    out = {}
    for fmt, label in (
        (tarfile.USTAR_FORMAT, "ustar"),
        (tarfile.GNU_FORMAT, "gnu"),
        (tarfile.PAX_FORMAT, "pax"),
    ):
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=fmt) as tar:

            def add(name, data, kind=tarfile.REGTYPE, tar=tar):
                info = tarfile.TarInfo(name)
                info.type, info.size = kind, len(data) if kind == tarfile.REGTYPE else 0
                tar.addfile(info, io.BytesIO(data) if kind == tarfile.REGTYPE else None)

            add("dir", b"", tarfile.DIRTYPE)
            add("000001.jpg", jpeg)
            add("000001.cls", b"7\n")
            add("dir/000002.png", jpeg[:100])
            add("000003.cls", b"not a number")
            if fmt != tarfile.USTAR_FORMAT:
                add("long/" + "n" * 150 + ".webp", b"RIFF....WEBP")
            add("link.jpg", b"", tarfile.SYMTYPE)
        data = buf.getvalue()
        out[f"{label}.tar"] = data
        out[f"{label}-cut.tar"] = data[: len(data) // 3]
    return out


def main(dst: str, tar: bool = False) -> None:
    root = Path(dst)
    root.mkdir(parents=True, exist_ok=True)
    if tar:
        for name, data in tars().items():
            (root / name).write_bytes(data)
        return
    for name, data in images().items():
        for mode in range(4):
            (root / f"{mode}-{name}").write_bytes(bytes([mode]) + data)


if __name__ == "__main__":
    args = sys.argv[1:]
    main(args[-1], tar="--tar" in args)
