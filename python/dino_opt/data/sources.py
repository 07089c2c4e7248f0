"""Where the loader's images come from.

:func:`open_source` turns what ``data.root`` names into a native sample
source that :class:`~dino_opt.data.MultiCropLoader` (and the k-NN
evaluation) reads through the same pipeline:

- ``folder``: an ImageFolder directory (one sub-directory per class) or a
  flat directory of images; or a sequence of image paths (``files``);
- ``list``: a text or CSV file list (path, optional label), relative to a root;
- ``shards``: tar shards in the WebDataset layout (``{key}.jpg|png|webp``
  members, an optional ``{key}.cls``): one ``.tar``, a folder of them, a
  sequence, or a pattern (``shards-{0000..0127}.tar``, globs too); each shard's
  index is built once and kept beside it (or in a cache folder);
- ``hf``: a Hugging Face data set saved with ``save_to_disk`` (read with
  ``datasets.load_from_disk``, its Arrow files memory-mapped) or Parquet files
  with an image column (read with ``pyarrow``); the image bytes go to the
  decoder from the Arrow buffers, without copies or temporary files.

``format="auto"`` picks the kind from the name (see :func:`detect_format`).
"""

from __future__ import annotations

import glob
import hashlib
import itertools
import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..ops.native import _C

__all__ = [
    "FORMATS",
    "IMAGE_EXTENSIONS",
    "DataSource",
    "SourceError",
    "default_index_dir",
    "detect_format",
    "expand_pattern",
    "find_images",
    "index_candidates",
    "open_source",
    "shard_files",
    "sibling_split",
    "source_exists",
]

FORMATS = ("auto", "folder", "shards", "list", "hf")
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".tif", ".tiff", ".npy")
LIST_EXTENSIONS = (".txt", ".csv", ".lst", ".tsv")
#: A data source that cannot be used (a corrupt or truncated shard, a changed
#: shard, a file list or Parquet file that cannot be read); a ``ValueError``.
SourceError = _C.SourceError

_BRACE = re.compile(r"\{([^{}]*)\}")
_RANGE = re.compile(r"^(-?\d+)\.\.(-?\d+)$")
_IMAGE_COLUMNS = ("image", "img", "jpg", "jpeg", "png", "webp", "image_bytes")
_LABEL_COLUMNS = ("label", "labels", "class", "target", "cls")
SplitSpec = str | os.PathLike | Sequence[str | os.PathLike]


@dataclass(frozen=True)
class DataSource:
    """A native sample source and what it came from.

    ``native`` is the ``_C.SampleSource`` (``len``, ``read(i)`` -> bytes,
    ``label(i)``, ``labels()``, ``describe(i)``, ``read_stats()``,
    ``table_bytes``); ``format`` one of ``folder``, ``files``, ``list``,
    ``shards``, ``hf``; ``classes`` the class names of the labels (empty when
    the labels are bare integers or absent); ``spec`` what was opened.
    """

    native: Any
    format: str
    classes: list[str]
    spec: str
    shards: tuple[str, ...] = field(default=(), repr=False)

    def __len__(self) -> int:
        return len(self.native)

    def read(self, index: int) -> bytes:
        """Sample ``index``'s encoded image bytes."""
        return self.native.read(index)

    def label(self, index: int) -> int:
        return self.native.label(index)

    def labels(self) -> torch.Tensor:
        """Every sample's label, int64 (-1: none)."""
        return self.native.labels()

    def describe(self, index: int) -> str:
        """What names sample ``index`` in messages (a path, ``shard: member``, ``file: row N``)."""
        return self.native.describe(index)


# ---------------------------------------------------------------- names


