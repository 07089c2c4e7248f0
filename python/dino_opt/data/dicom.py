"""DICOM in, once: ``dino-opt prepare SRC DST --format dicom``.

pydicom reads each file (``pip install 'dino_opt[dicom]'``); its pixels are
written as ``.npy`` arrays (float32, the default) or 16-bit PNGs, so that
training reads them natively (``data.image_mode: native``) and never parses
DICOM again. Per file: the stored values, MONOCHROME1 inverted within the
stored bits (so that higher is brighter, as MONOCHROME2), the modality LUT or
rescale slope and intercept applied (pydicom's ``apply_rescale``: Hounsfield
units for CT), then optionally a window (``center, width``, or each file's own
``WindowCenter`` / ``WindowWidth``) mapping ``[center - width / 2, center +
width / 2]`` onto [0, 1] (clipped). A multi-frame file gives one image per
frame (``NAME_f0000.npy``, ...). The folder layout (class folders) is kept.
Unreadable files, files that are not DICOM and compressed pixel data without
a decoder are named and counted, never fatal for the others. The layout,
the per-channel mean and std of what was written and the window go into
``DST/channel_stats.json``, which the loader reads (:mod:`~dino_opt.data.channels`).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from ..ops.native import _C
from .channels import ImageLayout, channel_stats, write_stats_file
from .sources import open_source

__all__ = ["dicom_pixels", "parse_window", "prepare_dicom"]

_DICOM_SUFFIXES = (".dcm", ".dicom")


def parse_window(spec: str | None) -> tuple[float, float] | str | None:
    """``--window``: None or "none" (no window), "file" (each file's own),
    or "CENTER,WIDTH" (numbers, WIDTH > 0). ValueError naming it otherwise."""
    if spec is None or spec == "none":
        return None
    if spec == "file":
        return "file"
    try:
        center, width = (float(v) for v in spec.split(","))
    except ValueError:
        raise ValueError(f"--window must be none, file or CENTER,WIDTH, got {spec!r}") from None
    if not width > 0:
        raise ValueError(f"--window width must be > 0, got {width:g}")
    return center, width


def _file_window(ds) -> tuple[float, float]:
    center, width = ds.get("WindowCenter"), ds.get("WindowWidth")
    if center is None or width is None:
        raise ValueError("no WindowCenter/WindowWidth in the file (--window file)")
    first = [
        v[0] if hasattr(v, "__len__") and not isinstance(v, str) else v for v in (center, width)
    ]
    return float(first[0]), float(first[1])


def dicom_pixels(ds, window=None) -> np.ndarray:
    """The frames ``[F, H, W, C]`` of dataset ``ds`` as float32: stored
    values, MONOCHROME1 inverted within the stored bits, the modality LUT /
    rescale applied, then ``window`` (None, "file", or (center, width))."""
    import pydicom.pixels

    raw = ds.pixel_array
    frames = int(ds.get("NumberOfFrames", 1) or 1)
    samples = int(ds.get("SamplesPerPixel", 1) or 1)
    arr = raw.reshape((frames, *raw.shape[-3 if samples > 1 else -2 :]))
    if ds.get("PhotometricInterpretation", "") == "MONOCHROME1":
        bits = int(ds.get("BitsStored", arr.dtype.itemsize * 8))
        if int(ds.get("PixelRepresentation", 0)) == 1:
            arr = -1 - arr.astype(np.int64)  # two's complement: max + min - v
        else:
            arr = ((1 << bits) - 1) - arr.astype(np.int64)
    values = np.asarray(pydicom.pixels.apply_rescale(arr, ds), dtype=np.float64)
    if window is not None:
        center, width = _file_window(ds) if window == "file" else window
        lo = center - width / 2
        values = np.clip((values - lo) / width, 0.0, 1.0)
    if values.ndim == 3:
        values = values[..., None]
    return values.astype(np.float32)


def _outputs(src_root: Path, dst_root: Path, path: Path, frames: int, fmt: str) -> list[Path]:
    rel = path.relative_to(src_root)
    stem = rel.stem if rel.suffix.lower() in _DICOM_SUFFIXES else rel.name
    base = dst_root / rel.parent / stem
    if frames == 1:
        return [base.with_name(f"{base.name}.{fmt}")]
    return [base.with_name(f"{base.name}_f{i:04d}.{fmt}") for i in range(frames)]


def _encode(frame: np.ndarray, fmt: str) -> bytes:
    if fmt == "npy":
        return _C.encode_raw(torch.from_numpy(np.ascontiguousarray(frame)), "npy")
    u16 = np.round(frame * 65535.0).astype(np.uint16)
    return _C.encode_raw(torch.from_numpy(u16.view(np.int16)).view(torch.uint16), "png")


def _write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def prepare_dicom(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    output: str = "npy",
    window=None,
    num_threads: int | None = None,
    progress: bool = True,
) -> dict:
    """Every DICOM file under ``src`` (any name; others are counted as
    failed) written under ``dst`` in the same layout as ``output`` ("npy":
    float32, "png": 16-bit, which needs a window), ``window`` as
    :func:`parse_window` gives it. Returns ``{"written", "files", "failed":
    ["path: cause", ...], "layout", "mean", "std"}`` and writes
    ``channel_stats.json``; raises ValueError for bad arguments and when no
    file could be written."""
    try:
        import pydicom
    except ImportError:
        raise ImportError(
            "prepare --format dicom needs pydicom (pip install 'dino_opt[dicom]')"
        ) from None
    if output not in ("npy", "png"):
        raise ValueError(f"output must be npy or png, got {output!r}")
    if output == "png" and window is None:
        raise ValueError(
            "16-bit PNG holds [0, 1] windowed values: give --window CENTER,WIDTH or --window "
            "file, or write .npy (float32, any range)"
        )
    src_root, dst_root = Path(src), Path(dst)
    if not src_root.is_dir():
        raise FileNotFoundError(f"DICOM folder {str(src_root)!r} does not exist")
    if src_root.resolve() == dst_root.resolve():
        raise ValueError("dst must differ from src: prepare never overwrites its input")
    files = sorted(p for p in src_root.rglob("*") if p.is_file() and not p.name.startswith("."))
    if not files:
        raise ValueError(f"no files under {str(src_root)!r}")

    def run(path: Path):
        try:
            ds = pydicom.dcmread(path)
            frames = dicom_pixels(ds, window)
        except Exception as e:  # pydicom's errors are many kinds; each is one line here
            cause = " ".join(str(e).split()) or type(e).__name__
            return None, f"{path}: {type(e).__name__}: {cause}"
        outs = _outputs(src_root, dst_root, path, len(frames), output)
        outs[0].parent.mkdir(parents=True, exist_ok=True)
        for frame, out in zip(frames, outs, strict=True):
            _write(out, _encode(frame, output))
        return frames[0].shape[-1], None

    result = {"written": 0, "files": 0, "failed": []}
    channels = set()
    with ThreadPoolExecutor(num_threads or _C.available_cores()) as pool:
        bar = tqdm(total=len(files), unit="file", disable=not progress, desc="prepare")
        for got, failure in pool.map(run, files):
            if failure is not None:
                result["failed"].append(failure)
            else:
                result["files"] += 1
                channels.add(got)
            bar.update()
        bar.close()
    if result["files"] == 0:
        first = "; ".join(result["failed"][:3])
        raise ValueError(f"no DICOM file under {str(src_root)!r} could be read: {first}")
    source = open_source(dst_root)
    result["written"] = len(source)
    dtype = "float32" if output == "npy" else "uint16"
    if len(channels) != 1:
        raise ValueError(f"the DICOM files under {str(src_root)!r} mix channel counts")
    layout = ImageLayout(next(iter(channels)), dtype, source.describe(0))
    mean, std = channel_stats(source, layout, max_images=256)
    win = window if window in (None, "file") else list(window)
    counts = dict(files=result["files"], failed=len(result["failed"]))
    write_stats_file(dst_root, layout, mean, std, source="dicom", window=win, **counts)
    result.update(layout=layout.describe(), mean=mean, std=std)
    return result
