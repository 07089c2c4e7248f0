"""The ``dino-opt knn``, ``dino-opt eval``, ``dino-opt show`` and ``dino-opt
embed`` commands: probes, pictures and embeddings of a frozen backbone from
a run, a checkpoint or weights in any format.

``dino-opt knn --checkpoint RUN [--data ROOT]`` prints the k-NN accuracy of
a run's backbone (``--weights PATH --data ROOT``: of weights in any format).

``dino-opt eval linear SOURCE [--data ROOT] [--mode fast|augmented]`` trains
DINOv2's grid of linear classifiers (and, in the fast mode, its logistic
regression) and prints the best rows; ``dino-opt eval dense SOURCE`` trains
DINOv3's linear segmentation head where the data has masks; both write the
whole result as JSON with ``--output``. ``dino-opt show attention|pca SOURCE
IMAGE ... --output-dir DIR`` writes one PNG per image. ``dino-opt embed
SOURCE DATA -o FILE`` writes every image's class token and mean patch token
(and with ``--patch-maps`` its patch tokens) with its path, on ``--nproc``
processes (one per GPU). ``dino-opt eval ... --head FILE`` keeps the
probe's best head, which ``dino-opt predict SOURCE FILE DATA -o OUT``
applies to any images.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from .checkpoint import check_output, write_file
from .distributed.agent import WorkerFailedError, run_agent
from .eval import EMBED_FORMATS, check_embeddings_output, evaluate_checkpoint, probe_table
from .observe import RunFolder
from .runtime import init_distributed, resolve_device
from .weights import (
    embed_weights,
    evaluate_weights,
    predict,
    run_dense_probe,
    run_linear_probe,
    show_weights,
)

__all__ = ["add_embed", "add_eval", "add_knn", "add_predict", "add_show"]


def _write_json(result: dict, output: str | None) -> None:
    if output:
        text = (json.dumps(result, indent=2) + "\n").encode()
        write_file(output, lambda f: f.write(text))
        print(f"wrote {output}")


def _eval(args: argparse.Namespace) -> int:
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
            print(f"logistic regression (C={logreg['best_c']:.3g}): val top-1 "
                  f"{logreg['val_top1']:.2f} %{test}")  # fmt: skip
    else:
        options = {"epochs": args.epochs} if args.epochs else {}
        result = run_dense_probe(args.source, args.data, **common, **options,
                                 batch_size=min(args.batch_size, 64))  # fmt: skip
        for split in ("val", "test"):
            if split in result:
                print(f"{split}: mIoU {result[split]['miou']:.2f} %, pixel accuracy "
                      f"{result[split]['pixel_acc']:.2f} %")  # fmt: skip
    if args.head:
        print(f"wrote the head to {result['head']}")
    _write_json(result, args.output)
    return 0


def _knn(args: argparse.Namespace) -> int:
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
    print(json.dumps(result, indent=2))
    return 0


def _predict(args: argparse.Namespace) -> int:
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
    print(f"{what} of {done['images']} images ({len(done['failed'])} unreadable) in "
          f"{done['output']}")  # fmt: skip
    return 0


def _show(args: argparse.Namespace) -> int:
    options = {"threshold": args.threshold} if args.kind == "attention" else {}
    paths = show_weights(args.source, args.images, args.kind, args.output_dir, which=args.which,
                         image_size=args.image_size, **options)  # fmt: skip
    for path in paths:
        print(path)
    return 0


def _source_arguments(p) -> None:
    p.add_argument(
        "source",
        help="a dino-opt train run folder or checkpoint, or weights in any format "
        "model.init_from reads (timm, hf, dino, dinov2)",
    )
    p.add_argument(
        "--which", choices=("teacher", "student"), default="teacher", help="default: teacher"
    )
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default auto)")


def _force_argument(p) -> None:
    p.add_argument(
        "--force",
        action="store_true",
        help="replace an existing output (never one that is or holds a source or the working "
        "folder); without it an existing output is refused before any work",
    )


def add_knn(sub) -> None:
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
    k.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default auto)")
    k.add_argument(
        "--which", choices=("teacher", "student"), default="teacher", help="default: teacher"
    )
    k.add_argument(
        "--trust-code",
        action="store_true",
        help="--checkpoint: build a network its config names as package.module:function "
        "(imports and calls it)",
    )
    k.set_defaults(run=_knn)


def add_eval(sub) -> None:
    e = sub.add_parser("eval", help="linear or dense probe of a frozen backbone")
    e.add_argument("probe", choices=("linear", "dense"), help="the probe")
    _source_arguments(e)
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
    _force_argument(e)
    e.set_defaults(run=_eval)


def add_predict(sub) -> None:
    p = sub.add_parser("predict", help="apply a saved probe head to images")
    _source_arguments(p)
    p.add_argument("head", help="a head file saved by dino-opt eval linear|dense --head")
    p.add_argument("data", help="images: a folder (with or without class folders), a file "
                   "list, tar shards or a Hugging Face data set")  # fmt: skip
    p.add_argument("-o", "--output", required=True,
                   help="linear: a CSV file (path, class, score, each class's score); dense: "
                   "a folder of PNG masks, one per image")  # fmt: skip
    p.add_argument("--batch-size", type=int, default=64, help="default 64")
    _force_argument(p)
    p.set_defaults(run=_predict)


def add_show(sub) -> None:
    s = sub.add_parser("show", help="attention or PCA pictures of a backbone on image files")
    s.add_argument("kind", choices=("attention", "pca"), help="the picture")
    _source_arguments(s)
    s.add_argument("images", nargs="+", help="image files")
    s.add_argument("--output-dir", required=True, help="where the PNGs go (<stem>_<kind>.png)")
    s.add_argument("--image-size", type=int, help="the longer side, in whole patches (default 448)")
    s.add_argument(
        "--threshold",
        type=float,
        default=0.6,
        help="attention: the share of attention mass the thresholded map keeps (default 0.6)",
    )
    s.set_defaults(run=_show)


def _embed_here(args: dict) -> dict:
    """One process's part of ``dino-opt embed`` (all of it when alone): it
    joins the launch's process group, if any, and embeds its shard."""
    info = init_distributed(args["device"])
    return embed_weights(
        args["source"], args["data"], args["output"], which=args["which"],
        image_size=args["image_size"], device=info.device, progress=info.rank == 0,
        batch_size=args["batch_size"], patch_maps=args["patch_maps"], force=args["force"],
    )  # fmt: skip


