"""Unpacks the files of Debian packages into a prefix, as `dpkg -x` does, with
the standard library alone (the GPU machine need not have dpkg).

A .deb is an `ar` archive whose member data.tar.{xz,gz,bz2} holds the files;
control scripts are not run and dependencies are not followed: the prefix gets
exactly the files of the packages given.

    python scripts/unpack_debs.py PREFIX third_party/debs/*.deb
"""

from __future__ import annotations

import io
import sys
import tarfile
from pathlib import Path

AR_MAGIC = b"!<arch>\n"
HEADER = 60  # name 16, mtime 12, uid 6, gid 6, mode 8, size 10, magic 2


def ar_members(data: bytes, path: Path):
    """(name, bytes) of each member of an ar archive."""
    if not data.startswith(AR_MAGIC):
        raise ValueError(f"{path}: not a Debian package (no ar header)")
    pos = len(AR_MAGIC)
    while pos + HEADER <= len(data):
        header = data[pos : pos + HEADER]
        if header[58:60] != b"`\n":
            raise ValueError(f"{path}: corrupt ar member header at byte {pos}")
        name = header[:16].decode("ascii").strip().rstrip("/")
        size = int(header[48:58].decode("ascii").strip())
        start = pos + HEADER
        if start + size > len(data):
            raise ValueError(f"{path}: member {name} is cut short")
        yield name, data[start : start + size]
        pos = start + size + (size & 1)  # members are 2-byte aligned


def unpack(deb: Path, prefix: Path) -> list[str]:
    """Extracts the data member of `deb` into `prefix`; returns the files written."""
    for name, payload in ar_members(deb.read_bytes(), deb):
        if name.startswith("data.tar"):
            with tarfile.open(fileobj=io.BytesIO(payload)) as tar:
                tar.extractall(prefix, filter="tar")
                return [m.name for m in tar.getmembers() if m.isfile() or m.issym()]
    raise ValueError(f"{deb}: no data.tar member")


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print("usage: unpack_debs.py PREFIX DEB...", file=sys.stderr)
        return 2
    prefix = Path(argv[0])
    prefix.mkdir(parents=True, exist_ok=True)
    for deb in map(Path, argv[1:]):
        try:
            files = unpack(deb, prefix)
        except (OSError, ValueError, tarfile.TarError) as e:
            print(f"unpack_debs: {e}", file=sys.stderr)
            return 1
        print(f"{deb.name}: {len(files)} files into {prefix}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
