"""Writing tar shards in the WebDataset layout from any data source, and
checking them (``dino-opt prepare SRC DST --format shards``).

Samples are written in a shuffled order (so that every shard mixes the
classes), as ``{key}.{ext}`` with ``{key}.cls`` holding the label, into shards
of about ``shard_size_mb`` each; every shard is written to a temporary file,
fsynced and renamed, then indexed (``SHARD.tar.idx``); the class names, when
the source has them, go to ``classes.txt``. Verification reads the shards back
through the loader's own source: the same number of samples, each one's bytes
and label as written, every index equal to a fresh scan, every image decoding.
"""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from tqdm import tqdm

from ..ops.native import _C
from .sources import DataSource, index_candidates, open_source, shard_files

__all__ = ["verify_shards", "write_shards"]

_EXTENSIONS = {"JPEG": "jpg", "PNG": "png", "WebP": "webp", "BMP": "bmp", "TIFF": "tiff"}


def _ordered(pool: ThreadPoolExecutor, fn: Callable, items: Iterable, ahead: int) -> Iterator:
    """``pool.map(fn, items)`` with at most ``ahead`` results pending, so
    that a large data set does not sit in memory while the writer catches up."""
    pending = []
    for item in items:
        pending.append(pool.submit(fn, item))
        if len(pending) >= ahead:
            yield pending.pop(0).result()
    for future in pending:
        yield future.result()


def _encoded(data: DataSource, max_side: int | None, quality: int) -> Callable:
    def run(index: int):
        try:
            raw = data.read(index)  # its errors name the sample
        except (ValueError, RuntimeError) as e:
            return index, None, str(e), 0
        try:
            if max_side is not None:
                return index, _C.reencode_bytes(raw, int(max_side), int(quality)), "jpg", len(raw)
            fmt, _, _ = _C.probe_image(raw)
            return index, raw, _EXTENSIONS[fmt], len(raw)
        except (ValueError, RuntimeError, KeyError) as e:  # ImageError, SourceError
            return index, None, f"{data.describe(index)}: {e}", 0

    return run


class _ShardWriter:
    """Shards of about ``limit`` bytes, each written atomically and indexed."""

    def __init__(self, dst: Path, prefix: str, limit: int):
        self.dst, self.prefix, self.limit = dst, prefix, limit
        self.paths: list[str] = []
        self._file = self._tar = None

    def add(self, key: str, ext: str, data: bytes, label: int) -> None:
        if self._tar is None:
            path = self.dst / f"{self.prefix}-{len(self.paths):06d}.tar"
            self.paths.append(str(path))
            self._file = open(f"{path}.tmp{os.getpid()}", "wb")  # noqa: SIM115 (closed in _close)
            self._tar = tarfile.open(fileobj=self._file, mode="w", format=tarfile.PAX_FORMAT)
        self._member(f"{key}.{ext}", data)
        if label >= 0:
            self._member(f"{key}.cls", str(label).encode())
        if self._file.tell() >= self.limit:
            self._close()

    def _member(self, name: str, data: bytes) -> None:
        info = tarfile.TarInfo(name)
        info.size, info.mode = len(data), 0o644  # mtime, uid, gid 0: the same bytes every time
        self._tar.addfile(info, io.BytesIO(data))

    def _close(self) -> None:
        path = self.paths[-1]
        self._tar.close()
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        os.replace(self._file.name, path)
        _C.index_shard(path, path + ".idx")
        self._file = self._tar = None

    def finish(self) -> None:
        if self._tar is not None:
            self._close()

    def abandon(self) -> None:
        if self._file is not None:
            self._file.close()
            Path(self._file.name).unlink(missing_ok=True)


def _clear_shards(out: Path, prefix: str, overwrite: bool) -> None:
    """The folder ``out`` made, and its shards named ``prefix-*`` (and
    their index files) removed; FileExistsError when it holds some and
    ``overwrite`` is off."""
    out.mkdir(parents=True, exist_ok=True)
    old = sorted(out.glob(f"{prefix}-*.tar"))
    if old and not overwrite:
        raise FileExistsError(
            f"{str(out)!r} already holds shards ({old[0].name}, ...); overwrite them with "
            "overwrite=True (--overwrite)"
        )
    for path in old:
        path.unlink()
        Path(f"{path}.idx").unlink(missing_ok=True)