def expand_pattern(pattern: str) -> list[str]:
    """The names a pattern stands for: brace ranges (``{0000..0127}``, zero
    padding kept), brace lists (``{a,b}``), then shell globs (``*``, ``?``,
    ``[...]``, sorted). Brace names are returned whether or not they exist;
    a glob that matches nothing gives nothing."""
    parts: list[list[str]] = []
    pos = 0
    for m in _BRACE.finditer(pattern):
        parts.append([pattern[pos : m.start()]])
        pos = m.end()
        body = m.group(1)
        r = _RANGE.match(body)
        if r:
            lo, hi = int(r.group(1)), int(r.group(2))
            width = len(r.group(1)) if r.group(1).startswith("0") else 0
            step = 1 if hi >= lo else -1
            parts.append([str(i).zfill(width) for i in range(lo, hi + step, step)])
        elif "," in body:
            parts.append(body.split(","))
        else:
            raise ValueError(
                f"pattern {pattern!r}: {{{body}}} is neither a range a..b nor a list a,b"
            )
    parts.append([pattern[pos:]])
    names = ["".join(p) for p in itertools.product(*parts)]
    out: list[str] = []
    for name in names:
        out += sorted(glob.glob(name)) if glob.has_magic(name) else [name]
    return out


def _is_pattern(spec: str) -> bool:
    return bool(_BRACE.search(spec)) or glob.has_magic(spec)


def _listed(folder: Path, suffix: str) -> list[str]:
    return sorted(
        str(folder / e.name)
        for e in os.scandir(folder)
        if e.is_file() and e.name.lower().endswith(suffix)
    )


def detect_format(spec: SplitSpec) -> str:
    """The kind of data ``spec`` names: a sequence of ``.tar`` -> shards, of
    ``.parquet`` -> hf, of other paths -> files; a pattern by what it expands
    to; a ``.tar`` file -> shards, ``.txt``/``.csv``/``.lst``/``.tsv`` -> list,
    ``.parquet``/``.arrow`` -> hf; a folder with ``dataset_dict.json``,
    ``state.json`` or ``dataset_info.json`` -> hf, with ``.tar`` files ->
    shards, with ``.parquet`` files -> hf, else folder. Raises
    ``FileNotFoundError`` for a name that does not exist."""
    if not isinstance(spec, (str, os.PathLike)):
        names = [os.fspath(p) for p in spec]
        if names and all(n.lower().endswith(".tar") for n in names):
            return "shards"
        if names and all(n.lower().endswith(".parquet") for n in names):
            return "hf"
        return "files"
    text = os.fspath(spec)
    if _is_pattern(text) and not os.path.exists(text):
        names = expand_pattern(text)
        if not names:
            raise FileNotFoundError(f"data set pattern {text!r} matches no file")
        return detect_format(names)
    path = Path(text)
    if path.is_dir():
        if any(
            (path / f).is_file() for f in ("dataset_dict.json", "state.json", "dataset_info.json")
        ):
            return "hf"
        if _listed(path, ".tar"):
            return "shards"
        if _listed(path, ".parquet"):
            return "hf"
        return "folder"
    if not path.exists():
        raise FileNotFoundError(f"data set {text!r} does not exist")
    suffix = path.suffix.lower()
    if suffix == ".tar":
        return "shards"
    if suffix in LIST_EXTENSIONS:
        return "list"
    if suffix in (".parquet", ".arrow"):
        return "hf"
    raise ValueError(
        f"data set {text!r}: a file of unknown kind (a .tar shard, a .txt/.csv list, "
        "a .parquet or .arrow file); set data.format"
    )


def source_exists(spec: SplitSpec) -> bool:
    """Whether ``spec`` names data that exists (every file of a pattern)."""
    try:
        detect_format(spec)
        if isinstance(spec, (str, os.PathLike)) and _is_pattern(os.fspath(spec)):
            return all(os.path.exists(n) for n in expand_pattern(os.fspath(spec)))
        return True
    except (FileNotFoundError, ValueError):
        return False


