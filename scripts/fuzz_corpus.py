"""Seed corpora for the libFuzzer targets: for fuzz/fuzz_multicrop.cpp,
small images in every format and colour mode the loader meets, each prefixed
with the mode byte the target reads first (photometric on/off, DCT scaling
on/off), and images that are not 8-bit RGB (8- and 16-bit PNG and TIFF of 1
to 6 channels, ``.npy`` arrays of uint8, uint16 and float32, a few damaged)
prefixed with the native mode's bytes (``image_mode="native"``, the data
set's layout the image's own or another); with --tar, for fuzz/fuzz_tar.cpp,
shards in the WebDataset layout in every tar header format (ustar, GNU, pax;
long names, links, directories, labels) and damaged ones.

    python scripts/fuzz_corpus.py [--tar] DIR
"""

import io
import struct
import sys
import tarfile
import zlib
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


def png(a: np.ndarray) -> bytes:
    """An (H, W, C) uint8 or uint16 array as a PNG of C = 1 to 4 channels
    (Pillow writes no 16-bit PNG of more than one channel)."""
    h, w, c = a.shape
    colour = {1: 0, 2: 4, 3: 2, 4: 6}[c]
    rows = a.astype(a.dtype.newbyteorder(">")).reshape(h, -1).view(np.uint8)
    raw = b"".join(b"\0" + row.tobytes() for row in rows)

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    header = struct.pack(">IIBBBBB", w, h, 8 * a.itemsize, colour, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(raw))
        + chunk(b"IEND", b"")
    )


def tiff(a: np.ndarray) -> bytes:
    """An (H, W, C) uint8 or uint16 array as an uncompressed little-endian
    TIFF (one strip, chunky), any C: RGB for 3 and 4 (alpha), else grey
    (MinIsBlack, which OpenCV reads for one channel only)."""
    h, w, c = a.shape
    data = a.astype(a.dtype.newbyteorder("<")).tobytes()
    bits = 8 * a.itemsize
    # (tag, type: 3 SHORT / 4 LONG, count, value); 258 and 273 are filled in below.
    tags = [[256, 4, 1, w], [257, 4, 1, h], [258, 3, c, bits], [259, 3, 1, 1]]
    tags += [[262, 3, 1, 2 if c in (3, 4) else 1], [273, 4, 1, 0], [277, 3, 1, c]]
    tags += [[278, 4, 1, h], [279, 4, 1, len(data)], [284, 3, 1, 1]]
    if c == 4:
        tags.append([338, 3, 1, 2])  # ExtraSamples: unassociated alpha
    ifd = 8
    extra = ifd + 2 + 12 * len(tags) + 4  # BitsPerSample's values when they do not fit
    tags[2][3] = bits if c <= 2 else extra
    tags[5][3] = extra + (2 * c if c > 2 else 0)
    out = b"II" + struct.pack("<HI", 42, ifd) + struct.pack("<H", len(tags))
    for tag, kind, count, value in tags:
        if tag == 258 and c == 2:
            packed = struct.pack("<HH", bits, bits)
        elif kind == 3 and count == 1:
            packed = struct.pack("<HH", value, 0)
        else:
            packed = struct.pack("<I", value)
        out += struct.pack("<HHI", tag, kind, count) + packed
    out += struct.pack("<I", 0)
    if c > 2:
        out += struct.pack(f"<{c}H", *([bits] * c))
    return out + data


def npy(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, a)
    return buf.getvalue()


def raw_images() -> dict[str, bytes]:
    """Images the native mode reads at their depth and channel count."""
    rng = np.random.default_rng(1)
    y, x = np.mgrid[0:24, 0:32]
    field = (x * 2000 + y * 700).astype(np.uint16)

    def stack(c: int, dtype) -> np.ndarray:
        a = np.stack([np.roll(field, 5 * k, axis=1) for k in range(c)], axis=-1)
        a[4:12, 8:20] = rng.integers(0, 65535, (8, 12, c))
        return a if dtype == np.uint16 else (a >> 8).astype(np.uint8)

    out = {}
    for c in (1, 2, 3, 4):
        out[f"u16-{c}.png"] = png(stack(c, np.uint16))
        out[f"u8-{c}.png"] = png(stack(c, np.uint8))
    for c in (1, 2, 3, 4, 6):
        out[f"u16-{c}.tiff"] = tiff(stack(c, np.uint16))
    out["u8-5.tiff"] = tiff(stack(5, np.uint8))
    out["u8-1.npy"] = npy(stack(1, np.uint8))
    out["u16-2d.npy"] = npy(field)
    out["u16-4.npy"] = npy(stack(4, np.uint16))
    out["f32-13.npy"] = npy((stack(13, np.uint16) / 65535).astype(np.float32))
    out["f32-nan.npy"] = npy(np.array([[[np.nan, np.inf], [-np.inf, 1e30]]], np.float32))
    out["u16-be.npy"] = npy(stack(2, np.uint16).astype(">u2"))
    out["u16-fortran.npy"] = npy(np.asfortranarray(stack(3, np.uint16)))
    out["u16-3-cut.png"] = out["u16-3.png"][: len(out["u16-3.png"]) // 2]
    out["u16-6-cut.tiff"] = out["u16-6.tiff"][:200]
    out["f32-cut.npy"] = out["f32-13.npy"][:300]
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
    # Native mode (bit 2), the declared layout the image's own or not (bit 3).
    for name, data in raw_images().items():
        for mode in (4, 5, 7, 13):
            (root / f"{mode}-{name}").write_bytes(bytes([mode]) + data)


if __name__ == "__main__":
    args = sys.argv[1:]
    main(args[-1], tar="--tar" in args)
