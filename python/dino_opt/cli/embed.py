"""``dino-opt embed SOURCE DATA -o FILE``: every image's class token and
mean patch token (and with ``--patch-maps`` its patch tokens) with its path,
on ``--nproc`` processes (:func:`~dino_opt.distributed.embed_on_processes`)."""

from __future__ import annotations

import argparse
import sys

from ..distributed import WorkerFailedError, embed_on_processes
from ..eval import EMBED_FORMATS, check_embeddings_output
from .common import force_argument, source_arguments

__all__ = ["add_parser", "run"]


def run(args: argparse.Namespace) -> int:
    # before any rank starts: the file type, the format's contents, an existing output
    check_embeddings_output(args.output, args.patch_maps, args.force, (args.source, args.data))
    keys = ("source", "data", "output", "which", "image_size", "batch_size", "patch_maps")
    options = {k: getattr(args, k) for k in (*keys, "device", "force")}
    try:
        done = embed_on_processes(options, args.nproc)
    except WorkerFailedError as e:
        print(f"dino-opt embed: {e}", file=sys.stderr)
        return 1
    for line in done["failed"]:
        print(f"unreadable: {line}", file=sys.stderr)
    print(
        f"embedded {done['images']} images ({done['dim']} features each, at "
        f"{done['image_size']} px) with {done['backbone']}'s {done['which']}; "
        f"{len(done['failed'])} unreadable; wrote {', '.join(done['files'])}"
    )
    return 0


def add_parser(sub) -> None:
    m = sub.add_parser("embed", help="the embeddings of every image of a data source")
    source_arguments(m)
    m.add_argument(
        "data",
        help="images: a folder (with or without class folders), a file "
        "list, tar shards or a Hugging Face data set",
    )
    m.add_argument(
        "-o", "--output", required=True, help=f"the file to write ({', '.join(EMBED_FORMATS)})"
    )
    m.add_argument(
        "--image-size",
        type=int,
        help="the side images are resized and cropped to (default: the one the "
        "weights were trained at, else their position table's)",
    )
    m.add_argument(
        "--patch-maps",
        action="store_true",
        help="also each image's patch tokens, [N, D, rows, cols] (ViTs)",
    )
    m.add_argument("--batch-size", type=int, default=64, help="default 64")
    m.add_argument(
        "--nproc",
        type=int,
        default=1,
        help="processes, each embedding its share (one per GPU; default 1)",
    )
    force_argument(m)
    m.set_defaults(run=run)
