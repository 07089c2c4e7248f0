"""A sharded checkpoint read without running any of its bytes.

``torch.distributed.checkpoint`` keeps a checkpoint's description (where
every tensor's pieces are) in the folder's ``.metadata``, a pickle that
its ``FileSystemReader`` loads with ``pickle.load``, and the non-tensor
values of the state (the optimizer's ``param_groups``) as ``torch.save``
bytes that its ``DefaultLoadPlanner`` loads with ``weights_only=False``:
either runs whatever code the file names. The records beside a
checkpoint (its index entry, its sidecar) are written by whoever wrote the
folder, so they prove nothing about who that was.

Here the description is unpickled by :class:`_DescriptionUnpickler`, which
builds only the classes a description is made of (``Metadata`` and its
parts, ``torch.Size``, the dtypes, layouts and memory formats as torch
pickles them, paths) and refuses any other global in one line naming the
file; the description is then checked (every entry of the kinds torch
writes, every piece in a plain file of the folder) before torch reads a
shard. The non-tensor values are read with ``weights_only=True``.
:class:`DescribedReader` and :class:`WeightsOnlyPlanner` are what every
load of a sharded checkpoint hands to ``torch.distributed.checkpoint.load``.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import pathlib
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import CheckpointException, FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)

__all__ = [
    "DescribedReader",
    "RefusedCheckpointError",
    "WeightsOnlyPlanner",
    "one_line_failures",
    "read_description",
]

_METADATA_MODULE = "torch.distributed.checkpoint.metadata"

#: Every global a description torch writes names (found by listing the
#: ``find_class`` calls of the ``.metadata`` of 2-rank FSDP runs).
_ADMITTED = {
    (_METADATA_MODULE, name): getattr(torch.distributed.checkpoint.metadata, name)
    for name in (
        "Metadata",
        "StorageMeta",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "_MEM_FORMAT_ENCODING",
    )
}
_ADMITTED |= {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    ("torch", "Size"): torch.Size,
    # torch pickles a layout as a call of this lookup of its name (copyreg)
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
    ("collections", "OrderedDict"): dict,
    # StorageMeta.checkpoint_id: the path the checkpoint was saved to
    **{
        ("pathlib", name): getattr(pathlib, name)
        for name in ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")
    },
}


class RefusedCheckpointError(ValueError):
    """A checkpoint that names code to run where only data belongs: refused
    outright (never a fallback to an older checkpoint, never a retry), its
    message one line naming the file and what it named."""


class _DescriptionUnpickler(pickle.Unpickler):
    """Builds only the admitted globals and torch's dtypes; any other is refused."""

    def __init__(self, file, path: Path):
        super().__init__(file)
        self._path = path

    def find_class(self, module: str, name: str) -> Any:
        admitted = _ADMITTED.get((module, name))
        if admitted is not None:
            return admitted
        dtype = torch.__dict__.get(name) if module == "torch" else None  # no lazy import
        if isinstance(dtype, torch.dtype):
            return dtype
        raise _Refused(
            f"{str(self._path)!r} names the global {module}.{name}, which a sharded "
            "checkpoint's description never holds: refused, nothing of it was run"
        )

    def persistent_load(self, pid: Any) -> Any:
        raise _Refused(f"{str(self._path)!r} holds a persistent id, which a description never has")


class _Refused(pickle.UnpicklingError):
    pass


def _is_key_path(value: Any) -> bool:
    return isinstance(value, tuple) and all(isinstance(p, str | int) for p in value)


