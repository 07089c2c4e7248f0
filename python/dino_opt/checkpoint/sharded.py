"""Sharded checkpoints: a folder of ``torch.distributed.checkpoint`` files.

A run sharded with FSDP (``distributed.strategy: fsdp``) saves a checkpoint
as a folder ``<prefix>-e0003-s00001200.dcp/``:

    __0_0.distcp, __1_0.distcp, ...   each rank's shards of the student, the
                                      teacher and the optimizer state (and
                                      of the loss's frozen networks: the
                                      dinov3 recipe's Gram teacher)
    .metadata                         where every tensor's pieces are (written
                                      last, once every rank has written)
    extra.pt                          the rest of the state (epoch, step, loader
                                      positions, RNGs, the loss's center, the
                                      config, ...), small, written by rank 0

Its record (index entry and sidecar, as for a file) holds the size of every
file and the SHA-256 of ``.metadata`` and ``extra.pt``: a missing or
truncated shard and a changed description are caught before loading. The
shards' own bytes are not hashed (that would read the whole checkpoint
again); ``torch.distributed.checkpoint`` fails on a shard it cannot read.

:func:`read_sharded` reads one into whole tensors in a single process (what
``dino-opt export``, ``knn`` and ``report`` need); a sharded run loads its
shards in place on every rank instead (:func:`load_shards`), at any world
size: the checkpoint's description lets each rank read the pieces it needs.
Neither unpickles anything but the classes a description is made of
(:mod:`dino_opt.checkpoint.description`): a folder is read without
running any of its bytes, whoever wrote it and its records.
"""

from __future__ import annotations

import hashlib
import os
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from .description import DescribedReader, WeightsOnlyPlanner, one_line_failures, read_description
from .files import atomic_write

__all__ = [
    "EXTRA_NAME",
    "is_sharded_checkpoint",
    "load_shards",
    "manifest",
    "manifest_problem",
    "read_sharded",
    "write_extra",
]

EXTRA_NAME = "extra.pt"
METADATA_NAME = ".metadata"
SHARDED_SUFFIX = ".dcp"


def is_sharded_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a sharded checkpoint folder (named ``*.dcp``)."""
    return Path(path).name.endswith(SHARDED_SUFFIX) and Path(path).is_dir()


def _digest(folder: Path) -> str:
    sha = hashlib.sha256()
    for name in (METADATA_NAME, EXTRA_NAME):
        sha.update((folder / name).read_bytes())
    return sha.hexdigest()


def manifest(folder: str | os.PathLike) -> tuple[str, int, dict[str, int]]:
    """(SHA-256 of the description and the small state, total bytes, bytes
    of each file) of a complete sharded checkpoint folder."""
    folder = Path(folder)
    files = {p.name: p.stat().st_size for p in sorted(folder.iterdir()) if p.is_file()}
    for name in (METADATA_NAME, EXTRA_NAME):
        if name not in files:
            raise FileNotFoundError(f"{str(folder)!r} has no {name}: the save did not finish")
    return _digest(folder), sum(files.values()), files


def manifest_problem(folder: Path, entry: dict) -> str | None:
    """None when ``folder`` matches its record ``entry``; otherwise what is wrong."""
    files = entry.get("files")
    if not isinstance(files, dict):
        return "its record lists no files"
    for name, size in files.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} has {path.stat().st_size} bytes, {size} recorded (truncated?)"
    try:
        digest = _digest(folder)
    except OSError as e:
        return f"cannot read it: {e}"
    if digest != entry.get("sha256"):
        return "checksum mismatch in .metadata or extra.pt"
    return None


def write_extra(folder: Path, extra: dict) -> None:
    """The non-tensor part of the state (rank 0), written atomically."""
    atomic_write(folder / EXTRA_NAME, lambda w: torch.save(extra, w))


def _read_extra(folder: Path) -> dict:
    extra = torch.load(folder / EXTRA_NAME, map_location="cpu", weights_only=True)
    if not isinstance(extra, dict):
        raise ValueError(f"{EXTRA_NAME} holds a {type(extra).__name__}, not a dict")
    return extra


def _nest(flat: dict[str, Any], paths: dict[str, tuple]) -> dict:
    """The nested state the flat keys of a checkpoint came from."""
    nested: dict = {}
    for key, value in flat.items():
        path = paths.get(key, (key,))
        node = nested
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value
    return _lists(nested)


def _lists(node: Any) -> Any:
    """``node`` with its lists back: torch.distributed.checkpoint flattens a
    list by index (the optimizer's ``param_groups``), so a node keyed by
    exactly 0..n-1 was one (the states saved here key their dicts by name)."""
    if not isinstance(node, dict):
        return node
    node = {k: _lists(v) for k, v in node.items()}
    if node and all(isinstance(k, int) for k in node) and sorted(node) == list(range(len(node))):
        return [node[i] for i in range(len(node))]
    return node


def read_sharded(folder: str | os.PathLike, *, tensors: bool = True) -> dict:
    """A sharded checkpoint as one state dict in this process: the small
    state, and with ``tensors`` the student, teacher and optimizer state as
    whole CPU tensors (keyed by parameter name, the optimizer's by name too).
    A part kept partly in each (the loss: its small state in ``extra.pt``,
    its frozen networks' weights as shards) comes back as one dict, as a
    single-file checkpoint holds it. Without ``tensors`` the description is
    still read and checked, so that a run never loads its shards from a
    folder whose description names code."""
    folder = Path(folder)
    state = _read_extra(folder)
    metadata = read_description(folder / METADATA_NAME)  # checked before any shard is read
    if not tensors:
        return state
    flat: dict[str, Any] = {}
    for key, meta in metadata.state_dict_metadata.items():
        is_tensor = isinstance(meta, TensorStorageMetadata)
        flat[key] = torch.empty(meta.size, dtype=meta.properties.dtype) if is_tensor else None
    with warnings.catch_warnings():  # "no process group: loading in one process" is the point
        warnings.simplefilter("ignore", UserWarning)
        with one_line_failures(folder):
            dcp.load(
                flat,
                storage_reader=DescribedReader(folder, metadata),
                planner=WeightsOnlyPlanner(folder),
                no_dist=True,
            )
    for key, value in _nest(flat, dict(metadata.planner_data or {})).items():
        if isinstance(value, dict) and isinstance(state.get(key), dict):
            value = {**state[key], **value}
        state[key] = value
    return state


def load_shards(folder: str | os.PathLike, state: dict, process_group=None) -> None:
    """Collective: fills ``state`` (sharded state dicts, e.g. of
    ``torch.distributed.checkpoint.state_dict.get_model_state_dict``) in place
    from ``folder``, whatever the world size that wrote it. The description
    and the non-tensor values are read as :mod:`.description` says: a
    checkpoint naming any other code is refused (ValueError naming the file)."""
    metadata = read_description(Path(folder) / METADATA_NAME)
    with one_line_failures(folder):
        dcp.load(
            state,
            storage_reader=DescribedReader(folder, metadata),
            planner=WeightsOnlyPlanner(folder),
            process_group=process_group,
        )
