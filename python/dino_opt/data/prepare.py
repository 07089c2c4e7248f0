"""A data set re-encoded once at a bounded size (JPEG), its folder layout
kept, so that every epoch after decodes small files (``dino-opt prepare``)."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tqdm import tqdm

from ..ops.native import _C
from .sources import find_images

__all__ = ["prepare_dataset"]


def prepare_dataset(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    max_side: int = 512,
    quality: int = 90,
    num_threads: int | None = None,
    overwrite: bool = False,
    progress: bool = True,
) -> dict:
    """Re-encodes every image under ``src`` into ``dst`` (same relative path,
    extension ``.jpg``), longer side at most ``max_side`` (never enlarged),
    JPEG ``quality``. Work runs on native threads; each file is written
    atomically, and files already prepared (``dst`` newer than ``src``) are
    kept unless ``overwrite``. Unreadable files are listed, not fatal.

    Returns ``{"written", "kept", "failed": ["path: cause", ...], "bytes_in", "bytes_out"}``.
    """
    src_root, dst_root = Path(src), Path(dst)
    if src_root.resolve() == dst_root.resolve():
        raise ValueError("dst must differ from src: prepare never overwrites its input")
    if not 1 <= int(max_side):
        raise ValueError(f"max_side must be >= 1, got {max_side}")
    if not 1 <= int(quality) <= 100:
        raise ValueError(f"quality must be in [1, 100], got {quality}")
    paths, _, _ = find_images(src_root)
    jobs = []
    for path in paths:
        out = (dst_root / Path(path).relative_to(src_root)).with_suffix(".jpg")
        jobs.append((path, out))
    if len({out for _, out in jobs}) != len(jobs):
        raise ValueError("two source files map to the same output (e.g. a.png and a.jpg)")
    for out in {out.parent for _, out in jobs}:
        out.mkdir(parents=True, exist_ok=True)

    def run(job):
        path, out = job
        if not overwrite and out.exists() and out.stat().st_mtime >= os.stat(path).st_mtime:
            return "kept", path, 0
        try:
            _, _, size = _C.reencode_image(str(path), str(out), int(max_side), int(quality))
        except (ValueError, RuntimeError) as e:  # ImageError is a ValueError
            return "failed", f"{e}", 0
        return "written", path, size

    result = {"written": 0, "kept": 0, "failed": [], "bytes_in": 0, "bytes_out": 0}
    threads = num_threads or _C.available_cores()
    with ThreadPoolExecutor(threads) as pool:
        bar = tqdm(total=len(jobs), unit="img", disable=not progress, desc="prepare")
        for status, what, size in pool.map(run, jobs):
            if status == "failed":
                result["failed"].append(what)
            else:
                result[status] += 1
                if status == "written":
                    result["bytes_in"] += os.path.getsize(what)
                    result["bytes_out"] += size
            bar.update()
        bar.close()
    return result
