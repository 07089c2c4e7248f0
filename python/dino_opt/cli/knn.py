"""``dino-opt knn``: the k-NN accuracy of a run's backbone
(:func:`~dino_opt.eval.evaluate_checkpoint`) or of weights in any format
(:func:`~dino_opt.weights.evaluate_weights`), as JSON."""

from __future__ import annotations

import argparse

from ..eval import evaluate_checkpoint
from ..weights import evaluate_weights
from .common import device_argument, print_json, which_argument

__all__ = ["add_parser", "run"]


def run(args: argparse.Namespace) -> int:
    options = {"image_size": args.image_size, "k": args.k, "temperature": args.temperature}
    if args.weights is not None:
        if args.data is None:
            raise ValueError("--weights needs --data ROOT (a folder holding train/ and val/)")
        given = {key: value for key, value in options.items() if value is not None}
        result = evaluate_weights(
            args.weights, args.data, device=args.device, which=args.which, **given
        )
    else:
        result = evaluate_checkpoint(
            args.checkpoint,
            data=args.data,
            device=args.device,
            which=args.which,
            trust_code=args.trust_code,
            **options,
        )
    print_json(result)
    return 0


def add_parser(sub) -> None:
    k = sub.add_parser("knn", help="k-NN accuracy of a trained checkpoint's backbone")
    source = k.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--checkpoint",
        help="a dino-opt train run folder (its newest good checkpoint) or a checkpoint file",
    )
    source.add_argument(
        "--weights",
        help="weights in any format model.init_from reads (timm, hf, dino); needs --data",
    )
    k.add_argument(
        "--data",
        help="folder holding train/ and val/ (and test/, evaluated too; default: the data of "
        "the checkpoint's config: the built-in data set, or data.root and its siblings)",
    )
    k.add_argument(
        "--image-size",
        type=int,
        help="evaluation crop side (default: the global crop size; for --weights, the size "
        "they were exported for)",
    )
    k.add_argument("--k", type=int, help="neighbours (default: the config's eval.knn_k, 20)")
    k.add_argument(
        "--temperature",
        type=float,
        help="vote temperature (default: the config's eval.knn_temperature, 0.07)",
    )
    device_argument(k)
    which_argument(k)
    k.add_argument(
        "--trust-code",
        action="store_true",
        help="--checkpoint: build a network its config names as package.module:function "
        "(imports and calls it)",
    )
    k.set_defaults(run=run)
