"""The files a command writes for the user (exports, embeddings, predictions,
probe heads, results), never a torn one and never over what it reads.

- :func:`check_output`, before any work: an existing output (or one of its
  side files) is refused unless ``force``; with ``force``, an output that
  is or holds a source, the working folder or a parent of either is refused
  too (replacing it would remove them). Nothing is removed there.
- :func:`write_file`, :func:`write_folder`, :func:`write_files`: every file
  goes to a temporary file beside its target, is fsync-ed and renamed onto
  it; a folder is filled beside it and swapped in whole; an old output is
  removed only once the new one is in place. A writer killed at any moment
  leaves the old output or the new one (and at worst a hidden
  ``.NAME.*.tmp`` beside it), never a truncated one. :func:`write_files`
  writes a file and its side files together (each to a temporary file
  first, then renamed) and removes the side files of an earlier output that
  this one has not.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from .files import _unlink_quietly, fsync_dir, temporary_file, temporary_folder

__all__ = ["check_output", "replace_with", "write_file", "write_files", "write_folder"]


def _absolute(path: Path) -> Path:
    """``path`` made absolute, its folders resolved but not a link at its
    end (replacing a link replaces the link, not what it points to)."""
    path = Path(os.path.abspath(path))
    return path.parent.resolve() / path.name


def _guard(output: Path, sources: Iterable) -> None:
    target = _absolute(output)
    kept = [("the working folder", Path.cwd().resolve())]
    kept += [("the source", Path(s).resolve()) for s in sources if s is not None]
    for what, path in kept:
        if target == path or target in path.parents:
            held = "is" if target == path else "holds"
            raise ValueError(
                f"--force would replace {str(output)!r}, which {held} {what} {str(path)!r}: "
                "refused, nothing removed; choose another output"
            )


def check_output(
    output: str | os.PathLike,
    force: bool,
    sources: Iterable = (),
    *,
    side_files: Iterable = (),
    what: str = "output",
) -> Path:
    """Checks, before any work, that ``output`` may be written: refused
    (FileExistsError) when it or one of its ``side_files`` exists, unless
    ``force``; refused (ValueError) with ``force`` when it is or holds one
    of ``sources`` (the paths the command reads), the working folder, or a
    parent of either. Makes its folder; removes nothing. Returns it as a Path."""
    output = Path(output)
    present = [p for p in (output, *map(Path, side_files)) if p.exists() or p.is_symlink()]
    if present and not force:
        raise FileExistsError(
            f"{what} {str(present[0])!r} exists; choose another path or pass --force to replace it"
        )
    if force:
        _guard(output, sources)
    output.parent.mkdir(parents=True, exist_ok=True)
    return output


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        _unlink_quietly(path)


def replace_with(new: Path, path: Path) -> None:
    """Renames ``new`` (complete, fsync-ed, in ``path``'s file system) onto
    ``path``: a file over a file in one step; over a folder (or a folder
    over anything), the old one first renamed aside and removed once the
    new one is in place."""
    aside = None
    if (path.is_dir() and not path.is_symlink()) or (new.is_dir() and path.exists()):
        aside = path.with_name(f".{path.name}.{os.getpid()}.replaced")
        _remove(aside)
        os.replace(path, aside)
    os.replace(new, path)
    fsync_dir(path.parent)
    if aside is not None:
        _remove(aside)


def write_file(path: str | os.PathLike, write: Callable) -> Path:
    """``write(file)`` (a binary file object) fills ``path`` atomically (the
    module docstring), replacing whatever was there once it is complete."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    replace_with(temporary_file(path, write), path)
    return path


def write_files(files: Mapping, stale: Iterable = ()) -> list[Path]:
    """Writes each ``path: write`` of ``files`` (an output and its side
    files) to a temporary file beside it, then renames them all into place
    and removes the paths of ``stale`` (an earlier output's side files) that
    are not among them. Returns the paths written."""
    done: list[tuple[Path, Path]] = []
    try:
        for path, write in files.items():
            path = Path(path)
            path.parent.mkdir(parents=True, exist_ok=True)
            done.append((temporary_file(path, write), path))
    except BaseException:
        for tmp, _ in done:
            _unlink_quietly(tmp)
        raise
    for tmp, path in done:
        replace_with(tmp, path)
    written = [path for _, path in done]
    for path in map(Path, stale):
        if path not in written and (path.exists() or path.is_symlink()):
            _remove(path)
    with contextlib.suppress(OSError):
        for folder in {p.parent for p in written}:
            fsync_dir(folder)
    return written


def write_folder(path: str | os.PathLike, fill: Callable[[Path], None]) -> Path:
    """``fill(folder)`` writes the files of ``path`` into a new folder beside
    it, which then replaces ``path`` whole (the old one removed after)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_folder(path)
    try:
        fill(tmp)
        for file in tmp.rglob("*"):
            if file.is_file():
                with open(file, "rb") as f:
                    os.fsync(f.fileno())
        fsync_dir(tmp)
        replace_with(tmp, path)
    except BaseException:
        _remove(tmp)
        raise
    return path
