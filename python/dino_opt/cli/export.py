"""``dino-opt export SOURCE --format F --output PATH``: a run's (or released
weights') backbone for timm, Hugging Face, DINO, DINOv2, DINOv3
(:func:`~dino_opt.weights.export_weights`,
:func:`~dino_opt.weights.export_backbone`) or ONNX, checked against PyTorch
(:func:`~dino_opt.weights.export_onnx`)."""

from __future__ import annotations

import argparse

from ..checkpoint import check_output
from ..weights import (
    FORMATS,
    ONNX_TOLERANCE,
    export_backbone,
    export_onnx,
    export_weights,
    is_weights_name,
    open_backbone,
)
from .common import print_json, which_argument

__all__ = ["add_parser", "run"]


def run(args: argparse.Namespace) -> int:
    if args.format == "onnx":
        options = dict(
            which=args.which,
            image_size=args.image_size,
            force=args.force,
            tolerance=args.onnx_tolerance,
        )
        result = export_onnx(args.source, args.output, data=args.data, **options)
        print_json(result)
        return 0
    if is_weights_name(args.source):  # released weights: their backbone, in another format
        if args.full or args.student:
            raise ValueError(
                f"--full and --student take a dino-opt run; {args.source} names "
                "released weights (their backbone is what is written)"
            )
        check_output(args.output, args.force)  # before a download
        net = open_backbone(args.source, args.which).net
        result = export_backbone(
            net, args.format, args.output, image_size=args.image_size, force=args.force
        )
    else:
        result = export_weights(
            args.source,
            args.format,
            args.output,
            which=args.which,
            full=args.full,
            image_size=args.image_size,
            force=args.force,
            student=args.student,
        )
    print_json(result.to_json())
    return 0


def add_parser(sub) -> None:
    e = sub.add_parser(
        "export", help="write a run's weights for timm, Hugging Face, DINO, DINOv2, DINOv3 or ONNX"
    )
    e.add_argument(
        "source",
        help="a dino-opt train run folder or checkpoint file (onnx: any "
        "weights the project reads), or released weights by name "
        "(dino-opt models)",
    )
    e.add_argument(
        "--format", required=True, choices=(*FORMATS, "onnx"), help="the target's format"
    )
    e.add_argument(
        "--output", required=True, help="file (timm, dino, dinov2, dinov3, onnx) or folder (hf)"
    )
    e.add_argument("--data", help="onnx: images to check the export on (default: the run's)")
    which_argument(e)
    e.add_argument(
        "--full",
        action="store_true",
        help="--format dino: the whole training checkpoint (student, teacher, optimizer, "
        "epoch, dino_loss) instead of the backbone",
    )
    e.add_argument(
        "--image-size",
        type=int,
        help="ViT input side the position embeddings are exported for (default: the size "
        "they were trained for: 224 for DINO, the global crop size for the dinov2 recipe; "
        "DINOv3's RoPE ViT: the size the target's config names)",
    )
    e.add_argument(
        "--onnx-tolerance",
        type=float,
        default=ONNX_TOLERANCE,
        help="onnx: the largest difference to PyTorch's outputs the check accepts; above it "
        f"the export fails (exit 2) and writes nothing (default {ONNX_TOLERANCE:g})",
    )
    e.add_argument(
        "--force",
        action="store_true",
        help="replace an existing output (never one that is or holds the source or the "
        "working folder)",
    )
    e.add_argument(
        "--student",
        help="a distillation into several students: the one to write, by its backbone "
        "(default: model.backbone's)",
    )
    e.set_defaults(run=run)
