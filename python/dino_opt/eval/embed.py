"""Embeddings of any images, labelled or not: each image's class token, the
mean of its patch tokens and, on request, its map of patch tokens, with the
image's name, in data set order; unreadable images are left out and named.

:func:`embed_images` runs a frozen backbone over a data source on the
native loader's threads (the evaluation transform of
:class:`~dino_opt.eval.features.EvalLoader`), on one process or sharded over
the ranks of a process group; :func:`write_embeddings` writes the result as
``.npy`` files, ``.npz``, ``.safetensors`` or Parquet, atomically, after
:func:`check_embeddings_output` has checked the output before the pass.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from safetensors.torch import save
from torch import nn
from tqdm.auto import tqdm

from ..checkpoint import check_output, write_file, write_files
from ..data import DataSource
from ..models import eval_mode
from ..ops.library import IMAGENET_MEAN, IMAGENET_STD
from .dense import tokens_as_map, vit_outputs
from .features import EvalLoader, amp_dtype_of, gather_rows, shard_of

__all__ = [
    "EMBED_FORMATS",
    "Embeddings",
    "check_embeddings_output",
    "embed_images",
    "side_files",
    "write_embeddings",
]

#: The file types :func:`write_embeddings` writes, by suffix.
EMBED_FORMATS = (".npy", ".npz", ".safetensors", ".parquet")


class Embeddings(NamedTuple):
    """What :func:`embed_images` returns: the ``names`` of the embedded
    images (a file's path, ``shard: member``, ...) in data set order, their
    ``cls`` tokens ``[N, D]`` (a network without tokens: its pooled
    feature), ``mean_patch`` (the mean of the patch tokens, ``[N, D]``; None
    without tokens), ``patches`` (``[N, D, h, w]`` when asked for, else None),
    all float32 on the CPU, and the images that could not be read
    (``failed``: ``"name: cause"``), which have no rows."""

    names: list[str]
    cls: torch.Tensor
    mean_patch: torch.Tensor | None
    patches: torch.Tensor | None
    failed: list[str]


def _tokens(model: nn.Module, images: torch.Tensor, patch_maps: bool) -> list[torch.Tensor]:
    """``[cls, mean_patch(, patches)]`` of a batch; a network without
    DINOv2's ``forward_features``: ``[its output]``."""
    if not callable(getattr(model, "forward_features", None)):
        if patch_maps:
            raise ValueError(
                f"patch maps need a ViT's patch tokens; {type(model).__name__} has none"
            )
        out = model(images)
        if not isinstance(out, torch.Tensor) or out.dim() != 2:
            raise ValueError(f"{type(model).__name__} must map [B, 3, H, W] to [B, D] features")
        return [out]
    cls, tokens, grid = vit_outputs(model, images)
    out = [cls, tokens.mean(dim=1)]
    if patch_maps:
        out.append(tokens_as_map(tokens, grid))
    return out


def _embed_batches(
    model, loader, device, dtype, patch_maps: bool, progress: bool
) -> tuple[list, torch.Tensor]:
    """Every batch's outputs (a list of ``[rows, ...]`` tensors per output)
    and the data set index of each row, the first row of an index only (the
    loader puts another image in an unreadable one's place)."""
    parts: list[list[torch.Tensor]] = []
    indices: list[torch.Tensor] = []
    seen: set[int] = set()
    batches = -(-len(loader.indices) // loader.batch_size)
    for images, _, index in tqdm(loader, total=batches, unit="batch", disable=not progress):
        keep = [i for i, k in enumerate(index.tolist()) if k not in seen]
        seen.update(index.tolist())
        if not keep:
            continue
        keep_t = torch.tensor(keep)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            outs = _tokens(model, images[keep_t].to(device, non_blocking=True), patch_maps)
        parts.append([o.float().cpu() for o in outs])
        indices.append(index[keep_t])
    return parts, (torch.cat(indices) if indices else torch.empty(0, dtype=torch.int64))


def _in_order(parts: list, index: torch.Tensor, n: int, rank_world: tuple, device) -> list:
    """Each output's rows of every rank at their data set index (``n``
    rows; those of unreadable images are left out after)."""
    outputs = []
    for k in range(len(parts[0]) if parts else 0):
        mine = torch.cat([p[k] for p in parts])
        flat = mine.reshape(len(mine), -1)
        if rank_world[1] > 1:
            rows = gather_rows(flat, index, n, device)
        else:
            rows = torch.zeros(n, flat.shape[1])
            rows[index] = flat
        outputs.append(rows.reshape(n, *mine.shape[1:]))
    return outputs


def _found(index: torch.Tensor, n: int, rank_world: tuple, device) -> torch.Tensor:
    """Whether each of the ``n`` images was embedded on some rank."""
    found = torch.zeros(n, 1)
    found[index] = 1.0
    if rank_world[1] > 1:
        found = gather_rows(found[index], index, n, device)  # zeros where no rank had it
    return found[:, 0] > 0


@torch.no_grad()
def embed_images(
    model: nn.Module,
    source: str | os.PathLike | DataSource,
    image_size: int = 224,
    *,
    device: str | torch.device = "cpu",
    batch_size: int = 64,
    patch_maps: bool = False,
    amp: bool | torch.dtype | None = None,
    num_threads: int | None = None,
    mean: Sequence[float] = IMAGENET_MEAN,
    std: Sequence[float] = IMAGENET_STD,
    distributed: bool | None = None,
    progress: bool = False,
    resize_size: int | None = None,
    image_mode: str = "rgb",
) -> Embeddings:
    """The :class:`Embeddings` of every image of ``source`` (anything
    :func:`~dino_opt.data.open_source` opens, labelled or not) under the
    frozen ``model`` (a ViT with DINOv2's ``forward_features``, or any
    network mapping images to ``[B, D]``), at ``image_size`` (shorter side
    to ``resize_size``, default ``S * 256 / 224``, centre crop,
    ``mean``/``std``), ``batch_size`` images at a time on ``device`` (``amp``
    as :func:`~dino_opt.eval.extract_features`).
    With ``distributed`` (None: when a process group of several ranks is
    initialised) each rank embeds its shard and every rank gets the whole.
    ``progress``: a progress bar of this rank's batches. ``image_mode``:
    ``native`` reads images at their stored depth and channels (``mean``
    and ``std`` then one per channel)."""
    device = torch.device(device)
    rank, world = shard_of(distributed)
    with eval_mode(model):
        with EvalLoader(
            source,
            image_size,
            batch_size,
            rank=rank,
            world_size=world,
            num_threads=num_threads,
            mean=mean,
            std=std,
            labelled=False,
            on_error="skip",
            pin_memory=device.type == "cuda",
            resize_size=resize_size,
            image_mode=image_mode,
        ) as loader:
            parts, index = _embed_batches(
                model, loader, device, amp_dtype_of(amp, device), patch_maps, progress
            )
            names = [loader.source.describe(i) for i in range(loader.num_samples)]
            failed = loader.stats().get("skipped_files", [])
    found = _found(index, len(names), (rank, world), device)
    outputs = [o[found] for o in _in_order(parts, index, len(names), (rank, world), device)]
    if not outputs:
        raise ValueError(f"no image of {str(source)!r} could be read ({len(failed)} failed)")
    kept = [name for name, ok in zip(names, found.tolist(), strict=True) if ok]
    missing = [name for name, ok in zip(names, found.tolist(), strict=True) if not ok]
    failed = failed if len(failed) == len(missing) else [f"{m}: unreadable" for m in missing]
    outputs += [None] * (3 - len(outputs))
    return Embeddings(kept, outputs[0], outputs[1], outputs[2], failed)


def side_files(path: str | os.PathLike) -> list[Path]:
    """Every side file a ``.npy`` output ``path`` may have beside it (those
    of an earlier version too: ``NAME.paths.txt``), written or removed with it."""
    path = Path(path)
    if path.suffix != ".npy":
        return []
    stem = path.with_suffix("")
    return [stem.with_name(f"{stem.name}.{side}") for side in _SIDES]


_SIDES = ("mean_patch.npy", "patches.npy", "paths.json", "json", "paths.txt")


def check_embeddings_output(
    path: str | os.PathLike, patch_maps: bool, force: bool, sources: Sequence = ()
) -> Path:
    """Checks, before any image is embedded, that ``path`` can take the
    embeddings: its file type, patch maps in a format that holds them, and
    (:func:`~dino_opt.checkpoint.check_output`) no output or side file of
    it there unless ``force``, never one that is or holds a source."""
    path = Path(path)
    if path.suffix not in EMBED_FORMATS:
        raise ValueError(_file_type(path))
    if patch_maps and path.suffix == ".parquet":
        raise ValueError(_PARQUET_MAPS)
    return check_output(path, force, sources, side_files=side_files(path))


_PARQUET_MAPS = (
    "Parquet holds the class and mean patch tokens; patch maps need .npy, .npz or .safetensors"
)


def _file_type(path: Path) -> str:
    return f"output {str(path)!r}: the file type must be one of {', '.join(EMBED_FORMATS)}"


def _saver(value: np.ndarray):
    return lambda f: np.save(f, value)


def _npy(emb: Embeddings, path: Path, meta: dict) -> list[Path]:
    """The class tokens at ``path``; beside it the other arrays, the names
    (a JSON list) and ``meta`` with the files written (``files``), all
    renamed into place together; an earlier output's other side files removed."""
    stem = path.with_suffix("")
    files = {path: _saver(emb.cls.numpy())}
    for name in ("mean_patch", "patches"):
        value = getattr(emb, name)
        if value is not None:
            files[stem.with_name(f"{stem.name}.{name}.npy")] = _saver(value.numpy())
    names = (json.dumps(emb.names) + "\n").encode()
    files[stem.with_name(f"{stem.name}.paths.json")] = lambda f: f.write(names)
    manifest = stem.with_name(f"{stem.name}.json")
    listed = {**meta, "files": [p.name for p in (*files, manifest)]}
    text = (json.dumps(listed, indent=2) + "\n").encode()
    files[manifest] = lambda f: f.write(text)
    return write_files(files, stale=side_files(path))


def _arrays(emb: Embeddings) -> dict[str, torch.Tensor]:
    return {
        k: getattr(emb, k) for k in ("cls", "mean_patch", "patches") if getattr(emb, k) is not None
    }


def _parquet(emb: Embeddings, path: Path, meta: dict) -> list[Path]:
    if emb.patches is not None:
        raise ValueError(_PARQUET_MAPS)
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ImportError("writing Parquet needs pyarrow (pip install pyarrow)") from e
    columns = {"path": pa.array(emb.names)}
    for name, value in _arrays(emb).items():
        columns[name] = pa.FixedSizeListArray.from_arrays(
            pa.array(value.reshape(-1).numpy()), value.shape[1]
        )
    table = pa.table(columns).replace_schema_metadata({"dino_opt": json.dumps(meta)})
    return [write_file(path, lambda f: pq.write_table(table, f))]


def write_embeddings(emb: Embeddings, path: str | os.PathLike, meta: dict | None = None) -> list:
    """Writes ``emb`` to ``path`` by its suffix (:data:`EMBED_FORMATS`):
    ``.npy``: the class tokens, with ``NAME.mean_patch.npy``,
    ``NAME.patches.npy``, the images' names as a JSON list in
    ``NAME.paths.json`` and ``meta`` with the files written in ``NAME.json``
    beside it (an earlier output's other side files removed); ``.npz`` and
    ``.safetensors``: one array each and the names (``paths``: an array of
    strings in ``.npz``, JSON in the safetensors metadata with ``meta``);
    ``.parquet``: a row per image (``path``, ``cls``, ``mean_patch``), ``meta``
    in the schema's metadata. Each file is written to a temporary file
    beside it and renamed into place, replacing an existing one (see
    :func:`check_embeddings_output` for the checks before). Returns the
    files written."""
    path, meta = Path(path), dict(meta or {})
    if path.suffix not in EMBED_FORMATS:
        raise ValueError(_file_type(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".npy":
        return _npy(emb, path, meta)
    if path.suffix == ".parquet":
        return _parquet(emb, path, meta)
    arrays = _arrays(emb)
    if path.suffix == ".npz":
        values = {k: v.numpy() for k, v in arrays.items()}
        paths, meta_text = np.array(emb.names), np.array(json.dumps(meta))
        return [write_file(path, lambda f: np.savez(f, paths=paths, meta=meta_text, **values))]
    text = {"paths": json.dumps(emb.names), "dino_opt": json.dumps(meta)}
    data = save({k: v.contiguous() for k, v in arrays.items()}, metadata=text)
    return [write_file(path, lambda f: f.write(data))]
