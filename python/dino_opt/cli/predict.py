"""``dino-opt predict SOURCE HEAD DATA -o OUT``: a probe head saved by
``dino-opt eval --head`` applied to any images
(:func:`~dino_opt.weights.predict`): classes and scores as CSV, or masks."""

from __future__ import annotations

import argparse
import sys

from ..runtime import resolve_device
from ..weights import predict
from .common import force_argument, source_arguments

__all__ = ["add_parser", "run"]


def run(args: argparse.Namespace) -> int:
    done = predict(
        args.source,
        args.head,
        args.data,
        args.output,
        which=args.which,
        device=resolve_device(args.device),
        batch_size=args.batch_size,
        force=args.force,
    )
    for line in done["failed"]:
        print(f"unreadable: {line}", file=sys.stderr)
    what = "classes and scores" if done["kind"] == "linear" else "masks"
    print(
        f"{what} of {done['images']} images ({len(done['failed'])} unreadable) in {done['output']}"
    )
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("predict", help="apply a saved probe head to images")
    source_arguments(p)
    p.add_argument("head", help="a head file saved by dino-opt eval linear|dense --head")
    p.add_argument(
        "data",
        help="images: a folder (with or without class folders), a file "
        "list, tar shards or a Hugging Face data set",
    )
    p.add_argument(
        "-o",
        "--output",
        required=True,
        help="linear: a CSV file (path, class, score, each class's score); dense: "
        "a folder of PNG masks, one per image",
    )
    p.add_argument("--batch-size", type=int, default=64, help="default 64")
    force_argument(p)
    p.set_defaults(run=run)
