"""``dino-opt show attention|pca SOURCE IMAGE ... --output-dir DIR``: the
last block's attention maps or the PCA of patch features of each image, one
PNG each (:func:`~dino_opt.weights.show_weights`)."""

from __future__ import annotations

import argparse

from ..weights import show_weights
from .common import source_arguments

__all__ = ["add_parser", "run"]


def run(args: argparse.Namespace) -> int:
    options = {"threshold": args.threshold} if args.kind == "attention" else {}
    paths = show_weights(
        args.source,
        args.images,
        args.kind,
        args.output_dir,
        which=args.which,
        image_size=args.image_size,
        **options,
    )
    for path in paths:
        print(path)
    return 0


def add_parser(sub) -> None:
    s = sub.add_parser("show", help="attention or PCA pictures of a backbone on image files")
    s.add_argument("kind", choices=("attention", "pca"), help="the picture")
    source_arguments(s)
    s.add_argument("images", nargs="+", help="image files")
    s.add_argument("--output-dir", required=True, help="where the PNGs go (<stem>_<kind>.png)")
    s.add_argument("--image-size", type=int, help="the longer side, in whole patches (default 448)")
    s.add_argument(
        "--threshold",
        type=float,
        default=0.6,
        help="attention: the share of attention mass the thresholded map keeps (default 0.6)",
    )
    s.set_defaults(run=run)