def _check(metadata: Any, path: Path) -> Metadata:
    """``metadata`` when it is a description of the kinds torch writes, with
    every piece in a plain file of the checkpoint's folder; ValueError otherwise."""

    def bad(what: str) -> ValueError:
        return ValueError(f"{str(path)!r} is not a sharded checkpoint's description: {what}")

    if not isinstance(metadata, Metadata):
        raise bad(f"it holds a {type(metadata).__name__}")
    entries, storage = metadata.state_dict_metadata, metadata.storage_data
    if not isinstance(entries, dict) or not isinstance(storage, dict):
        raise bad("its entries or its storage are not mappings")
    for index, info in storage.items():
        if not isinstance(index, MetadataIndex) or not isinstance(info, _StorageInfo):
            raise bad(f"a storage entry is a {type(info).__name__}")
        name = info.relative_path
        if not isinstance(name, str) or name != os.path.basename(name) or name in ("", ".", ".."):
            raise bad(f"{index.fqn!r} is stored in {name!r}, not a file of its folder")
        if not isinstance(info.offset, int) or not isinstance(info.length, int):
            raise bad(f"{index.fqn!r} has no offset or length")
    stored = sum(info.length for info in storage.values())
    for key, entry in entries.items():
        if not isinstance(key, str) or not isinstance(
            entry, TensorStorageMetadata | BytesStorageMetadata
        ):
            raise bad(f"entry {key!r} is a {type(entry).__name__}")
        if isinstance(entry, BytesStorageMetadata):
            continue
        dtype = getattr(entry.properties, "dtype", None)
        if not isinstance(entry.size, torch.Size) or not isinstance(dtype, torch.dtype):
            raise bad(f"tensor {key!r} has no size or dtype")
        size = math.prod(entry.size) * dtype.itemsize
        if min(entry.size, default=0) < 0 or size > stored:  # never allocated to find out
            raise bad(f"tensor {key!r} of {list(entry.size)} is more than its shards hold")
    planner = metadata.planner_data
    if planner is not None and not (
        isinstance(planner, dict) and all(_is_key_path(v) for v in planner.values())
    ):
        raise bad("its planner data are not paths of keys")
    return metadata


def read_description(path: str | os.PathLike) -> Metadata:
    """The description (``.metadata``) of a sharded checkpoint, unpickled
    with only the classes a description is made of; ValueError naming the
    file for any other content."""
    path = Path(path)
    data = path.read_bytes()
    try:
        metadata = _DescriptionUnpickler(io.BytesIO(data), path).load()
    except _Refused as e:
        raise RefusedCheckpointError(str(e)) from None
    except Exception as e:  # noqa: BLE001 - whatever the bytes are: one line naming the file
        raise ValueError(f"{str(path)!r} cannot be read: {type(e).__name__}: {e}") from None
    return _check(metadata, path)


class DescribedReader(FileSystemReader):
    """torch's reader of the checkpoint folder ``path``, handing torch the
    description ``metadata`` read beforehand by :func:`read_description`
    instead of unpickling the folder's ``.metadata`` itself."""

    def __init__(self, path: str | os.PathLike, metadata: Metadata):
        super().__init__(path)
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = self._metadata
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class WeightsOnlyPlanner(DefaultLoadPlanner):
    """torch's load planner, reading the non-tensor values of the checkpoint
    folder ``path`` (the optimizer's ``param_groups``) with ``weights_only=True``."""

    def __init__(self, path: str | os.PathLike):
        super().__init__()
        self._path = Path(path)

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            raise RefusedCheckpointError(
                f"the value of {read_item.dest_index.fqn!r} in {str(self._path)!r} is "
                f"not plain data, refused: {str(e).splitlines()[0]}"
            ) from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


@contextlib.contextmanager
def one_line_failures(path: str | os.PathLike):
    """torch.distributed.checkpoint's failures (a ``CheckpointException``, a
    BaseException whose text is each rank's traceback) as the first one's
    exception: a :class:`RefusedCheckpointError` as it is, any other as a
    ValueError naming the folder ``path``."""
    try:
        yield
    except CheckpointException as e:
        failures = [exc for exc, _ in e.failures.values()]
        first = failures[0] if failures else e
        if isinstance(first, RefusedCheckpointError):
            raise first from None
        text = str(first).strip().splitlines()
        raise ValueError(
            f"sharded checkpoint {str(path)!r} cannot be read: {type(first).__name__}: "
            f"{text[-1] if text else ''}"
        ) from None
