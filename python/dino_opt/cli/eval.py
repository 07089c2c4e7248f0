"""``dino-opt eval linear|dense SOURCE``: DINOv2's grid of linear
classifiers (:func:`~dino_opt.weights.run_linear_probe`, and in the fast
mode its logistic regression) or DINOv3's linear segmentation head
(:func:`~dino_opt.weights.run_dense_probe`) on a frozen backbone; the best
rows printed, the whole result as JSON with ``--output``, the best head kept
with ``--head`` for ``dino-opt predict``."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..checkpoint import check_output
from ..eval import probe_table
from ..weights import run_dense_probe, run_linear_probe
from .common import force_argument, source_arguments, write_json

__all__ = ["add_parser", "run"]


def run(args: argparse.Namespace) -> int:
    if args.output:  # before the probe trains: its result must have somewhere to go
        check_output(args.output, args.force, (args.source, args.data, args.head))
    if args.head and args.output and Path(args.head).resolve() == Path(args.output).resolve():
        raise ValueError(f"--head and --output are both {args.head!r}: give two files")
    common = dict(
        which=args.which,
        image_size=args.image_size,
        device=args.device,
        head=args.head,
        force=args.force,
    )
    if args.probe == "linear":
        options = {"mode": args.mode, "epochs": args.epochs, "batch_size": args.batch_size}
        result = run_linear_probe(args.source, args.data, **common, **options)
        print(probe_table(result, top=args.top))
        best, logreg = result["best"], result.get("logreg")
        line = f"best: {best['name']}: val top-1 {best['val_top1']:.2f} %"
        line += f", test top-1 {best['test_top1']:.2f} %" if "test_top1" in best else ""
        print(line)
        if logreg:
            test = f", test top-1 {logreg['test_top1']:.2f} %" if "test_top1" in logreg else ""
            print(
                f"logistic regression (C={logreg['best_c']:.3g}): val top-1 "
                f"{logreg['val_top1']:.2f} %{test}"
            )
    else:
        options = {"epochs": args.epochs} if args.epochs else {}
        result = run_dense_probe(
            args.source, args.data, **common, **options, batch_size=min(args.batch_size, 64)
        )
        for split in ("val", "test"):
            if split in result:
                print(
                    f"{split}: mIoU {result[split]['miou']:.2f} %, pixel accuracy "
                    f"{result[split]['pixel_acc']:.2f} %"
                )
    if args.head:
        print(f"wrote the head to {result['head']}")
    write_json(result, args.output)
    return 0


def add_parser(sub) -> None:
    e = sub.add_parser("eval", help="linear or dense probe of a frozen backbone")
    e.add_argument("probe", choices=("linear", "dense"), help="the probe")
    source_arguments(e)
    e.add_argument(
        "--data",
        help="folder holding train/ and val/ (and test/; for dense: image/mask pairs, "
        "<split>/images and <split>/masks, or the built-in data set; default: the run's data)",
    )
    e.add_argument(
        "--image-size",
        type=int,
        help="evaluation side (default: the run's global crop size, or the weights' own)",
    )
    e.add_argument(
        "--mode",
        choices=("fast", "augmented"),
        default="fast",
        help="linear: fast (cached centre-crop features, with the logistic regression) or "
        "augmented (random-resized crops and flips through the backbone each step)",
    )
    e.add_argument(
        "--epochs",
        type=int,
        help="training epochs (default: linear 100 fast, 10 augmented; dense 32)",
    )
    e.add_argument("--batch-size", type=int, default=128, help="default 128 (dense: at most 64)")
    e.add_argument("--top", type=int, default=12, help="linear: rows of the table (default 12)")
    e.add_argument("--output", help="write the result as JSON here")
    e.add_argument("--head", help="save the best head here (.safetensors) for dino-opt predict")
    force_argument(e)
    e.set_defaults(run=run)