def sibling_split(spec: str | os.PathLike, split: str) -> str | None:
    """The held-out split ``split`` ("val" or "test") beside the training data
    ``spec``, or None: a Hugging Face ``DatasetDict`` folder's split (val:
    ``validation`` or ``val``); the name with its last ``train`` replaced
    (``train.txt`` -> ``val.txt``, ``train-{0..9}.tar`` -> ``val-{0..9}.tar``);
    a folder's sibling ``val``/``test``."""
    text = os.fspath(spec)
    names = ("validation", "val") if split == "val" else (split,)
    path = Path(text)
    if (path / "dataset_dict.json").is_file():
        return next((str(path / n) for n in names if (path / n).is_dir()), None)
    head, tail = os.path.split(text.rstrip("/"))
    candidates = []
    if "train" in tail:
        i = tail.rfind("train")
        candidates += [os.path.join(head, tail[:i] + n + tail[i + 5 :]) for n in names]
    if path.is_dir():
        candidates += [str(path.parent / n) for n in names]
    return next((c for c in candidates if c != text and source_exists(c)), None)


# ---------------------------------------------------------------- folders


def find_images(
    source: str | os.PathLike | Sequence[str | os.PathLike], labels: Sequence[int] | None = None
) -> tuple[list[str], list[int], list[str]]:
    """``(paths, labels, classes)`` of a data set of image files.

    ``source`` is an ImageFolder directory (one sub-directory per class, sorted
    class names give the labels; files found recursively, symlinks followed),
    a directory of images without class folders (labels -1), or a sequence of
    file paths with optional ``labels``. Raises ``FileNotFoundError`` for a
    missing directory and ``ValueError`` for one with no image files.
    """
    if isinstance(source, (str, os.PathLike)):
        if labels is not None:
            raise ValueError("labels are given by the class folders when source is a directory")
        root = Path(source)
        if not root.is_dir():
            raise FileNotFoundError(f"data set directory {str(root)!r} does not exist")
        classes = sorted(e.name for e in os.scandir(root) if e.is_dir())
        paths: list[str] = []
        out_labels: list[int] = []
        for label, name in enumerate(classes):
            found = _walk_images(root / name)
            paths += found
            out_labels += [label] * len(found)
        direct = sorted(
            str(root / e.name)
            for e in os.scandir(root)
            if e.is_file() and e.name.lower().endswith(IMAGE_EXTENSIONS)
        )
        if direct and not paths:
            return direct, [-1] * len(direct), []
        if not paths:
            raise ValueError(f"no image files ({', '.join(IMAGE_EXTENSIONS)}) under {str(root)!r}")
        return paths, out_labels, classes
    paths = [os.fspath(p) for p in source]
    if not paths:
        raise ValueError("the list of image paths is empty")
    if labels is None:
        return paths, [-1] * len(paths), []
    out_labels = [int(v) for v in labels]
    if len(out_labels) != len(paths):
        raise ValueError(f"labels has {len(out_labels)} entries for {len(paths)} paths")
    return paths, out_labels, []


def _walk_images(folder: Path) -> list[str]:
    found = []
    for dirpath, dirnames, filenames in os.walk(folder, followlinks=True):
        dirnames.sort()
        found += [
            os.path.join(dirpath, f)
            for f in sorted(filenames)
            if f.lower().endswith(IMAGE_EXTENSIONS)
        ]
    return found


def _open_files(spec, labels) -> DataSource:
    paths, label_list, classes = find_images(spec, labels)
    root = ""
    if isinstance(spec, (str, os.PathLike)):
        root = os.fspath(spec).rstrip("/") + "/"
        paths = [p[len(root) :] for p in paths]  # every path starts with the root
    native = _C.FileSource(root, paths, label_list)
    kind = "folder" if isinstance(spec, (str, os.PathLike)) else "files"
    return DataSource(native, kind, classes, _describe_spec(spec))


def _open_list(spec, list_root) -> DataSource:
    path = Path(spec)
    if not path.is_file():
        raise FileNotFoundError(f"file list {str(path)!r} does not exist")
    root = os.fspath(list_root) if list_root is not None else str(path.parent)
    native, classes = _C.read_file_list(str(path), root)
    return DataSource(native, "list", list(classes), str(path))