def write_shards(
    source,
    dst: str | os.PathLike,
    *,
    shard_size_mb: float = 256.0,
    max_side: int | None = None,
    quality: int = 90,
    prefix: str = "shard",
    seed: int = 0,
    shuffle: bool = True,
    num_threads: int | None = None,
    overwrite: bool = False,
    verify: bool = True,
    progress: bool = True,
    source_format: str = "auto",
) -> dict:
    """Writes every sample of ``source`` (anything
    :func:`~dino_opt.data.open_source` opens) into tar shards under ``dst``.

    ``max_side``: re-encode each image as JPEG (``quality``) with its longer
    side at most this (never enlarged); None keeps the bytes as they are.
    ``shuffle``: the samples in a random order drawn from ``seed``. Unreadable
    samples are listed, not fatal. ``verify`` reads everything back (see
    :func:`verify_shards`) and compares it with what was written.

    Returns ``{"shards": [paths], "written", "failed": ["name: cause", ...],
    "bytes_in", "bytes_out", "verified"}``. Raises ``FileExistsError`` when
    ``dst`` already holds shards named ``prefix-*`` (unless ``overwrite``).
    """
    if not shard_size_mb > 0:
        raise ValueError(f"shard_size_mb must be > 0, got {shard_size_mb}")
    if max_side is not None and int(max_side) < 1:
        raise ValueError(f"max_side must be >= 1, got {max_side}")
    if not 1 <= int(quality) <= 100:
        raise ValueError(f"quality must be in [1, 100], got {quality}")
    data = open_source(source, format=source_format)
    out = Path(dst)
    _clear_shards(out, prefix, overwrite)
    n = len(data)
    order = np.random.default_rng(seed).permutation(n) if shuffle else np.arange(n)
    writer = _ShardWriter(out, prefix, int(shard_size_mb * 1e6))
    result = {"written": 0, "failed": [], "bytes_in": 0, "bytes_out": 0}
    expected: list[tuple[bytes, int]] = []  # (sha1, label) of each written sample, in order
    threads = num_threads or _C.available_cores()
    try:
        with ThreadPoolExecutor(threads) as pool:
            bar = tqdm(total=n, unit="img", disable=not progress, desc="shards")
            for index, encoded, ext, size_in in _ordered(
                pool, _encoded(data, max_side, quality), (int(i) for i in order), 8 * threads
            ):
                bar.update()
                if encoded is None:
                    result["failed"].append(ext)
                    continue
                label = data.label(index)
                writer.add(f"{result['written']:09d}", ext, encoded, label)
                expected.append((hashlib.sha1(encoded).digest(), label))
                result["written"] += 1
                result["bytes_in"] += size_in
                result["bytes_out"] += len(encoded)
            bar.close()
        writer.finish()
    except BaseException:
        writer.abandon()
        raise
    if data.classes:
        tmp = out / f"classes.txt.tmp{os.getpid()}"
        tmp.write_text("".join(f"{c}\n" for c in data.classes))
        os.replace(tmp, out / "classes.txt")
    result["shards"] = writer.paths
    result["verified"] = False
    if verify and writer.paths:
        check = verify_shards(writer.paths, num_threads=threads, expected=expected)
        if check["failed"]:
            raise ValueError("the written shards do not verify: " + "; ".join(check["failed"][:5]))
        result["verified"] = True
    return result


def _index_problems(shards, index_dir) -> list[str]:
    """Each shard's index file as it was before anything opened it, against
    a fresh scan of the shard."""
    problems = []
    for path in shard_files(shards):
        found = [c for c in index_candidates(path, index_dir) if os.path.exists(c)]
        if not found:
            problems.append(f"{path}: no index file")
            continue
        stored = _C.read_shard_index(found[0])
        st = os.stat(path)
        if stored is None:
            problems.append(f"{path}: its index {found[0]} is unreadable (corrupt or truncated)")
        elif (stored[0], stored[1]) != (st.st_size, st.st_mtime_ns) or stored[2] != _C.index_shard(
            path
        ):
            problems.append(f"{path}: its index {found[0]} does not match the shard")
    return problems


def verify_shards(
    shards,
    *,
    num_threads: int | None = None,
    expected: list[tuple[bytes, int]] | None = None,
    progress: bool = False,
    index_dir: str | os.PathLike | None = None,
) -> dict:
    """Checks tar shards (a folder, pattern or list, as
    :func:`~dino_opt.data.open_source` takes them): each shard's index file
    (beside it, or in ``index_dir`` / the cache folder) equals a fresh scan
    of the shard, every image decodes, and with ``expected`` (``(sha1,
    label)`` per sample, in order) every sample's bytes and label are those.
    Returns ``{"shards", "samples", "failed": [...]}``; a shard that cannot
    be read at all raises as ``open_source`` does."""
    failed = _index_problems(shards, index_dir)
    data = open_source(shards, format="shards", index_dir=index_dir)
    native = data.native
    if expected is not None and len(expected) != len(data):
        failed.append(f"{len(data)} samples in the shards, {len(expected)} written")

    def check(i: int) -> str | None:
        try:
            raw = data.read(i)  # its errors name the sample
        except (ValueError, RuntimeError) as e:
            return str(e)
        try:
            _C.decode_image(raw)
        except (ValueError, RuntimeError) as e:
            return f"{data.describe(i)}: {e}"
        if expected is not None and i < len(expected):
            digest, label = expected[i]
            if hashlib.sha1(raw).digest() != digest or data.label(i) != label:
                return f"{data.describe(i)}: not the bytes or label written"
        return None

    with ThreadPoolExecutor(num_threads or _C.available_cores()) as pool:
        for problem in tqdm(
            pool.map(check, range(len(data))), total=len(data), disable=not progress, desc="verify"
        ):
            if problem:
                failed.append(problem)
    return {"shards": native.num_shards, "samples": len(data), "failed": failed}
