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

A sharded checkpoint (``<prefix>-e0003-s00001200.dcp/``, a folder of
``torch.distributed.checkpoint`` files written by every rank of an FSDP run)
is listed, verified, rotated and loaded alongside the files; see
:mod:`dino_opt.checkpoint.sharded` and :meth:`CheckpointManager.publish_sharded`.

The manager assumes one writer per directory (rank 0 in distributed runs).
Several managers with different prefixes may share a directory: the index
keeps the records of other prefixes untouched.

:class:`AsyncCheckpointWriter` puts the writing of a manager's checkpoints
in a background thread: the caller waits only while the state is copied
(to pinned host memory when it lives on a GPU); at most one write is in
flight, and its error (if any) surfaces at the next save or ``wait()``.

Also here: :func:`atomic_write` (the temporary-file, fsync, rename
discipline for any file), :func:`capture_rng_state` /
:func:`restore_rng_state` (every RNG a training step draws from, in a form
that ``torch.load(weights_only=True)`` accepts) and :func:`run_metadata`
(versions, host, git commit).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pickle
import re
import shutil
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from .description import RefusedCheckpointError
from .files import (
    CheckpointWriteError,
    _file_sha256,
    _HashingWriter,
    _unlink_quietly,
    atomic_write,
    fsync_dir,
    temporary_file,
)
from .sharded import SHARDED_SUFFIX, manifest, manifest_problem, read_sharded

__all__ = ["CheckpointManager", "CheckpointRecord"]