# ---------------------------------------------------------------- shards


def default_index_dir() -> Path:
    """Where shard indexes go when they cannot be written beside their shard:
    ``$DINO_OPT_CACHE/shard-index``, else ``~/.cache/dino_opt/shard-index``."""
    env = os.environ.get("DINO_OPT_CACHE")
    base = Path(env).expanduser() if env else Path.home() / ".cache" / "dino_opt"
    return base / "shard-index"


def shard_files(spec) -> list[str]:
    """The shard files ``spec`` names (a folder's ``.tar`` files, a pattern,
    a sequence, one file); ``FileNotFoundError`` names the first missing one."""
    if not isinstance(spec, (str, os.PathLike)):
        names = [os.fspath(p) for p in spec]
    elif Path(spec).is_dir():
        names = _listed(Path(spec), ".tar")
        if not names:
            raise ValueError(f"{os.fspath(spec)!r} holds no .tar shards")
    elif _is_pattern(os.fspath(spec)) and not os.path.exists(os.fspath(spec)):
        names = expand_pattern(os.fspath(spec))
    else:
        names = [os.fspath(spec)]
    if not names:
        raise FileNotFoundError(f"shards {_describe_spec(spec)!r}: no file matches")
    missing = [n for n in names if not os.path.isfile(n)]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise FileNotFoundError(
            f"shard {missing[0]!r}{more} does not exist (data: {_describe_spec(spec)!r})"
        )
    return names


def index_candidates(shard: str, index_dir: str | os.PathLike | None) -> list[str]:
    """Where shard ``shard``'s index may be: beside it, and a cache folder
    (``index_dir`` first when given)."""
    absolute = os.path.abspath(shard)
    digest = hashlib.sha1(absolute.encode()).hexdigest()[:16]
    cached = []
    for folder in [Path(index_dir)] if index_dir is not None else [default_index_dir()]:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            cached.append(str(folder / f"{Path(shard).name}-{digest}.idx"))
        except OSError:
            pass
    beside = [absolute + ".idx"]
    return cached + beside if index_dir is not None else beside + cached


def _open_shards(spec, index_dir, streams: int) -> DataSource:
    shards = shard_files(spec)
    candidates = [index_candidates(s, index_dir) for s in shards]
    native = _C.ShardSource(shards, candidates, streams=int(streams))
    names = Path(shards[0]).parent / "classes.txt"
    classes = names.read_text().splitlines() if names.is_file() else []
    return DataSource(native, "shards", classes, _describe_spec(spec), tuple(shards))


# ---------------------------------------------------------------- Hugging Face


def _hf_features(schema) -> dict:
    """The ``datasets`` features a Parquet or Arrow schema records (``{}``: none)."""
    raw = (schema.metadata or {}).get(b"huggingface")
    if not raw:
        return {}
    try:
        return json.loads(raw).get("info", {}).get("features", {}) or {}
    except (ValueError, AttributeError):
        return {}


def _pick_columns(schema, features: dict, where: str, image_column, label_column):
    import pyarrow as pa

    names = list(schema.names)
    listed = ", ".join(names) or "none"
    if image_column is not None:
        if image_column not in names:
            raise ValueError(f"{where}: no column {image_column!r} (columns: {listed})")
        image = image_column
    else:

        def binary(t):
            return pa.types.is_binary(t) or pa.types.is_large_binary(t)

        typed = [n for n in names if (features.get(n) or {}).get("_type") == "Image"]
        structs = [
            n
            for n in names
            if pa.types.is_struct(schema.field(n).type)
            and schema.field(n).type.get_field_index("bytes") >= 0
        ]
        named = [n for n in names if n.lower() in _IMAGE_COLUMNS and binary(schema.field(n).type)]
        found = typed or structs or named
        if not found:
            raise ValueError(
                f"{where}: no image column (columns: {listed}); an image column has the "
                "datasets Image feature, or holds {bytes, path} or binary values; name it with "
                "image_column (data.image_column)"
            )
        image = found[0]
    if label_column is not None:
        if label_column not in names:
            raise ValueError(f"{where}: no column {label_column!r} (columns: {listed})")
        return image, label_column
    typed = [n for n in names if (features.get(n) or {}).get("_type") == "ClassLabel"]
    named = [n for n in names if n.lower() in _LABEL_COLUMNS and n != image]
    found = typed or named
    return image, (found[0] if found else None)


