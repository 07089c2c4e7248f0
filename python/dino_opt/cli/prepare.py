"""``dino-opt prepare SRC DST``: a data set re-encoded at a bounded size
(:func:`~dino_opt.data.prepare_dataset`), or written as tar shards
(:func:`~dino_opt.data.write_shards`); ``dino-opt prepare SHARDS --verify``
checks shards written before (:func:`~dino_opt.data.verify_shards`)."""

from __future__ import annotations

import argparse
import sys

from ..data import prepare_dataset, verify_shards, write_shards
from ..data.dicom import parse_window, prepare_dicom

__all__ = ["add_parser", "run"]


def _failed(failed: list[str]) -> int:
    """The images ``prepare`` could not write, one line each on stderr; the exit status."""
    for line in failed:
        print(f"  failed: {line}", file=sys.stderr)
    return 1 if failed else 0


def run(args: argparse.Namespace) -> int:
    if args.dst is None:
        if not args.verify:
            raise ValueError("give DST (where to write), or --verify to check shards at SRC")
        check = verify_shards(args.src, num_threads=args.threads, progress=not args.quiet)
        print(
            f"{check['shards']} shards, {check['samples']} samples, {len(check['failed'])} problems"
        )
        for line in check["failed"]:
            print(f"  {line}", file=sys.stderr)
        return 1 if check["failed"] else 0
    if args.format == "shards":
        return _prepare_shards(args)
    if args.format == "dicom":
        return _prepare_dicom(args)
    r = prepare_dataset(
        args.src,
        args.dst,
        max_side=512 if args.max_side is None else args.max_side,
        quality=args.quality,
        num_threads=args.threads,
        overwrite=args.overwrite,
        progress=not args.quiet,
    )
    ratio = r["bytes_out"] / r["bytes_in"] if r["bytes_in"] else 0.0
    print(
        f"written {r['written']}, kept {r['kept']}, failed {len(r['failed'])}; "
        f"{r['bytes_in'] / 1e6:.1f} MB -> {r['bytes_out'] / 1e6:.1f} MB ({ratio:.2f}x)"
    )
    return _failed(r["failed"])


def _prepare_shards(args: argparse.Namespace) -> int:
    r = write_shards(
        args.src,
        args.dst,
        shard_size_mb=args.shard_size,
        max_side=args.max_side,
        quality=args.quality,
        seed=args.seed,
        shuffle=not args.no_shuffle,
        num_threads=args.threads,
        overwrite=args.overwrite,
        verify=not args.no_verify,
        progress=not args.quiet,
        source_format=args.src_format,
    )
    verified = "verified" if r["verified"] else "not verified"
    print(
        f"written {r['written']} samples into {len(r['shards'])} shards ({verified}), failed "
        f"{len(r['failed'])}; {r['bytes_in'] / 1e6:.1f} MB -> {r['bytes_out'] / 1e6:.1f} MB"
    )
    return _failed(r["failed"])


def _prepare_dicom(args: argparse.Namespace) -> int:
    r = prepare_dicom(
        args.src,
        args.dst,
        output=args.dicom_output,
        window=parse_window(args.window),
        num_threads=args.threads,
        progress=not args.quiet,
    )
    print(
        f"written {r['written']} images ({r['layout']}) from {r['files']} DICOM files, failed "
        f"{len(r['failed'])}; train with data.image_mode=native"
    )
    return _failed(r["failed"])


def add_parser(sub) -> None:
    p = sub.add_parser(
        "prepare", help="re-encode a data set at a bounded size, or write it as tar shards"
    )
    p.add_argument(
        "src",
        help="data to read: an image folder (ImageFolder layout or flat); with --format shards "
        "any data source (a file list, shards, a Hugging Face data set)",
    )
    p.add_argument("dst", nargs="?", help="folder to write (created)")
    p.add_argument(
        "--format",
        choices=("folder", "shards", "dicom"),
        default="folder",
        help="folder: the same layout, re-encoded (default); shards: tar shards with indexes; "
        "dicom: DICOM files as .npy or 16-bit PNG (docs/loader.md)",
    )
    p.add_argument(
        "--window",
        default=None,
        help="dicom: none (default), file (each file's WindowCenter/Width) or CENTER,WIDTH",
    )
    p.add_argument(
        "--dicom-output",
        choices=("npy", "png"),
        default="npy",
        help="dicom: float32 .npy (default) or 16-bit PNG (needs a window)",
    )
    p.add_argument(
        "--max-side",
        type=int,
        default=None,
        help="longer side in pixels (default 512 for folders; shards keep the bytes unless given)",
    )
    p.add_argument("--quality", type=int, default=90, help="JPEG quality 1-100 (default 90)")
    p.add_argument("--shard-size", type=float, default=256.0, help="MB per shard (default 256)")
    p.add_argument("--seed", type=int, default=0, help="seed of the shards' sample order")
    p.add_argument("--no-shuffle", action="store_true", help="shards: keep the source's order")
    p.add_argument("--no-verify", action="store_true", help="shards: skip reading them back")
    p.add_argument(
        "--src-format",
        choices=("auto", "folder", "shards", "list", "hf"),
        default="auto",
        help="what SRC is (default: found from the name)",
    )
    p.add_argument("--verify", action="store_true", help="with SRC alone: check its shards")
    p.add_argument("--threads", type=int, default=None, help="default: the cores available")
    p.add_argument("--overwrite", action="store_true", help="redo files already prepared")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(run=run)