def _remove(path: str | Path) -> None:
    """A file, or a sharded checkpoint's folder; gone already is fine. A
    folder is first renamed out of sight, so that a process killed while
    deleting it never leaves a listed checkpoint with files missing."""
    path = Path(path)
    if path.is_dir():
        doomed = path.with_name(f".{path.name.lstrip('.')}.deleting")
        if doomed.exists():  # left by a process killed while deleting
            shutil.rmtree(doomed, ignore_errors=True)
        os.replace(path, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
    else:
        _unlink_quietly(path)


INDEX_NAME = "checkpoints.json"
SIDECAR_SUFFIX = ".sha256"
_INDEX_VERSION = 1


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
    files: dict[str, int] | None = None  # a sharded checkpoint's files and their sizes

    def to_json(self) -> dict:
        entry = {
            "file": self.path.name,
            "epoch": self.epoch,
            "step": self.step,
            "milestone": self.milestone,
            "sha256": self.sha256,
            "size": self.size,
            "time": self.time,
        }
        if self.files is not None:
            entry["files"] = self.files
        return entry


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
        self._name_re = re.compile(rf"{re.escape(prefix)}-e(\d{{4,}})-s(\d{{8,}})\.(pth|dcp)")

    # ----------------------------------------------------------------- naming

    @property
    def index_path(self) -> Path:
        return self.directory / INDEX_NAME

    def path_for(self, epoch: int, step: int, *, sharded: bool = False) -> Path:
        """The file a save with this epoch and step writes (the folder, for a
        sharded checkpoint)."""
        suffix = SHARDED_SUFFIX if sharded else ".pth"
        return self.directory / f"{self.prefix}-e{epoch:04d}-s{step:08d}{suffix}"

    @staticmethod
    def partial_path(path: str | os.PathLike) -> Path:
        """Where the ranks write a sharded checkpoint before it is published
        under ``path`` (a hidden folder: no reader lists it)."""
        path = Path(path)
        return path.with_name(f".{path.name}.partial")

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
            if parsed is None or not (path.is_file() or name.endswith(SHARDED_SUFFIX)):
                continue
            if name.endswith(SHARDED_SUFFIX) and not path.is_dir():
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
                        entry.get("files"),
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
        tmp, sha, size = self._write_temporary(state, path)
        record = CheckpointRecord(path, epoch, step, bool(milestone), sha, size, time.time())
        return self._commit(tmp, record)

    def publish_sharded(
        self,
        partial: str | os.PathLike,
        *,
        epoch: int,
        step: int,
        milestone: bool | None = None,
        end_of_epoch: bool = False,
    ) -> Path:
        """Publishes a sharded checkpoint that every rank has finished writing
        into ``partial`` (:meth:`partial_path`): its record (sizes of its
        files, checksum of its description) goes into the sidecar, the folder
        is renamed into place, the index updated, old checkpoints rotated,
        with the guarantees of :meth:`save`. Returns the folder's path."""
        if milestone is None:
            milestone = self.is_milestone(epoch, end_of_epoch=end_of_epoch)
        path = self.path_for(epoch, step, sharded=True)
        try:
            sha, size, files = manifest(partial)
        except OSError as e:
            raise CheckpointWriteError(path, e) from e
        record = CheckpointRecord(path, epoch, step, bool(milestone), sha, size, time.time(), files)
        return self._commit(os.fspath(partial), record)

    def _commit(self, tmp: str, record: CheckpointRecord) -> Path:
        """Publish, record, then rotate (see :meth:`save`)."""
        path = record.path
        self._publish(tmp, record)
        doomed = self._update_index(record)
        if doomed is None:  # the index could not be written: nothing is deleted
            return path
        for victim in doomed:
            try:
                _remove(victim.path)
                _unlink_quietly(self.sidecar_path(victim.path))
            except OSError as e:
                warnings.warn(
                    f"cannot delete old checkpoint {str(victim.path)!r}: {e}", stacklevel=3
                )
        if doomed:
            with contextlib.suppress(OSError):
                fsync_dir(self.directory)
        return path

    def _write_temporary(self, state: dict, path: Path) -> tuple[str, str, int]:
        """1. The checkpoint bytes go to a temporary file beside ``path``,
        hashed as written; nothing visible changes. Returns (temporary file,
        SHA-256, size)."""
        writer = None

        def save(f) -> None:
            nonlocal writer
            writer = _HashingWriter(f)
            torch.save(state, writer)

        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            tmp = temporary_file(path, save)
        except Exception as e:  # the temporary file is already removed
            cause = writer.error if writer is not None and writer.error is not None else e
            raise CheckpointWriteError(path, cause) from e
        return os.fspath(tmp), writer.sha.hexdigest(), writer.size

    def _publish(self, tmp: str, record: CheckpointRecord) -> None:
        """2. Sidecar first, then the checkpoint: a checkpoint is never
        visible without a record (an orphan sidecar is ignored by every
        reader). On failure the old sidecar is put back and nothing changed."""
        path, sidecar = record.path, self.sidecar_path(record.path)
        entry = record.to_json()
        try:
            old_sidecar = sidecar.read_bytes() if sidecar.exists() else None
        except OSError:
            old_sidecar = None
        sidecar_replaced = False
        try:
            atomic_write(sidecar, lambda w: w.write((json.dumps(entry) + "\n").encode()))
            sidecar_replaced = True
            if path.is_dir():  # a sharded checkpoint saved again: a folder cannot be replaced
                _remove(path)
            os.replace(tmp, path)
            tmp = None
            fsync_dir(self.directory)
        except Exception as e:
            if tmp is not None:  # the checkpoint never replaced `path`
                _remove(tmp)
                if sidecar_replaced:  # put the old record back (or none)
                    with contextlib.suppress(OSError):
                        if old_sidecar is None:
                            _unlink_quietly(sidecar)
                        else:
                            atomic_write(sidecar, lambda w: w.write(old_sidecar))
            raise CheckpointWriteError(path, e) from e

    def _update_index(self, record: CheckpointRecord) -> list[CheckpointRecord] | None:
        """3. The index with the new record, and the rotation decided from
        it: the checkpoints to delete now that the new one is durable and
        recorded. None (with a warning) when the index cannot be written: the
        checkpoint and its sidecar are in place and verify, only the summary
        is stale, so nothing is rotated."""
        path = record.path
        index_data = self._read_index()
        index = {e["file"]: e for e in index_data["checkpoints"] if _valid_entry(e)}
        index[path.name] = record.to_json()
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
        new_index = {"version": _INDEX_VERSION, "checkpoints": others + mine}
        try:
            atomic_write(
                self.index_path,
                lambda w: w.write((json.dumps(new_index, indent=1) + "\n").encode()),
            )
            fsync_dir(self.directory)
        except Exception as e:
            warnings.warn(
                f"checkpoint {str(path)!r} saved, but the index {str(self.index_path)!r} "
                f"could not be updated ({CheckpointWriteError(self.index_path, e, 'index')}); "
                "its sidecar keeps it verifiable",
                stacklevel=3,
            )
            return None
        return doomed

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
            stale_tmp = stale_tmp and name.endswith((".tmp", ".partial", ".deleting"))
            orphan = name.endswith(SIDECAR_SUFFIX) and self._parse_name(
                name[: -len(SIDECAR_SUFFIX)]
            )
            orphan = bool(orphan) and not (self.directory / name[: -len(SIDECAR_SUFFIX)]).exists()
            if stale_tmp or orphan:
                _remove(path)
                removed.append(path)
        return removed

    # ---------------------------------------------------------- verification

    def verify_reason(self, path: str | os.PathLike) -> str | None:
        """None when ``path`` matches its recorded SHA-256 and size; otherwise
        why not (missing file, no record, truncated, checksum mismatch)."""
        path = Path(path)
        sharded = path.name.endswith(SHARDED_SUFFIX)
        if not (path.is_dir() if sharded else path.is_file()):
            return "file does not exist"
        entry = self._lookup(path)
        if entry is None:
            return f"no checksum record (not in {INDEX_NAME} and no {SIDECAR_SUFFIX} sidecar)"
        if sharded:
            return manifest_problem(path, entry)
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
        tensors: bool = True,
    ) -> dict:
        """Load one checkpoint. Raises ValueError naming ``path`` when it does
        not verify (``verify=False`` skips the check) or cannot be loaded as a
        dict. ``torch.load`` runs with ``weights_only=True``; with
        ``allow_pickle=True`` a file holding other objects is loaded with full
        unpickling instead (trusted files only). A sharded checkpoint (a
        ``.dcp`` folder) is read whole into CPU tensors, or with
        ``tensors=False`` only its small state (a sharded run then loads its
        shards in place: :func:`~dino_opt.checkpoint.sharded.load_shards`).
        A sharded checkpoint whose description or values name code raises
        :class:`~dino_opt.checkpoint.description.RefusedCheckpointError`
        (a ValueError, never wrapped, never run)."""
        path = Path(path)
        sharded = path.name.endswith(SHARDED_SUFFIX) and path.is_dir()
        if verify:
            reason = self.verify_reason(path)
            if reason is not None:
                raise ValueError(f"checkpoint {str(path)!r} does not verify: {reason}")
        elif not (sharded or path.is_file()):
            raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist")
        try:
            if sharded:
                state = read_sharded(path, tensors=tensors)
            else:
                state = self._torch_load(path, map_location, allow_pickle)
        except RefusedCheckpointError:
            raise
        except Exception as e:
            raise ValueError(
                f"checkpoint {str(path)!r} cannot be loaded: {type(e).__name__}: {e}"
            ) from e
        if not isinstance(state, dict):
            raise ValueError(f"checkpoint {str(path)!r} holds a {type(state).__name__}, not a dict")
        return state

    def load_latest(
        self, map_location: Any = "cpu", *, allow_pickle: bool = False, tensors: bool = True
    ) -> tuple[dict, Path] | None:
        """The newest checkpoint that verifies and loads, as ``(state, path)``;
        None when there is none. Each newer checkpoint skipped (corrupt,
        truncated, unrecorded, unloadable) is reported with ``warnings.warn``
        naming the file and the reason. ``tensors``: as for :meth:`load`.
        A checkpoint refused for naming code
        (:class:`~dino_opt.checkpoint.description.RefusedCheckpointError`)
        ends the search: it is raised, not skipped."""
        for record in reversed(self.checkpoints()):
            try:
                state = self.load(
                    record.path, map_location, allow_pickle=allow_pickle, tensors=tensors
                )
                return state, record.path
            except RefusedCheckpointError:
                raise  # someone's forgery, not a torn save: no fallback hides it
            except (ValueError, OSError) as e:
                warnings.warn(f"{e}; falling back to an older checkpoint", stacklevel=2)
        return None