def _binary_buffers(array, keep: list) -> tuple:
    """(validity, offsets, data, offset, large) addresses of a binary or string array."""
    import pyarrow as pa
    import pyarrow.compute as pc

    t = array.type
    if not (
        pa.types.is_large_binary(t)
        or pa.types.is_binary(t)
        or pa.types.is_string(t)
        or pa.types.is_large_string(t)
    ):
        array = pc.cast(array, pa.large_binary())
        t = array.type
    keep.append(array)
    validity, offsets, data = array.buffers()[:3]
    large = pa.types.is_large_binary(t) or pa.types.is_large_string(t)
    valid = validity.address if validity is not None and array.null_count else 0
    return valid, offsets.address, data.address if data is not None else 0, array.offset, large


def _image_chunks(column, file_index: int, keep: list, where: str) -> list[tuple]:
    import pyarrow as pa

    chunks, row = [], 0
    for chunk in column.chunks:
        keep.append(chunk)
        if pa.types.is_struct(chunk.type):
            fields = dict(zip([f.name for f in chunk.type], chunk.flatten(), strict=True))
            data = fields.get("bytes")
            if data is None:
                raise ValueError(f"{where}: the image column has no 'bytes' field")
            paths = fields.get("path")
        else:
            data, paths = chunk, None
        b = _binary_buffers(data, keep)
        p = _binary_buffers(paths, keep) if paths is not None else (0, 0, 0, 0, False)
        chunks.append((len(chunk), *b, *p, file_index, row))
        row += len(chunk)
    return chunks


def _label_values(column, features: dict, name: str) -> tuple[list[int], list[str]]:
    import pyarrow as pa
    import pyarrow.compute as pc

    names = (features.get(name) or {}).get("names") or []
    if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
        names = sorted(set(pc.unique(column).drop_null().to_pylist()))
        column = pc.index_in(column, value_set=pa.array(names, type=column.type))
    values = pc.fill_null(column, -1).to_numpy(zero_copy_only=False)
    return [int(v) for v in values], list(names)


def _hf_files(spec) -> list[str]:
    if isinstance(spec, (str, os.PathLike)):
        p = os.fspath(spec)
        if Path(p).is_dir():
            files = _listed(Path(p), ".parquet")
        else:
            files = expand_pattern(p) if _is_pattern(p) and not os.path.exists(p) else [p]
    else:
        files = [os.fspath(f) for f in spec]
    for f in files:
        if not os.path.isfile(f):
            raise FileNotFoundError(f"data file {f!r} does not exist")
    return files


def _open_hf(spec, image_column, label_column) -> DataSource:
    on_disk = isinstance(spec, (str, os.PathLike)) and Path(spec).is_dir()
    if on_disk and not _listed(Path(spec), ".parquet"):
        files = [os.fspath(spec)]
        tables = [_load_from_disk(Path(spec))]
    else:
        files = _hf_files(spec)
        tables = [_read_table(f, image_column, label_column) for f in files]
    keep: list = [tables]
    chunks, labels, classes = [], [], []
    for i, (table, features) in enumerate(tables):
        image, label = _pick_columns(table.schema, features, files[i], image_column, label_column)
        chunks += _image_chunks(table.column(image), i, keep, files[i])
        if label is None:
            labels += [-1] * table.num_rows
        else:
            values, names = _label_values(table.column(label), features, label)
            labels += values
            classes = classes or names
    native = _C.ArrowSource(files, chunks, labels, keep)
    return DataSource(native, "hf", classes, _describe_spec(spec))


