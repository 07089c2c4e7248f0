"""Checkpoint storage for fault-tolerant training: atomic, checksummed, rotated.

A checkpoint directory managed by :class:`CheckpointManager` holds::

    <dir>/<prefix>-e0003-s00001200.pth          torch.save of the state dict
    <dir>/<prefix>-e0003-s00001200.pth.sha256   sidecar: one JSON line with the
                                                file's SHA-256, size, epoch,
                                                step, milestone flag and time
    <dir>/checkpoints.json                      index: the same records for every
                                                checkpoint of the directory

Guarantees
----------
* **Atomic.** Every file (checkpoint, sidecar, index) is written to a temporary
  file in the same directory, flushed and ``fsync``-ed, then ``os.replace``-d
  onto its name, and the directory itself is ``fsync``-ed so that the rename
  survives a power cut. A reader therefore sees either the previous file or
  the complete new one, never a partial one; a run killed at any moment leaves
  at worst a stray ``.<name>.*.tmp`` file (see
  :meth:`CheckpointManager.remove_stale_temp_files`).
* **Nothing is lost before the new one is durable.** Rotation (deleting old
  checkpoints) happens only after the new checkpoint, its sidecar and the index
  are in place. A failed save removes its temporary file, leaves every earlier
  checkpoint and the index untouched, and raises :class:`CheckpointWriteError`.
* **Verified.** The SHA-256 is computed from the bytes as they are written (no
  second read of a file that may be gigabytes). :meth:`CheckpointManager.verify`
  recomputes it, so truncation and bit rot are detected before ``torch.load``
  sees the file; :meth:`CheckpointManager.load_latest` skips, with a warning,
  any newer checkpoint that fails verification or loading and falls back to the
  newest good one.
* **Self-describing.** The index is the primary record; the sidecar, written
  before its checkpoint is renamed into place, lets a checkpoint verify (and
  keep its milestone flag) even when the index is lost or damaged. Files that
  are present but missing from the index are found by a directory scan.

Overwriting an existing checkpoint (the same epoch and step saved twice) is
allowed; if the process dies between the renames of the sidecar, the
checkpoint and the index, the overwritten checkpoint then fails verification
and :meth:`~CheckpointManager.load_latest` falls back to the previous one.

The manager assumes one writer per directory (rank 0 in distributed runs).
Several managers with different prefixes may share a directory: the index
keeps the records of other prefixes untouched.

Also here: :func:`capture_rng_state` / :func:`restore_rng_state` (every RNG a
training step draws from, in a form that ``torch.load(weights_only=True)``
accepts), :func:`run_metadata` (versions, host, git commit) and
:class:`GracefulStop` (turns SIGTERM/SIGINT/SIGUSR1 into a flag the training
loop polls, so that it can checkpoint and exit cleanly).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import errno
import hashlib
import importlib
import importlib.metadata
import json
import os
import pickle
import platform
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = [
    "CheckpointManager",
    "CheckpointedDINOTrainer",
    "CheckpointRecord",
    "CheckpointWriteError",
    "GracefulStop",
    "ResumeError",
    "capture_rng_state",
    "restore_rng_state",
    "run_metadata",
]

# The process's umask, read once (os.umask can only be read by setting it).
_UMASK = os.umask(0o022)
os.umask(_UMASK)

INDEX_NAME = "checkpoints.json"
SIDECAR_SUFFIX = ".sha256"
_INDEX_VERSION = 1
_CHUNK = 1 << 20

# Readable causes for the errors a full or protected disk gives.
_ERRNO_CAUSES = {
    errno.ENOSPC: "disk full",
    errno.EDQUOT: "disk quota exceeded",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.EROFS: "read-only file system",
    errno.EIO: "I/O error",
}


class CheckpointWriteError(OSError):
    """A checkpoint could not be written; nothing that existed before is changed.

    A subclass of :class:`OSError` so that ``except OSError`` around a save
    catches it, whatever the underlying cause (an OS error such as ENOSPC or
    EACCES, or any exception raised by ``torch.save``, e.g. an unpicklable
    object). Attributes: ``path`` (the checkpoint that was being written),
    ``cause`` (the original exception, also ``__cause__``) and ``errno`` (the
    cause's errno when it was an OS error, else None).
    """

    def __init__(self, path: Path, cause: BaseException, what: str = "checkpoint"):
        err = getattr(cause, "errno", None) if isinstance(cause, OSError) else None
        reason = _ERRNO_CAUSES.get(err) if err is not None else None
        detail = f"{type(cause).__name__}: {cause}"
        msg = f"cannot write {what} {str(path)!r}: " + (
            f"{reason} ({detail})" if reason else detail
        )
        super().__init__(msg)
        self.errno = err
        self.filename = str(path)
        self.path = Path(path)
        self.cause = cause
        self.message = msg

    def __str__(self) -> str:
        return self.message

    def __reduce__(self):
        return (type(self), (self.path, self.cause))


@dataclasses.dataclass(frozen=True)
class CheckpointRecord:
    """What is known about one checkpoint file.

    ``sha256`` and ``size`` are None when neither the index nor a sidecar has a
    record of the file (it then cannot be verified); ``time`` is the Unix time
    of the save, or None when unknown.
    """

    path: Path
    epoch: int
    step: int
    milestone: bool
    sha256: str | None
    size: int | None = None
    time: float | None = None

    def to_json(self) -> dict:
        return {
            "file": self.path.name,
            "epoch": self.epoch,
            "step": self.step,
            "milestone": self.milestone,
            "sha256": self.sha256,
            "size": self.size,
            "time": self.time,
        }


class _HashingWriter:
    """File-like object for ``torch.save``: hashes and counts the bytes on
    their way to the file, so the checksum costs no second read. It keeps the
    first OS error it saw, because torch's C++ writer turns it into a vague
    RuntimeError."""

    def __init__(self, f):
        self._f = f
        self.sha = hashlib.sha256()
        self.size = 0
        self.error: OSError | None = None

    def write(self, data) -> int:
        try:
            n = self._f.write(data)
        except OSError as e:
            if self.error is None:
                self.error = e
            raise
        # A raw or non-blocking file may accept fewer bytes; hash what was written.
        view = memoryview(data).cast("B")
        if n is None:
            n = len(view)
        self.sha.update(view[:n])
        self.size += n
        return n

    def flush(self) -> None:
        self._f.flush()


def _fsync_dir(directory: Path) -> None:
    """Make renames and deletions in ``directory`` durable. Some platforms
    (Windows) and file systems cannot open or fsync a directory; there it is
    skipped, as the rename itself is still atomic."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def _unlink_quietly(path: str | Path | None) -> None:
    if path is None:
        return
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _atomic_write(path: Path, write) -> _HashingWriter:
    """Write a file atomically: ``write(hashing_writer)`` fills a temporary
    file next to ``path``, which is fsync-ed and renamed onto ``path``. The
    directory fsync is left to the caller, which may batch several renames.
    On any failure the temporary file is removed and the exception
    re-raised; ``path`` is untouched."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)  # mkstemp's 0600 would hide checkpoints from the group
        with os.fdopen(fd, "wb") as f:
            w = _HashingWriter(f)
            write(w)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        _unlink_quietly(tmp)
        raise
    return w


def _file_sha256(path: Path) -> tuple[str, int]:
    sha = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            sha.update(chunk)
            size += len(chunk)
    return sha.hexdigest(), size


_HEX64 = re.compile(r"[0-9a-f]{64}")


def _valid_entry(entry: Any) -> bool:
    return (
        isinstance(entry, dict)
        and isinstance(entry.get("file"), str)
        and isinstance(entry.get("sha256"), str)
        and _HEX64.fullmatch(entry["sha256"]) is not None
        and isinstance(entry.get("size"), int)
    )


class CheckpointManager:
    """Saves, lists, verifies, rotates and loads the checkpoints of one run.

    ``directory`` is created on the first save. ``keep_last`` non-milestone
    checkpoints are kept (None keeps all); milestones are never rotated away.
    With ``milestone_every > 0``, an end-of-epoch save (``end_of_epoch=True``)
    at an epoch divisible by ``milestone_every`` is a milestone. ``prefix``
    names the files (``<prefix>-e{epoch:04d}-s{step:08d}.pth``).
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        keep_last: int | None = 3,
        milestone_every: int = 0,
        prefix: str = "checkpoint",
    ):
        if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
            raise ValueError(f"keep_last must be a positive int or None, got {keep_last!r}")
        if not isinstance(milestone_every, int) or milestone_every < 0:
            raise ValueError(f"milestone_every must be an int >= 0, got {milestone_every!r}")
        if not prefix or "/" in prefix or os.sep in prefix or prefix.startswith("."):
            raise ValueError(f"prefix must be a plain file-name part, got {prefix!r}")
        self.directory = Path(directory)
        self.keep_last = keep_last
        self.milestone_every = milestone_every
        self.prefix = prefix
        self._name_re = re.compile(rf"{re.escape(prefix)}-e(\d{{4,}})-s(\d{{8,}})\.pth")

    # ----------------------------------------------------------------- naming

    @property
    def index_path(self) -> Path:
        return self.directory / INDEX_NAME

    def path_for(self, epoch: int, step: int) -> Path:
        """The file a save with this epoch and step writes."""
        return self.directory / f"{self.prefix}-e{epoch:04d}-s{step:08d}.pth"

    @staticmethod
    def sidecar_path(path: str | os.PathLike) -> Path:
        path = Path(path)
        return path.with_name(path.name + SIDECAR_SUFFIX)

    def _parse_name(self, name: str) -> tuple[int, int] | None:
        m = self._name_re.fullmatch(name)
        return (int(m.group(1)), int(m.group(2))) if m else None

    # ------------------------------------------------------------ the records

    def _read_index(self) -> dict:
        """The index as a dict with a ``checkpoints`` list; empty when there is
        none. A damaged index is reported and ignored: sidecars stand in."""
        try:
            text = self.index_path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return {"version": _INDEX_VERSION, "checkpoints": []}
        except OSError as e:
            warnings.warn(
                f"cannot read checkpoint index {str(self.index_path)!r} ({e}); "
                "using the sidecar files",
                stacklevel=3,
            )
            return {"version": _INDEX_VERSION, "checkpoints": []}
        try:
            data = json.loads(text)
            if not isinstance(data, dict) or not isinstance(data.get("checkpoints"), list):
                raise ValueError("not an object with a 'checkpoints' list")
        except ValueError as e:
            warnings.warn(
                f"checkpoint index {str(self.index_path)!r} is damaged ({e}); "
                "using the sidecar files",
                stacklevel=3,
            )
            return {"version": _INDEX_VERSION, "checkpoints": []}
        return data

    def _index_entries(self) -> dict[str, dict]:
        return {e["file"]: e for e in self._read_index()["checkpoints"] if _valid_entry(e)}

    @staticmethod
    def _read_sidecar(path: Path) -> dict | None:
        try:
            entry = json.loads(CheckpointManager.sidecar_path(path).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        return entry if _valid_entry(entry) else None

    def _lookup(self, path: Path, index: dict[str, dict] | None = None) -> dict | None:
        """The record of ``path``: its index entry (when ``path`` is in this
        manager's directory), else its sidecar, else None."""
        if index is None:
            index = self._index_entries() if self._in_directory(path) else {}
        entry = index.get(path.name) if self._in_directory(path) else None
        return entry if entry is not None else self._read_sidecar(path)

    def _in_directory(self, path: Path) -> bool:
        try:
            return path.parent.resolve() == self.directory.resolve()
        except OSError:
            return False

    def checkpoints(self) -> list[CheckpointRecord]:
        """Every checkpoint file of this prefix present in the directory,
        oldest to newest by (epoch, step). Records come from the index, else
        from the sidecar; a file with neither has ``sha256=None``. Index
        entries whose file is gone are left out."""
        return self._scan(self._index_entries())

    def _scan(self, index: dict[str, dict]) -> list[CheckpointRecord]:
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return []
        records = []
        for name in names:
            parsed = self._parse_name(name)
            path = self.directory / name
            if parsed is None or not path.is_file():
                continue
            entry = index.get(name) or self._read_sidecar(path)
            epoch, step = parsed
            if entry is None:
                records.append(CheckpointRecord(path, epoch, step, False, None))
            else:
                records.append(
                    CheckpointRecord(
                        path,
                        epoch,
                        step,
                        bool(entry.get("milestone", False)),
                        entry["sha256"],
                        entry["size"],
                        entry.get("time"),
                    )
                )
        records.sort(key=lambda r: (r.epoch, r.step, r.path.name))
        return records

    def latest_path(self) -> Path | None:
        """The newest checkpoint file present (verified or not), or None."""
        records = self.checkpoints()
        return records[-1].path if records else None

    # ----------------------------------------------------------------- saving

    def is_milestone(self, epoch: int, *, end_of_epoch: bool) -> bool:
        """Whether a save at ``epoch`` becomes a milestone automatically."""
        return bool(end_of_epoch and self.milestone_every > 0 and epoch % self.milestone_every == 0)

    def save(
        self,
        state: dict,
        *,
        epoch: int,
        step: int,
        milestone: bool | None = None,
        end_of_epoch: bool = False,
    ) -> Path:
        """Write ``state`` atomically as the checkpoint of (``epoch``, ``step``),
        record its SHA-256, then rotate old checkpoints. Returns its path.

        ``milestone``: True or False decides; None (default) makes it a
        milestone when :meth:`is_milestone` says so. Saving the same epoch
        and step again replaces that checkpoint.

        On failure raises :class:`CheckpointWriteError` with nothing changed on
        disk: the temporary file is removed, and if the final rename fails the
        sidecar written just before it is put back as it was. Once the
        checkpoint is in place, later problems only warn, because it is
        already safe and verifiable: an index that cannot be updated (then
        nothing is rotated) or an old checkpoint that cannot be deleted.
        """
        if not isinstance(state, dict):
            raise TypeError(f"state must be a dict, got {type(state).__name__}")
        for name, value in (("epoch", epoch), ("step", step)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        if milestone is None:
            milestone = self.is_milestone(epoch, end_of_epoch=end_of_epoch)
        path = self.path_for(epoch, step)
        sidecar = self.sidecar_path(path)

        # 1. The checkpoint bytes go to a temporary file; nothing visible changes.
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=f".{path.name}.", suffix=".tmp")
        except Exception as e:
            raise CheckpointWriteError(path, e) from e
        writer = None
        try:
            with os.fdopen(fd, "wb") as f:
                writer = _HashingWriter(f)
                torch.save(state, writer)
                f.flush()
                os.fsync(f.fileno())
        except Exception as e:
            _unlink_quietly(tmp)
            cause = writer.error if writer is not None and writer.error is not None else e
            raise CheckpointWriteError(path, cause) from e
        except BaseException:  # KeyboardInterrupt mid-write: still no litter
            _unlink_quietly(tmp)
            raise

        record = CheckpointRecord(
            path, epoch, step, bool(milestone), writer.sha.hexdigest(), writer.size, time.time()
        )
        entry = record.to_json()

        # 2. Sidecar first, then the checkpoint: a checkpoint is never visible
        # without a record (an orphan sidecar is ignored by every reader).
        try:
            old_sidecar = sidecar.read_bytes() if sidecar.exists() else None
        except OSError:
            old_sidecar = None
        sidecar_replaced = False
        try:
            _atomic_write(sidecar, lambda w: w.write((json.dumps(entry) + "\n").encode()))
            sidecar_replaced = True
            os.replace(tmp, path)
            tmp = None
            _fsync_dir(self.directory)
        except Exception as e:
            if tmp is not None:  # the checkpoint never replaced `path`
                _unlink_quietly(tmp)
                if sidecar_replaced:  # put the old record back (or none)
                    with contextlib.suppress(OSError):
                        if old_sidecar is None:
                            _unlink_quietly(sidecar)
                        else:
                            _atomic_write(sidecar, lambda w: w.write(old_sidecar))
            raise CheckpointWriteError(path, e) from e

        # 3. Index, and the rotation decided from it. Old files are deleted
        # only now that the new checkpoint is durable and recorded.
        index_data = self._read_index()
        index = {e["file"]: e for e in index_data["checkpoints"] if _valid_entry(e)}
        index[path.name] = entry
        present = self._scan(index)
        doomed = self._rotation_victims(present, keep=path)
        doomed_names = {r.path.name for r in doomed}
        others = [
            e
            for e in index_data["checkpoints"]
            if isinstance(e, dict) and self._parse_name(str(e.get("file", ""))) is None
        ]
        mine = [
            r.to_json() for r in present if r.sha256 is not None and r.path.name not in doomed_names
        ]
        new_index = {
            "version": _INDEX_VERSION,
            "checkpoints": others + mine,
        }
        try:
            _atomic_write(
                self.index_path,
                lambda w: w.write((json.dumps(new_index, indent=1) + "\n").encode()),
            )
            _fsync_dir(self.directory)
        except Exception as e:
            # The checkpoint and its sidecar are in place and verify; only the
            # summary is stale. Rotation is skipped so nothing is deleted.
            warnings.warn(
                f"checkpoint {str(path)!r} saved, but the index {str(self.index_path)!r} "
                f"could not be updated ({CheckpointWriteError(self.index_path, e, 'index')}); "
                "its sidecar keeps it verifiable",
                stacklevel=2,
            )
            return path

        for victim in doomed:
            try:
                _unlink_quietly(victim.path)
                _unlink_quietly(self.sidecar_path(victim.path))
            except OSError as e:
                warnings.warn(
                    f"cannot delete old checkpoint {str(victim.path)!r}: {e}", stacklevel=2
                )
        if doomed:
            with contextlib.suppress(OSError):
                _fsync_dir(self.directory)
        return path

    def _rotation_victims(
        self, records: list[CheckpointRecord], keep: Path
    ) -> list[CheckpointRecord]:
        """Non-milestone checkpoints beyond the newest ``keep_last``. The file
        just written is never a victim, even if older ones sort after it.
        Unrecorded files (no index entry, no sidecar) are left alone: we
        cannot tell whether they are milestones."""
        if self.keep_last is None:
            return []
        rotating = [r for r in records if not r.milestone and r.sha256 is not None]
        victims = rotating[: max(len(rotating) - self.keep_last, 0)]
        return [r for r in victims if r.path.name != keep.name]

    def remove_stale_temp_files(self) -> list[Path]:
        """Delete temporary files left by saves of this prefix that were killed
        mid-write (and sidecars whose checkpoint never appeared). Call it only
        when no other process is saving into the directory. Returns what was
        removed."""
        removed = []
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return removed
        for name in names:
            path = self.directory / name
            stale_tmp = name.startswith(f".{self.prefix}-") or name.startswith(f".{INDEX_NAME}.")
            stale_tmp = stale_tmp and name.endswith(".tmp")
            orphan = name.endswith(SIDECAR_SUFFIX) and self._parse_name(
                name[: -len(SIDECAR_SUFFIX)]
            )
            orphan = bool(orphan) and not (self.directory / name[: -len(SIDECAR_SUFFIX)]).exists()
            if stale_tmp or orphan:
                _unlink_quietly(path)
                removed.append(path)
        return removed

    # ---------------------------------------------------------- verification

    def verify_reason(self, path: str | os.PathLike) -> str | None:
        """None when ``path`` matches its recorded SHA-256 and size; otherwise
        why not (missing file, no record, truncated, checksum mismatch)."""
        path = Path(path)
        if not path.is_file():
            return "file does not exist"
        entry = self._lookup(path)
        if entry is None:
            return f"no checksum record (not in {INDEX_NAME} and no {SIDECAR_SUFFIX} sidecar)"
        try:
            digest, size = _file_sha256(path)
        except OSError as e:
            return f"cannot read it: {e}"
        if size != entry["size"]:
            what = "truncated" if size < entry["size"] else "longer than recorded"
            return f"{what}: {size} bytes, recorded {entry['size']}"
        if digest != entry["sha256"]:
            return f"SHA-256 mismatch: file {digest[:16]}..., recorded {entry['sha256'][:16]}..."
        return None

    def verify(self, path: str | os.PathLike) -> bool:
        """Whether ``path`` matches its recorded SHA-256 (see :meth:`verify_reason`)."""
        return self.verify_reason(path) is None

    # ---------------------------------------------------------------- loading

    @staticmethod
    def _torch_load(path: Path, map_location, allow_pickle: bool):
        try:
            return torch.load(path, map_location=map_location, weights_only=True)
        except pickle.UnpicklingError:
            # weights_only refuses arbitrary classes. Unpickling them can run
            # code, so the fallback is opt-in (and only reached for files
            # whose checksum matched what this manager recorded).
            if not allow_pickle:
                raise
            return torch.load(path, map_location=map_location, weights_only=False)

    def load(
        self,
        path: str | os.PathLike,
        map_location: Any = "cpu",
        *,
        verify: bool = True,
        allow_pickle: bool = False,
    ) -> dict:
        """Load one checkpoint. Raises ValueError naming ``path`` when it does
        not verify (``verify=False`` skips the check) or cannot be loaded as a
        dict. ``torch.load`` runs with ``weights_only=True``; with
        ``allow_pickle=True`` a file holding other objects is loaded with full
        unpickling instead (trusted files only)."""
        path = Path(path)
        if verify:
            reason = self.verify_reason(path)
            if reason is not None:
                raise ValueError(f"checkpoint {str(path)!r} does not verify: {reason}")
        elif not path.is_file():
            raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist")
        try:
            state = self._torch_load(path, map_location, allow_pickle)
        except Exception as e:
            raise ValueError(
                f"checkpoint {str(path)!r} cannot be loaded: {type(e).__name__}: {e}"
            ) from e
        if not isinstance(state, dict):
            raise ValueError(f"checkpoint {str(path)!r} holds a {type(state).__name__}, not a dict")
        return state

    def load_latest(
        self, map_location: Any = "cpu", *, allow_pickle: bool = False
    ) -> tuple[dict, Path] | None:
        """The newest checkpoint that verifies and loads, as ``(state, path)``;
        None when there is none. Each newer checkpoint skipped (corrupt,
        truncated, unrecorded, unloadable) is reported with ``warnings.warn``
        naming the file and the reason."""
        for record in reversed(self.checkpoints()):
            try:
                return self.load(record.path, map_location, allow_pickle=allow_pickle), record.path
            except (ValueError, OSError) as e:
                warnings.warn(f"{e}; falling back to an older checkpoint", stacklevel=2)
        return None


# --------------------------------------------------------------------- RNG

_RNG_STATE_VERSION = 1


def _numpy_to_plain(obj):
    """NumPy's RNG state with arrays turned into lists (tagged with their
    dtype) so that torch.load(weights_only=True) accepts it."""
    if isinstance(obj, np.ndarray):
        return {"__ndarray__": obj.tolist(), "dtype": obj.dtype.str}
    if isinstance(obj, dict):
        return {k: _numpy_to_plain(v) for k, v in obj.items()}
    if isinstance(obj, np.generic):
        return obj.item()
    return obj


def _plain_to_numpy(obj):
    if isinstance(obj, dict):
        if "__ndarray__" in obj:
            data = obj["__ndarray__"]
            if isinstance(data, torch.Tensor):
                data = data.tolist()
            return np.array(data, dtype=np.dtype(obj["dtype"]))
        return {k: _plain_to_numpy(v) for k, v in obj.items()}
    return obj


def capture_rng_state() -> dict:
    """The state of every RNG training draws from: Python ``random``, the
    NumPy global RNG, the torch CPU generator and, when CUDA is available,
    the generator of every CUDA device (``cuda``: a list, one ByteTensor per
    device; absent without CUDA). Holds only tensors, lists, tuples, dicts,
    ints, floats and strings, so it loads with ``torch.load(weights_only=True)``.
    """
    state = {
        "version": _RNG_STATE_VERSION,
        "python": random.getstate(),
        "numpy": _numpy_to_plain(np.random.get_state(legacy=False)),  # noqa: NPY002 (the global RNG)
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = [s.cpu() for s in torch.cuda.get_rng_state_all()]
    return state


def restore_rng_state(state: dict, *, strict: bool = True) -> None:
    """Restore what :func:`capture_rng_state` returned.

    ``python``, ``numpy`` and ``torch`` must be present. CUDA: device ``i``
    gets saved state ``i``. When the state holds CUDA states for more devices
    than this process sees (including none, without CUDA), ``strict=True``
    (default) raises ValueError before anything is restored, because the
    random streams would silently differ from the saved run; ``strict=False``
    restores the devices present and warns. Devices beyond those saved keep
    their current state. A state without CUDA entries leaves CUDA untouched.
    """
    if not isinstance(state, dict):
        raise ValueError(f"RNG state must be a dict, got {type(state).__name__}")
    missing = [k for k in ("python", "numpy", "torch") if k not in state]
    if missing:
        raise ValueError(f"RNG state lacks {', '.join(missing)}")
    cuda_states = list(state.get("cuda") or [])
    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if len(cuda_states) > available:
        msg = (
            f"RNG state holds CUDA generator states for {len(cuda_states)} device(s), "
            f"but this process sees {available}"
        )
        if strict:
            raise ValueError(msg + " (pass strict=False to restore the devices present)")
        warnings.warn(msg + f"; restoring the first {available}", stacklevel=2)

    # Convert everything first, so a malformed state fails before any RNG changes.
    try:
        version, internal, gauss = state["python"]
        python_state = (int(version), tuple(int(x) for x in internal), gauss)
        numpy_state = _plain_to_numpy(state["numpy"])
        if not isinstance(numpy_state, (dict, tuple, list)):
            raise TypeError("numpy state is neither a dict nor a tuple")
        torch_state = torch.as_tensor(state["torch"]).cpu().to(torch.uint8)
        cuda = [torch.as_tensor(s).cpu().to(torch.uint8) for s in cuda_states[:available]]
    except (TypeError, ValueError, KeyError) as e:
        raise ValueError(f"malformed RNG state: {e}") from e

    random.setstate(python_state)
    np.random.set_state(  # noqa: NPY002 (the global RNG is the legacy one)
        tuple(numpy_state) if isinstance(numpy_state, list) else numpy_state
    )
    torch.set_rng_state(torch_state)
    for i, s in enumerate(cuda):
        torch.cuda.set_rng_state(s, device=i)


# ---------------------------------------------------------------- metadata


def _git(args: list[str], cwd: str | os.PathLike, timeout: float) -> str | None:
    try:
        out = subprocess.run(
            ["git", *args],
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):  # git missing, timeout
        return None
    return out.stdout if out.returncode == 0 else None


def _package_version() -> str | None:
    try:
        pkg = importlib.import_module(__package__ or "dino_opt")
        version = getattr(pkg, "__version__", None)
        if version is not None:
            return str(version)
    except ImportError:
        pass
    try:
        return importlib.metadata.version("dino_opt")
    except importlib.metadata.PackageNotFoundError:
        return None


def run_metadata(cwd: str | os.PathLike | None = None, *, git_timeout: float = 5.0) -> dict:
    """Where a checkpoint came from: ``dino_opt_version``, ``torch_version``,
    ``python_version``, ``hostname``, ``platform``, ``git_commit`` (HEAD of the
    git checkout holding ``cwd``, default the current directory; None outside
    a checkout, without git, or after ``git_timeout`` seconds) and
    ``git_dirty`` (tracked files modified; None when unknown)."""
    cwd = os.getcwd() if cwd is None else cwd
    head = _git(["rev-parse", "HEAD"], cwd, git_timeout)
    commit = (
        head.strip() if head and re.fullmatch(r"[0-9a-f]{40}|[0-9a-f]{64}", head.strip()) else None
    )
    dirty = None
    if commit is not None:
        status = _git(["status", "--porcelain", "--untracked-files=no"], cwd, git_timeout)
        dirty = None if status is None else bool(status.strip())
    return {
        "dino_opt_version": _package_version(),
        "torch_version": str(torch.__version__),  # a str subclass weights_only refuses
        "python_version": platform.python_version(),
        "hostname": socket.gethostname(),
        "platform": sys.platform,
        "git_commit": commit,
        "git_dirty": dirty,
    }


# ----------------------------------------------------------- graceful stop


def _default_signals() -> tuple[signal.Signals, ...]:
    names = ("SIGTERM", "SIGINT", "SIGUSR1")  # SIGUSR1 does not exist on Windows
    return tuple(getattr(signal, n) for n in names if hasattr(signal, n))


class GracefulStop:
    """Turns termination signals into a flag the training loop polls::

        with GracefulStop() as stop:
            for step in ...:
                train_step()
                if stop.requested:
                    manager.save(state, epoch=epoch, step=step)
                    break

    While active, the handlers of ``signals`` only set :attr:`requested` and
    remember the first signal (:attr:`signal_name`); the step in flight
    finishes, so the checkpoint is consistent. A second SIGINT after a stop
    was requested raises KeyboardInterrupt, so Ctrl-C twice still force-quits.
    On exit the previous handlers are restored.

    Python runs signal handlers only in the main thread and only lets the
    main thread install them, so entered from another thread it is a no-op
    (``active`` is False, a RuntimeWarning says so) whose flag never
    triggers: the main thread keeps its own handlers.
    """

    def __init__(self, signals: Iterable[int] | None = None):
        sigs = _default_signals() if signals is None else tuple(signals)
        self.signals = tuple(signal.Signals(s) for s in sigs)
        self._previous: dict[signal.Signals, Any] = {}
        self._requested = False
        self._signal: signal.Signals | None = None
        self._active = False

    @property
    def requested(self) -> bool:
        """Whether one of the signals arrived while active."""
        return self._requested

    @property
    def signal_name(self) -> str | None:
        """Name of the first signal received (e.g. ``"SIGTERM"``), or None."""
        return self._signal.name if self._signal is not None else None

    @property
    def active(self) -> bool:
        """Whether the handlers are installed (False off the main thread)."""
        return self._active

    def _handle(self, signum, frame) -> None:
        if self._requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        if not self._requested:
            self._signal = signal.Signals(signum)
            self._requested = True

    def __enter__(self) -> GracefulStop:
        if self._active:
            raise RuntimeError("GracefulStop is already active")
        if threading.current_thread() is not threading.main_thread():
            warnings.warn(
                "GracefulStop entered outside the main thread: signal handlers can only be "
                "installed there, so this one will never trigger",
                RuntimeWarning,
                stacklevel=2,
            )
            return self
        self._previous = {}
        try:
            for s in self.signals:
                self._previous[s] = signal.getsignal(s)
                signal.signal(s, self._handle)
        except BaseException:
            self._restore()
            raise
        self._active = True
        return self

    def _restore(self) -> None:
        for s, prev in self._previous.items():
            # None: the old handler was not installed from Python; the default
            # is the closest thing we can put back.
            signal.signal(s, prev if prev is not None else signal.SIG_DFL)
        self._previous = {}

    def __exit__(self, *exc) -> None:
        if self._active:
            self._restore()
            self._active = False


# ------------------------------------------------------------ the training job

# Config keys that may differ between a checkpoint and the run resuming it:
# where things go and how they are reported, not what is computed (the loader
# gives the same batches whatever its thread count).
_RESUME_MAY_DIFFER = ("logging.", "checkpoint.", "health.", "eval.", "hardware.device",
                      "data.num_workers", "data.prefetch", "data.pin_memory")  # fmt: skip


class ResumeError(ValueError):
    """A checkpoint cannot continue this run (another config, a bad file)."""


def _config_differences(saved: dict, current: dict) -> list[str]:
    keys = []
    for section in sorted(set(saved) | set(current)):
        a, b = saved.get(section, {}), current.get(section, {})
        for key in sorted(set(a) | set(b)):
            name = f"{section}.{key}"
            if a.get(key) != b.get(key) and not name.startswith(_RESUME_MAY_DIFFER):
                keys.append(f"{name}: {a.get(key)!r} in the checkpoint, {b.get(key)!r} now")
    return keys


def _row_entropy(teacher_logits: torch.Tensor, center: torch.Tensor, temp: float) -> torch.Tensor:
    """Entropy (nats) of each row's centred, sharpened teacher distribution."""
    p = torch.softmax((teacher_logits.float() - center) / temp, dim=-1)
    return torch.special.entr(p).sum(-1).cpu()


def _start_wandb(cfg, out: Path, metadata: dict):
    """A Weights & Biases run for this run folder (resumed with it: the id
    is kept in the folder). WANDB_MODE=offline logs without a network."""
    try:
        import wandb
    except ImportError as e:
        raise ImportError(
            "logging.wandb=true needs the wandb package: pip install 'dino_opt[wandb]'"
        ) from e
    id_file = out / "wandb_id.txt"
    run_id = id_file.read_text().strip() if id_file.exists() else None
    run = wandb.init(
        project=cfg.logging.wandb_project,
        dir=str(out),
        id=run_id,
        resume="allow",
        name=out.name,
        config={**cfg.to_dict(), "metadata": metadata},
    )
    id_file.write_text(run.id + "\n")
    return run


class _NullLog:
    """The metrics file of ranks other than 0."""

    def write(self, text: str) -> None:
        pass

    def flush(self) -> None:
        pass


class CheckpointedDINOTrainer:
    """The training job of ``dino-opt train``, restartable at any step.

    ``CheckpointedDINOTrainer(config, output_dir=..., auto_resume=True).train()``
    builds the loader, student and teacher, loss, optimizer and
    :class:`~dino_opt.trainer.MemoryOptimizedDINOTrainer` from a
    :class:`~dino_opt.config.Config` (or a YAML path, or a dict), trains, and
    returns the report that ``run_training`` returns. Underneath, a
    :class:`CheckpointManager` (``self.checkpoint_manager``) writes the
    complete state to ``<run>/checkpoints/`` at the end of every
    ``checkpoint.every_epochs`` epochs, every ``checkpoint.every_steps``
    optimizer steps, when a SIGTERM, SIGINT or SIGUSR1 arrives (at the next
    step boundary, then the run stops cleanly: ``report["stopped_by"]``), when
    the run stops on repeated non-finite steps, and at the end.

    The state: student, teacher, optimizer, grad scaler, loss center, the
    teacher's step, epoch and step, the loader's position inside the epoch,
    every RNG, the metrics so far, the resolved config, the versions and the
    git commit. Resuming (``auto_resume`` / ``checkpoint.resume``) restores all
    of it, so on the CPU a resumed run gives the same losses and the same
    final weights, bit for bit, as one that never stopped. A checkpoint from a
    run with another config (other than logging, checkpoint, health, eval,
    device and loader-thread settings) is refused, naming the keys.
    """

    def __init__(
        self,
        config=None,
        *,
        config_path: str | os.PathLike | None = None,
        overrides: Iterable[str] = (),
        output_dir: str | os.PathLike | None = None,
        auto_resume: bool = True,
        quiet: bool = False,
        enable_live_dashboard: bool | None = None,
    ):
        from .config import Config, apply_overrides, default_config, load_config

        if config is not None and config_path is not None:
            raise ValueError("give config or config_path, not both")
        source = config if config is not None else config_path
        overrides = list(overrides)
        if source is None:
            cfg = apply_overrides(default_config(), overrides)
        elif isinstance(source, Config):
            cfg = apply_overrides(source, overrides) if overrides else source
        elif isinstance(source, dict):
            cfg = apply_overrides(Config.from_dict(source), overrides)
        else:
            cfg = load_config(source, overrides)
        if not auto_resume and cfg.checkpoint.resume == "auto":
            cfg = apply_overrides(cfg, ["checkpoint.resume=null"])
        if enable_live_dashboard is not None:
            cfg = apply_overrides(cfg, [f"logging.tensorboard={bool(enable_live_dashboard)}"])
        self.config = cfg
        self.quiet = quiet
        out = output_dir or cfg.logging.output_dir or f"runs/{time.strftime('%Y%m%d-%H%M%S')}"
        self._set_output_dir(Path(out))

    def _set_output_dir(self, out: Path) -> None:
        """The run folder and the manager of its ``checkpoints/``."""
        ck = self.config.checkpoint
        self.output_dir = out
        self.checkpoint_manager = CheckpointManager(
            out / "checkpoints", keep_last=ck.keep, milestone_every=ck.milestone_every
        )

    # ------------------------------------------------------------ resume

    def _checkpoint_to_resume(self) -> tuple[dict, Path] | None:
        resume = self.config.checkpoint.resume
        manager = self.checkpoint_manager
        if resume is None:
            if manager.checkpoints():
                raise ResumeError(
                    f"run folder {str(self.output_dir)!r} already holds checkpoints; continue "
                    "it with checkpoint.resume=auto, or choose another output folder"
                )
            return None
        if resume == "auto":
            return manager.load_latest()
        path = Path(resume)
        try:
            if manager.sidecar_path(path).exists() or path.parent == manager.directory:
                return manager.load(path), path
            return manager.load(path, verify=False), path
        except (ValueError, OSError) as e:
            raise ResumeError(f"checkpoint.resume={resume!r}: {e}") from e

    # ------------------------------------------------------------ the job

    def train(self) -> dict:  # noqa: C901 - one linear job, split into phases by comments
        """Trains (resuming when configured) and returns the report."""
        from .config import effective_lr, save_config
        from .data import AUGMENT_KEYS, MultiCropLoader
        from .distributed import all_reduce_metrics, gather_objects, init_distributed, wrap_student
        from .health import HealthThresholds, NonFiniteError, TrainingHealthMonitor
        from .knn import knn_evaluate, tsne_plot
        from .memory import MemoryTracker
        from .plots import plot_training_curves
        from .profiler import Profiler
        from .trainer import (
            DINOModel,
            MemoryOptimizedDINOTrainer,
            Schedules,
            _profile_summary,
            build_loss,
            build_models,
            data_roots,
            param_groups,
        )

        cfg = self.config
        dist_info = init_distributed(cfg.hardware.device)  # alone unless started by torchrun/SLURM
        device, rank, world = dist_info.device, dist_info.rank, dist_info.world_size
        if world > 1:  # rank 0's run folder (a default name holds the time it was made)
            self._set_output_dir(Path(gather_objects(str(self.output_dir))[0]))
        out = self.output_dir
        lead = rank == 0  # writes the run folder; every rank trains
        torch.manual_seed(cfg.hardware.seed)
        if lead:
            out.mkdir(parents=True, exist_ok=True)
        resumed = self._checkpoint_to_resume()
        if resumed is not None:
            differences = _config_differences(resumed[0].get("config", {}), cfg.to_dict())
            if differences:
                raise ResumeError(
                    f"checkpoint {str(resumed[1])!r} belongs to a run with another config: "
                    + "; ".join(differences)
                    + " (train in another run folder to start afresh)"
                )
        if lead:
            save_config(cfg, out / "config.yaml")

        # ---- data, models, optimisation: the same objects whether fresh or resumed
        train_root, val_root = data_roots(cfg)
        aug = cfg.augmentation
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
        loader = MultiCropLoader(
            train_root,
            cfg.data.batch_size,
            global_size=aug.global_crop_size,
            local_size=aug.local_crop_size,
            n_local=aug.num_local_views,
            global_scale=aug.global_crops_scale,
            local_scale=aug.local_crops_scale,
            num_threads=cfg.data.num_workers,
            prefetch=cfg.data.prefetch,
            seed=cfg.hardware.seed,
            rank=rank,
            world_size=world,
            dtype=dtype[cfg.data.dtype],
            photometric=cfg.data.photometric,
            device=device if cfg.data.photometric == "gpu" else None,
            on_error=cfg.data.on_error,
            augment={k: getattr(aug, k) for k in AUGMENT_KEYS},
            pin_memory=cfg.data.pin_memory and device.type == "cuda",
        )
        s = cfg.schedule
        student, teacher = build_models(cfg)
        random_teacher = copy.deepcopy(teacher).eval()  # the random-initialisation baseline
        student, teacher = student.to(device), teacher.to(device)
        torch.manual_seed(cfg.hardware.seed + rank)  # same init everywhere, own drop-path draws
        accumulation = cfg.optim.accumulation_steps
        iters = len(loader) // accumulation
        if iters < 1:
            raise ValueError(
                f"the data set gives {len(loader)} batches per epoch, fewer than "
                f"optim.accumulation_steps={accumulation}"
            )
        schedules = Schedules.dino(
            base_lr=effective_lr(cfg, world_size=world),
            min_lr=cfg.optim.min_lr,
            weight_decay=cfg.optim.weight_decay,
            weight_decay_end=cfg.optim.weight_decay_end,
            momentum_teacher=s.momentum_teacher,
            epochs=s.epochs,
            warmup_epochs=s.warmup_epochs,
            niter_per_epoch=iters,
        )
        model = DINOModel(student, teacher, schedules.momentum)
        model.student = wrap_student(student, device)  # DDP when distributed; EMA reads `student`
        loss_fn = build_loss(cfg).to(device)
        fused = cfg.optim.fused if cfg.optim.fused is not None else device.type == "cuda"
        if cfg.optim.optimizer == "adamw":
            optimizer = torch.optim.AdamW(param_groups(student), lr=0.0, fused=fused)
        else:
            optimizer = torch.optim.SGD(param_groups(student), lr=0.0, momentum=0.9)
        trainer = MemoryOptimizedDINOTrainer(
            model,
            loss_fn,
            optimizer,
            {
                "precision": cfg.hardware.precision,
                "gradient_checkpointing": cfg.hardware.grad_checkpointing,
                "crop_batch_size": cfg.hardware.crop_batch_size,
                "accumulation_steps": accumulation,
                "gradient_clip": cfg.optim.clip_grad,
                "freeze_last_layer": cfg.optim.freeze_last_layer,
            },
            device,
        )
        self.trainer = trainer

        # ---- where to start
        epoch0, step, history, seconds_before, resumed_from = 0, 0, [], 0.0, None
        if resumed is not None:
            state, path = resumed
            try:
                student.load_state_dict(state["student"])
                teacher.load_state_dict(state["teacher"])
                optimizer.load_state_dict(state["optimizer"])
                loss_fn.load_state_dict(state["loss"])
                if trainer.scaler is not None and state.get("scaler") is not None:
                    trainer.scaler.load_state_dict(state["scaler"])
                model.teacher_step = int(state["teacher_step"])
                if len(state["loader"]) != world:
                    raise ValueError(
                        f"it was written by {len(state['loader'])} processes, this run has {world}"
                    )
                loader.load_state_dict(state["loader"][rank])
                restore_rng_state(state["rng"][rank], strict=False)
                epoch0, step = int(state["epoch"]), int(state["step"])
                history = list(state.get("history", []))
                seconds_before = float(state.get("train_seconds", 0.0))
            except (KeyError, RuntimeError, ValueError, TypeError) as e:
                raise ResumeError(f"checkpoint {str(path)!r} cannot be resumed: {e}") from e
            del state, resumed  # the tensors now live in the models and the optimizer
            resumed_from = path
            if lead:
                print(f"resuming from {path} (epoch {epoch0}, step {step})", file=sys.stderr)
        metadata = run_metadata()

        def save(epoch: int, reason: str, *, end_of_epoch: bool = False) -> Path | None:
            """Collective: every rank calls it at the same step; rank 0 writes
            (with every rank's loader position and RNGs), then all learn
            whether the write succeeded, so that a full disk stops them all."""
            loaders = gather_objects(loader.state_dict())
            rngs = gather_objects(capture_rng_state())
            if not lead:
                if all_reduce_metrics({"ok": 1.0})["ok"] < 1.0:
                    raise RuntimeError(f"rank 0 could not write the checkpoint of step {step}")
                return None
            state = {
                "student": student.state_dict(),
                "teacher": teacher.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scaler": trainer.scaler.state_dict() if trainer.scaler is not None else None,
                "loss": loss_fn.state_dict(),
                "teacher_step": model.teacher_step,
                "epoch": epoch,
                "step": step,
                "loader": loaders,  # per rank
                "rng": rngs,  # per rank
                "world_size": world,
                "history": history,
                "train_seconds": seconds_before + time.perf_counter() - started,
                "reason": reason,
                "config": cfg.to_dict(),
                "metadata": metadata,
            }
            try:
                path = self.checkpoint_manager.save(
                    state, epoch=epoch, step=step, end_of_epoch=end_of_epoch,
                    milestone=True if reason == "final" else None,
                )  # fmt: skip
            except BaseException:
                all_reduce_metrics({"ok": 0.0})
                raise
            all_reduce_metrics({"ok": 1.0})
            return path

        # ---- logging
        tracker = MemoryTracker(device=device)
        monitor = None
        if cfg.health.enabled:
            monitor = TrainingHealthMonitor(HealthThresholds.from_config(cfg.health))
        writer = None
        if cfg.logging.tensorboard and lead:
            from torch.utils.tensorboard import SummaryWriter

            writer = SummaryWriter(str(out / "tensorboard"), purge_step=step + 1 if step else None)
        wandb_run = _start_wandb(cfg, out, metadata) if cfg.logging.wandb and lead else None
        from tqdm import tqdm

        total = s.epochs * len(loader)
        bar = tqdm(total=total, initial=step, unit="batch", desc="train",
                   disable=self.quiet or not cfg.logging.progress or not lead)  # fmt: skip
        # The phases of each step as ranges of the native profiler: host clock
        # and, on a GPU, CUDA events on the current stream, resolved only when
        # read after training; push/pop never synchronise the device.
        profiler = Profiler(device) if cfg.logging.profile and lead else None
        phase = profiler.range if profiler is not None else lambda name: contextlib.nullcontext()
        stopped_by = None
        step0 = step
        started = time.perf_counter()
        window = (started, step)
        log_every = cfg.logging.log_every
        every_steps = cfg.checkpoint.every_steps * accumulation  # in loader batches
        pending_stop = None
        metrics_file = open(out / "metrics.jsonl", "w") if lead else contextlib.nullcontext()
        with metrics_file as log, GracefulStop() as stop:
            if not lead:
                log = _NullLog()
            for row in history:  # a resumed run's metrics so far, then its own
                log.write(json.dumps(row) + "\n")
            if profiler is not None:
                profiler.clear()  # the first step starts now, not at construction
            for epoch in range(epoch0, s.epochs):
                if epoch != loader.epoch:
                    loader.set_epoch(epoch)
                student.train()
                batches = iter(loader)
                while True:
                    with phase("data_wait"):
                        batch = next(batches, None)
                    if batch is None:
                        break
                    it = min(step // accumulation, len(schedules.lr) - 1)
                    trainer.set_schedules(schedules, it)
                    logging_step = (step + 1) % log_every == 0 or step + 1 == total
                    trainer.capture_outputs = logging_step and monitor is not None
                    with phase("forward_backward"):
                        loss, _ = trainer.train_step_optimized(batch.crops, epoch)
                    with phase("optimizer_step"):
                        stepped = trainer.optimize_step()
                    step += 1
                    bar.update()
                    if stepped and monitor is not None:
                        extra = {}
                        if trainer.captured:
                            c = trainer.captured
                            extra = dict(
                                teacher_logits=c["teacher_logits"],
                                student_logits=c["student_logits"],
                                teacher_temp=float(loss_fn._teacher_temps[epoch]),
                                student_temp=loss_fn.student_temp,
                                center=loss_fn.center,
                                features=c.get("features"),
                            )
                        monitor.observe(loss=loss, grad_norm=trainer.last_grad_norm, step=step,
                                        **extra)  # fmt: skip
                        if writer is not None and extra and cfg.logging.histograms:
                            writer.add_histogram(
                                "health/teacher_entropy_per_image",
                                _row_entropy(extra["teacher_logits"], loss_fn.center,
                                             extra["teacher_temp"]), step,
                            )  # fmt: skip
                        trainer.captured = {}
                    if logging_step:
                        now = time.perf_counter()
                        images = (step - window[1]) * cfg.data.batch_size
                        # one all-reduce (and host sync) at logging intervals: the
                        # mean loss over ranks and whether any rank got a signal
                        reduced = all_reduce_metrics({"loss": loss, "stop": float(stop.requested)})
                        if reduced["stop"] > 0 and pending_stop is None:
                            pending_stop = stop.signal_name or "SIGTERM"
                        row = {
                            "step": step,
                            "epoch": epoch,
                            "loss": reduced["loss"],
                            "lr": float(schedules.lr[it]),
                            "weight_decay": float(schedules.weight_decay[it]),
                            "momentum": float(schedules.momentum[it]),
                            "images_per_second": images / max(now - window[0], 1e-9),
                        }
                        row.update(tracker.get_memory_stats())
                        alerts = []
                        if monitor is not None:
                            # this rank's diagnostics; the loss stays the mean over ranks
                            health = monitor.summary()
                            row.update({k: v for k, v in health.items() if k not in row})
                            try:
                                alerts = monitor.check_training_health(
                                    {**row, "throughput": row["images_per_second"]}
                                )
                            except NonFiniteError:
                                history.append(row)
                                log.write(json.dumps(row) + "\n")
                                save(epoch, "nonfinite")
                                raise
                            if alerts:
                                row["alerts"] = [a.name for a in alerts]
                        window = (now, step)
                        history.append(row)
                        log.write(json.dumps(row) + "\n")
                        log.flush()
                        if writer is not None:
                            for k, v in row.items():
                                if k not in ("step", "epoch") and isinstance(v, (int, float)):
                                    writer.add_scalar(f"train/{k}", v, step)
                            for a in alerts:
                                writer.add_text("health/alerts", a.message, step)
                        if wandb_run is not None:
                            wandb_run.log({k: v for k, v in row.items() if k != "step"}, step=step)
                        # memory: the GPU allocator's peak on a GPU, else the process's RSS
                        mem = row.get("gpu_memory_peak_gb", row["host_rss_gb"])
                        bar.set_postfix(loss=f"{row['loss']:.3f}", lr=f"{row['lr']:.2e}",
                                        ips=f"{row['images_per_second']:.0f}",
                                        mem=f"{mem:.2f}G")  # fmt: skip
                    if profiler is not None:
                        profiler.step(cfg.data.batch_size)
                    if trainer._micro_steps == 0:  # an optimizer-step boundary
                        # Alone, a signal is acted on at once; with several ranks at
                        # the next logging step, when all of them know of it.
                        if pending_stop is None and stop.requested and world == 1:
                            pending_stop = stop.signal_name
                        if pending_stop is not None:
                            stopped_by = pending_stop
                            save(epoch, f"signal:{stopped_by}")
                            break
                        if every_steps and step % every_steps == 0:
                            # not at an epoch's end: the epoch checkpoint covers it
                            if 0 < loader.state_dict()["next_batch"] < len(loader):
                                save(epoch, "step")
                if stopped_by is not None:
                    break
                ck_every = cfg.checkpoint.every_epochs
                if ck_every and (epoch + 1) % ck_every == 0 and epoch + 1 < s.epochs:
                    loader.set_epoch(epoch + 1)  # the position to resume from
                    save(epoch + 1, "epoch", end_of_epoch=True)
        bar.close()
        loader.close()
        train_seconds = seconds_before + time.perf_counter() - started
        report = {
            "epochs": s.epochs,
            "steps": step,
            "train_seconds": train_seconds,
            "final_loss": history[-1]["loss"] if history else None,
            "device": str(device),
        }
        if resumed_from is not None:
            report["resumed_from"] = str(resumed_from)
        if stopped_by is not None:
            report["stopped_by"] = stopped_by
            report["checkpoint"] = str(self.checkpoint_manager.latest_path())
            if lead:
                (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
            if writer is not None:
                writer.close()
            if wandb_run is not None:
                wandb_run.finish()
            return report
        loader.set_epoch(s.epochs)
        report["checkpoint"] = str(save(s.epochs, "final", end_of_epoch=True))
        if not lead:  # rank 0 evaluates and writes the report
            return report
        if profiler is not None and step > step0:
            profile = _profile_summary(profiler)
            (out / "profile.json").write_text(json.dumps(profile, indent=2) + "\n")
            shares = {p: v["share_of_step"] for p, v in profile["phases"].items()}
            shares["other"] = profile["other_share_of_step"]
            report["profile"] = {p: None if v is None else round(v, 4) for p, v in shares.items()}
        plot_training_curves(history, out / "training_curves.png")
        if val_root is not None:
            size = aug.global_crop_size
            ev = cfg.eval
            tsne = cfg.logging.tsne
            for key, net, name, label in (
                ("knn_top1_trained", teacher.backbone, "tsne_trained.png", "trained teacher"),
                ("knn_top1_random_init", random_teacher.backbone.to(device),
                 "tsne_random_init.png", "teacher at random initialisation"),
            ):  # fmt: skip
                knn = knn_evaluate(
                    net, train_root, val_root, size, device, k=ev.knn_k,
                    temperature=ev.knn_temperature, return_features=tsne,
                )  # fmt: skip
                report[key] = knn["top1"]
                if tsne:
                    tsne_plot(
                        knn["val_features"], knn["val_labels"], knn["classes"], out / name,
                        title=f"t-SNE of val features: {label} (k-NN top-1 {knn['top1']:.1f}%)",
                        seed=cfg.hardware.seed,
                    )  # fmt: skip
        (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
        if writer is not None:
            writer.close()
        if wandb_run is not None:
            wandb_run.summary.update({k: v for k, v in report.items() if k != "profile"})
            wandb_run.finish()
        return report