def _embed(args: argparse.Namespace) -> int:
    # before any rank starts: the file type, the format's contents, an existing output
    check_embeddings_output(args.output, args.patch_maps, args.force, (args.source, args.data))
    keys = ("source", "data", "output", "which", "image_size", "batch_size", "patch_maps")
    options = {k: getattr(args, k) for k in (*keys, "device", "force")}
    if args.nproc > 1:
        with tempfile.TemporaryDirectory(prefix="dino_opt-embed-") as folder:
            try:
                done = run_agent(_embed_here, (options,), folder=RunFolder(folder),
                                 nproc=args.nproc)[0]  # fmt: skip
            except WorkerFailedError as e:
                print(f"dino-opt embed: {e}", file=sys.stderr)
                return 1
    else:
        done = _embed_here(options)
    for line in done["failed"]:
        print(f"unreadable: {line}", file=sys.stderr)
    print(f"embedded {done['images']} images ({done['dim']} features each, at "
          f"{done['image_size']} px) with {done['backbone']}'s {done['which']}; "
          f"{len(done['failed'])} unreadable; wrote {', '.join(done['files'])}")  # fmt: skip
    return 0


def add_embed(sub) -> None:
    m = sub.add_parser("embed", help="the embeddings of every image of a data source")
    _source_arguments(m)
    m.add_argument("data", help="images: a folder (with or without class folders), a file "
                   "list, tar shards or a Hugging Face data set")  # fmt: skip
    m.add_argument("-o", "--output", required=True,
                   help=f"the file to write ({', '.join(EMBED_FORMATS)})")  # fmt: skip
    m.add_argument("--image-size", type=int,
                   help="the side images are resized and cropped to (default: the one the "
                   "weights were trained at, else their position table's)")  # fmt: skip
    m.add_argument("--patch-maps", action="store_true",
                   help="also each image's patch tokens, [N, D, rows, cols] (ViTs)")  # fmt: skip
    m.add_argument("--batch-size", type=int, default=64, help="default 64")
    m.add_argument("--nproc", type=int, default=1,
                   help="processes, each embedding its share (one per GPU; default 1)")  # fmt: skip
    _force_argument(m)
    m.set_defaults(run=_embed)
