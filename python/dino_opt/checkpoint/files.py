"""Files written so that a crash never leaves a torn one: a temporary file,
fsync, rename, fsync of the folder; write errors named by their cause."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import tempfile
from pathlib import Path

__all__ = [
    "CheckpointWriteError",
    "atomic_write",
    "fsync_dir",
    "temporary_file",
    "temporary_folder",
]

# The process's umask, read once (os.umask can only be read by setting it).
_UMASK = os.umask(0o022)
os.umask(_UMASK)
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


def fsync_dir(directory: Path) -> None:
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


def temporary_file(path: Path, write) -> Path:
    """``write(file)`` (a binary file object) fills a temporary file beside
    ``path`` (``.NAME.*.tmp``, readable as the umask allows), which is
    flushed and fsync-ed; returns its path, for the caller to rename. On any
    failure the temporary file is removed and the exception re-raised."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)  # mkstemp's 0600 would hide the file from the group
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        _unlink_quietly(tmp)
        raise
    return Path(tmp)


def temporary_folder(path: Path) -> Path:
    """A new empty folder beside ``path`` (``.NAME.*.tmp``, readable as the
    umask allows, not mkdtemp's 0700), to fill and rename onto it."""
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"))
    try:
        os.chmod(tmp, 0o777 & ~_UMASK)
    except BaseException:
        tmp.rmdir()
        raise
    return tmp


def atomic_write(path: Path, write) -> _HashingWriter:
    """Write a file atomically: ``write(hashing_writer)`` fills a temporary
    file next to ``path`` (:func:`temporary_file`), which is renamed onto
    ``path``. The directory fsync is left to the caller, which may batch
    several renames. On any failure the temporary file is removed and the
    exception re-raised; ``path`` is untouched."""
    writer = None

    def hashed(f) -> None:
        nonlocal writer
        writer = _HashingWriter(f)
        write(writer)

    tmp = temporary_file(path, hashed)
    try:
        os.replace(tmp, path)
    except BaseException:
        _unlink_quietly(tmp)
        raise
    return writer


def _file_sha256(path: Path) -> tuple[str, int]:
    sha = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            sha.update(chunk)
            size += len(chunk)
    return sha.hexdigest(), size