def _read_table(path: str, image_column, label_column):
    """A Parquet (or Arrow) file's image and label columns, and its features."""
    import pyarrow.parquet as pq

    if path.lower().endswith(".arrow"):
        import datasets

        ds = datasets.Dataset.from_file(path)
        return ds.data.table, _features_of(ds)
    try:
        schema = pq.read_schema(path)
    except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError
        raise SourceError(f"{path}: not a readable Parquet file ({e})") from e
    features = _hf_features(schema)
    columns = [c for c in _pick_columns(schema, features, path, image_column, label_column) if c]
    try:
        table = pq.read_table(path, columns=columns, memory_map=True)
    except (OSError, ValueError) as e:
        raise SourceError(f"{path}: not a readable Parquet file ({e})") from e
    return table, features


def _features_of(ds) -> dict:
    return ds.features.to_dict()


def _load_from_disk(folder: Path):
    import datasets

    if (folder / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in folder.iterdir() if p.is_dir())
        if "train" not in splits:
            raise ValueError(
                f"{str(folder)!r} is a DatasetDict without a 'train' split (splits: "
                f"{', '.join(splits)}); name the split's folder"
            )
        folder = folder / "train"
    ds = datasets.load_from_disk(str(folder))
    if len(ds) != ds.data.num_rows:  # a selection over the table: write it out in order
        ds = ds.flatten_indices()
    return ds.data.table, _features_of(ds)


# ---------------------------------------------------------------- the entry


def _describe_spec(spec) -> str:
    if isinstance(spec, (str, os.PathLike)):
        return os.fspath(spec)
    names = [os.fspath(p) for p in spec]
    return f"{names[0]} ... ({len(names)} files)" if len(names) > 1 else (names[0] if names else "")


def open_source(
    spec: SplitSpec | DataSource,
    *,
    format: str = "auto",
    labels: Sequence[int] | None = None,
    list_root: str | os.PathLike | None = None,
    index_dir: str | os.PathLike | None = None,
    image_column: str | None = None,
    label_column: str | None = None,
    shard_streams: int = 4,
) -> DataSource:
    """The data ``spec`` names, as a :class:`DataSource`.

    ``format``: ``auto`` (:func:`detect_format`), ``folder``, ``shards``,
    ``list`` or ``hf``. ``labels``: with a sequence of image paths.
    ``list_root``: the folder a file list's relative paths start from
    (default: the list's folder). ``index_dir``: where shard indexes are
    kept (default: beside each shard, else :func:`default_index_dir`).
    ``image_column``, ``label_column``: the columns of a Hugging Face data set
    (default: found by their features or names). ``shard_streams``: shards a
    rank reads at once. A ``DataSource`` is returned as it is.

    Raises ``FileNotFoundError`` naming a missing folder, file or shard,
    ``ValueError`` for data without images (and :data:`SourceError`, a
    ``ValueError``, for a truncated or corrupt shard, naming it and the member).
    """
    if isinstance(spec, DataSource):
        return spec
    if format not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {format!r}")
    kind = detect_format(spec) if format == "auto" else format
    if labels is not None and kind not in ("files", "folder"):
        raise ValueError("labels go with a sequence of image paths; other sources carry their own")
    if kind in ("folder", "files"):
        if (
            isinstance(spec, (str, os.PathLike))
            and _is_pattern(os.fspath(spec))
            and not (os.path.exists(spec))
        ):
            spec = expand_pattern(os.fspath(spec))
        return _open_files(spec, labels)
    if not isinstance(spec, (str, os.PathLike)) and kind == "list":
        raise ValueError("format 'list' takes one list file")
    if kind == "list":
        return _open_list(spec, list_root)
    if kind == "shards":
        return _open_shards(spec, index_dir, shard_streams)
    return _open_hf(spec, image_column, label_column)
