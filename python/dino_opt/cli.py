"""The ``dino-opt`` command line.

``dino-opt train [--config my.yaml] [key=value ...]`` trains DINO (without a
config: the demo recipe on the built-in data set, sized for a 2-core CPU);
``dino-opt config --print-defaults`` prints the full default configuration.
``dino-opt knn --checkpoint RUN [--data ROOT]`` prints the
k-NN accuracy of a trained backbone on ROOT/train vs ROOT/val as JSON
(``--weights PATH --data ROOT``: of weights in another format).
``dino-opt eval linear|dense SOURCE [--data ROOT]`` trains DINOv2's grid of
linear classifiers (or DINOv3's dense linear head) on the frozen backbone of a
run, a checkpoint or weights in any format, prints a table and writes JSON;
``dino-opt show attention|pca SOURCE IMAGE ... --output-dir DIR`` draws the
last block's attention maps or the PCA of patch features of each image.
``dino-opt export RUN --format timm|hf|dino --output PATH`` writes a run's
teacher (or student) in a format other tools load.
``dino-opt models`` lists the released networks a weights argument takes by
name (``dinov2_vits14``, ``hf:ORG/NAME``, ``timm:NAME``), their sizes and
where each is cached.
``dino-opt report RUN`` analyses a run folder (convergence, weight drift
between checkpoints, throughput) and writes its reports and plots there.
``dino-opt presets [--memory GB] [--measure]`` prints the hardware presets
and what ``hardware.preset=auto`` picks on this machine; ``dino-opt presets
--memory-model [--arch A] [--world N ...] [--strategy ddp|fsdp]`` the
per-rank memory of ViT-S/B/L/g training under DDP and FSDP.
``dino-opt doctor [--device D]`` prints the versions, the kernels of this
build by device, and checks every fused operator on the device (exit 1 on a
mismatch).
``dino-opt prepare SRC DST --max-side 512 --quality 90`` re-encodes a data set
once at a bounded size (JPEG), keeping its folder layout, so that every epoch
after decodes small files; the loader reads SRC or DST alike. With
``--format shards [--shard-size MB]`` it writes tar shards (and their indexes)
from any data source instead, and verifies them; ``dino-opt prepare SHARDS
--verify`` checks shards written before.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import signal
import sys
import time
import traceback
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tqdm import tqdm

from . import doctor, probing
from .api import ADAPT_OVERRIDES, DEMO_PRESET, DEMO_PRESETS, training_config
from .checkpoint import check_output
from .config import (
    PRESETS,
    Config,
    apply_overrides,
    config_to_yaml,
    default_config,
    load_config,
)
from .data import find_images, verify_shards, write_shards
from .data.dicom import parse_window, prepare_dicom
from .distributed import WorkerFailedError, launch_distributed_training
from .job import run_training
from .models import CHECKPOINT_POLICIES
from .observe import CollapseError, DINOTrainingAnalyzer, format_report
from .ops.native import _C
from .runtime import EXIT_HANG, TrainingHungError, launched_world
from .train import recipe_of, resolve_recipe
from .tune import (
    MEMORY_ARCHS,
    STRATEGIES,
    arch_config,
    largest_batch,
    measure_batch_size,
    memory_table,
    resolve_hardware,
    resolve_preset,
)
from .weights import (
    FORMATS,
    ONNX_TOLERANCE,
    export_backbone,
    export_onnx,
    export_weights,
    format_models,
    is_weights_name,
    model_rows,
    open_backbone,
    weights_reader,
)

__all__ = ["main", "prepare_dataset"]


def prepare_dataset(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    max_side: int = 512,
    quality: int = 90,
    num_threads: int | None = None,
    overwrite: bool = False,
    progress: bool = True,
) -> dict:
    """Re-encodes every image under ``src`` into ``dst`` (same relative path,
    extension ``.jpg``), longer side at most ``max_side`` (never enlarged),
    JPEG ``quality``. Work runs on native threads; each file is written
    atomically, and files already prepared (``dst`` newer than ``src``) are
    kept unless ``overwrite``. Unreadable files are listed, not fatal.

    Returns ``{"written", "kept", "failed": ["path: cause", ...], "bytes_in", "bytes_out"}``.
    """
    src_root, dst_root = Path(src), Path(dst)
    if src_root.resolve() == dst_root.resolve():
        raise ValueError("dst must differ from src: prepare never overwrites its input")
    if not 1 <= int(max_side):
        raise ValueError(f"max_side must be >= 1, got {max_side}")
    if not 1 <= int(quality) <= 100:
        raise ValueError(f"quality must be in [1, 100], got {quality}")
    paths, _, _ = find_images(src_root)
    jobs = []
    for path in paths:
        out = (dst_root / Path(path).relative_to(src_root)).with_suffix(".jpg")
        jobs.append((path, out))
    if len({out for _, out in jobs}) != len(jobs):
        raise ValueError("two source files map to the same output (e.g. a.png and a.jpg)")
    for out in {out.parent for _, out in jobs}:
        out.mkdir(parents=True, exist_ok=True)

    def run(job):
        path, out = job
        if not overwrite and out.exists() and out.stat().st_mtime >= os.stat(path).st_mtime:
            return "kept", path, 0
        try:
            _, _, size = _C.reencode_image(str(path), str(out), int(max_side), int(quality))
        except (ValueError, RuntimeError) as e:  # ImageError is a ValueError
            return "failed", f"{e}", 0
        return "written", path, size

    result = {"written": 0, "kept": 0, "failed": [], "bytes_in": 0, "bytes_out": 0}
    threads = num_threads or _C.available_cores()
    with ThreadPoolExecutor(threads) as pool:
        bar = tqdm(total=len(jobs), unit="img", disable=not progress, desc="prepare")
        for status, what, size in pool.map(run, jobs):
            if status == "failed":
                result["failed"].append(what)
            else:
                result[status] += 1
                if status == "written":
                    result["bytes_in"] += os.path.getsize(what)
                    result["bytes_out"] += size
            bar.update()
        bar.close()
    return result


def _failed(failed: list[str]) -> int:
    """The images ``prepare`` could not write, one line each on stderr; the exit status."""
    for line in failed:
        print(f"  failed: {line}", file=sys.stderr)
    return 1 if failed else 0


def _prepare(args: argparse.Namespace) -> int:
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


def _train(args: argparse.Namespace) -> int:
    cfg = training_config(args.config, args.demo, args.adapt, args.trust_code, args.overrides)
    if args.nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {args.nproc}")
    if args.nproc > 1 or args.nnodes > 1:
        node_rank, addr, port = _place_node(args)
        # one run folder for all ranks and restarts, named before they start
        out = args.output_dir or cfg.logging.output_dir
        if out is None and args.nnodes == 1:
            out = time.strftime("runs/%Y%m%d-%H%M%S")
        try:
            report = launch_distributed_training(
                cfg, args.nproc, addr, port, output_dir=out, nnodes=args.nnodes,
                node_rank=node_rank, verbose=args.verbose,
            )  # fmt: skip
        except (WorkerFailedError, TrainingHungError) as e:  # out of restarts: one line
            if args.verbose:
                traceback.print_exc()
            print(f"dino-opt: {e}; resume with: {_resume_command(args, out, cfg)}",
                  file=sys.stderr)  # fmt: skip
            return EXIT_HANG if isinstance(e, TrainingHungError) else e.exit_status
    else:
        report = run_training(cfg, output_dir=args.output_dir, quiet=args.quiet)
    print(json.dumps(report, indent=2))
    print(summary_line(report))
    if report.get("stopped_by"):  # checkpointed and stopped on a signal: the shell's code for it
        return 128 + signal.Signals[report["stopped_by"]].value
    return 0


def _place_node(args: argparse.Namespace) -> tuple[int, str, int | None]:
    """This node's rank and the rendezvous address for --nproc/--nnodes
    (several nodes: the flags, else SLURM_NODEID, MASTER_ADDR, MASTER_PORT)."""
    if args.nnodes < 1:
        raise ValueError(f"--nnodes must be >= 1, got {args.nnodes}")
    world = launched_world()
    one_task_per_node = "WORLD_SIZE" not in os.environ and world and world[1] == args.nnodes > 1
    if world is not None and not one_task_per_node:
        raise ValueError(
            "--nproc and --nnodes start their own processes; under torchrun or srun leave "
            "them out (or run one task per node under srun)"
        )
    if args.nnodes == 1:
        return 0, args.master_addr or "localhost", args.master_port
    node_rank = args.node_rank if args.node_rank is not None else os.environ.get("SLURM_NODEID")
    addr = args.master_addr or os.environ.get("MASTER_ADDR")
    port = args.master_port or os.environ.get("MASTER_PORT") or 29500
    if node_rank is None or addr is None:
        raise ValueError(
            f"--nnodes {args.nnodes} needs --node-rank (SLURM_NODEID under srun) and "
            "--master-addr (node 0's address, or MASTER_ADDR)"
        )
    return int(node_rank), addr, int(port)


def _resume_command(args: argparse.Namespace, out, cfg: Config) -> str:
    """The command that resumes this run: the same, in the same run folder."""
    argv = list(args.argv)
    if args.output_dir is None and cfg.logging.output_dir is None and out is not None:
        at = argv.index("train") + 1 if "train" in argv else 0
        argv[at:at] = ["--output-dir", str(out)]
    return shlex.join(["dino-opt", *argv])


def summary_line(report: dict) -> str:
    """One line for a person: the k-NN of the trained teacher against the
    same network at random initialisation (val, and test where there is
    one), the linear and dense probes (val), the training time and the run
    folder; and a second line with what to try when training made the
    features worse than random initialisation; for a run from weights,
    a last line saying whether it made them better than where it started."""
    parts = []
    if "knn_top1_trained" in report:
        parts.append(
            f"k-NN top-1 {report['knn_top1_trained']:.1f} % trained vs "
            f"{report['knn_top1_random_init']:.1f} % at random init (val)"
        )
    if "knn_test_top1_trained" in report:
        parts.append(
            f"{report['knn_test_top1_trained']:.1f} % vs "
            f"{report['knn_test_top1_random_init']:.1f} % (test)"
        )
    if "linear_top1_trained" in report:
        parts.append(
            f"linear top-1 {report['linear_top1_trained']:.1f} % vs "
            f"{report['linear_top1_random_init']:.1f} % (val)"
        )
    if "dense_miou_trained" in report:
        parts.append(
            f"dense mIoU {report['dense_miou_trained']:.1f} % vs "
            f"{report['dense_miou_random_init']:.1f} % (val)"
        )
    if report.get("stopped_by"):
        parts.append(f"stopped by {report['stopped_by']} after {report['steps']} steps")
    if "pictures" in report:
        parts.append(f"attention and PCA pictures in {report['pictures']}")
    parts.append(f"{report['train_seconds']:.0f} s of training")
    parts.append(f"run folder {report.get('run_folder', '?')}")
    line = "dino-opt train: " + "; ".join(parts)
    line += f"\ndino-opt train: warning: {report['verdict']}" if "verdict" in report else ""
    return line + (f"\ndino-opt train: {report['adapt_verdict']}" if "adapt_verdict" in report
                   else "")  # fmt: skip


def _config(args: argparse.Namespace) -> int:
    cfg = Config.from_dict(DEMO_PRESET) if args.demo else default_config()
    print(config_to_yaml(cfg), end="")
    return 0


# `--memory` without a number: the memory model's table.
_MEMORY_TABLE = -1.0


def _presets(args: argparse.Namespace) -> int:
    if args.memory == _MEMORY_TABLE:
        args.memory, args.memory_model = None, True
    if args.memory_model:
        return _memory_model(args)
    if args.measure and args.memory is not None:
        raise ValueError("--measure times this machine's device; leave out --memory")
    cfg = load_config(args.config, args.overrides)  # the crops and device to plan for
    a = cfg.augmentation
    name = cfg.hardware.preset if cfg.hardware.preset != "off" else "auto"
    choice = resolve_preset(
        name,
        device=cfg.hardware.device,
        memory_gb=args.memory,
        global_crop_size=a.global_crop_size,
        local_crop_size=a.local_crop_size,
        patch_size=cfg.model.patch_size,
    )
    report: dict = {
        "presets": {n: dataclasses.asdict(p) for n, p in PRESETS.items()},
        "chosen": choice.preset.name,
        "reason": choice.reason,
        "values": choice.values,
    }
    if args.measure:
        measured_cfg, _ = resolve_hardware(
            load_config(args.config, [*args.overrides, f"hardware.preset={name}"])
        )
        report["measured"] = measure_batch_size(
            measured_cfg, max_batch_size=args.max_batch, steps=args.steps
        )
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    _print_presets(report, choice, name)
    return 0


def _print_presets(report: dict, choice, name: str) -> None:
    print(f"{'preset':7s} {'memory':>11s}  {'backbone':9s} {'batch':>5s} {'local':>5s}  cards")
    for p in PRESETS.values():
        memory = "no GPU" if p.memory_gb == 0 else f">= {p.min_memory_gb:.1f} GiB"
        mark = " <-" if p.name == choice.preset.name else ""
        print(
            f"{p.name:7s} {memory:>11s}  {p.backbone:9s} {p.batch_size:5d} "
            f"{p.num_local_views:5d}  {p.note}{mark}"
        )
    print(f"\n{choice.reason}")
    print(f"hardware.preset={name} sets: {' '.join(choice.overrides())}")
    measured = report.get("measured")
    if measured:
        print(f"\n{'batch':>5s} {'fits':>5s} {'images/s':>9s} {'peak GiB':>9s}  error")
        for t in measured["trials"]:
            ips = f"{t['images_per_second']:9.1f}" if t["images_per_second"] else f"{'-':>9s}"
            print(
                f"{t['batch_size']:5d} {str(t['fits']):>5s} {ips} "
                f"{t['peak_memory_gb']:9.3f}  {t['error'] or ''}"
            )
        print(
            f"measured on {measured['device']}: data.batch_size={measured['batch_size']} "
            f"({measured['images_per_second']:.1f} images/s; largest that fits: "
            f"{measured['largest_fitting_batch_size']})"
        )


def _memory_model(args: argparse.Namespace) -> int:
    if args.measure:
        raise ValueError("--memory-model estimates; leave out --measure")
    config = load_config(args.config, list(args.overrides)) if args.config else None
    teacher = None
    if config is not None and recipe_of(config).external_teacher:  # a distillation's teacher
        reader = weights_reader()
        config = resolve_recipe(config, reader)  # e.g. the teacher's feature width
        d = config.recipe.distill
        heads = d.mode == "heads"
        teacher = reader.open_teacher(d.teacher, heads, config.model.trust_code).network
    rows = memory_table(
        args.arch, tuple(args.world), tuple(args.strategy), tuple(args.checkpointing),
        batch_size=args.batch, reshard_after_forward=args.reshard_after_forward == "on",
        config=config, overrides=tuple(args.overrides), frozen_teacher=teacher,
    )  # fmt: skip
    usable = None if args.memory is None else args.memory * 2**30 * _USABLE
    out = [r.to_dict() for r in rows]
    if usable:
        configs = {r.arch: arch_config(r.arch) if r.arch in MEMORY_ARCHS else config for r in rows}
        for r, row in zip(rows, out, strict=True):
            cfg = apply_overrides(configs[r.arch], args.overrides)
            row["fits"] = r.peak <= usable
            row["largest_batch"] = largest_batch(
                cfg, usable, strategy=r.strategy, world_size=r.world_size,
                checkpointing=r.checkpointing, every=r.every,
                reshard_after_forward=r.reshard_after_forward, frozen_teacher=teacher,
            )  # fmt: skip
    if args.json:
        archs = {n: a.source for n, a in MEMORY_ARCHS.items()}
        print(json.dumps({"rows": out, "archs": archs}, indent=2))
        return 0
    _print_memory(rows, out, usable)
    return 0


_USABLE = 0.9  # of a GPU's memory: the rest for the CUDA context and fragmentation


def _print_memory(rows, out: list[dict], usable: float | None) -> None:
    gib = 2**30
    head = (f"{'arch':14s} {'batch':>5s} {'strategy':8s} {'world':>5s} {'ckpt':9s} "
            f"{'params':>7s} {'grads':>7s} {'optim':>7s} {'teacher':>7s} {'comm':>7s} "
            f"{'activ':>7s} {'peak':>7s}")  # fmt: skip
    print(head + ("  fits  max batch" if usable else ""))
    for r, row in zip(rows, out, strict=True):
        values = (r.parameters, r.gradients, r.optimizer, r.teacher, r.buckets + r.unsharded,
                  r.activations + r.transient, r.peak)  # fmt: skip
        line = (f"{r.arch:14s} {r.batch_size:5d} {r.strategy:8s} {r.world_size:5d} "
                f"{r.checkpointing:9s} " + " ".join(f"{v / gib:7.2f}" for v in values))  # fmt: skip
        if usable:
            line += f"  {'yes' if row['fits'] else 'no':>4s}  {row['largest_batch']:9d}"
        print(line)
    print(
        "\nGiB per rank (rank 0). comm: DDP's gradient buckets, or FSDP's gathered units; "
        "activ: activations and the backward's working set; peak: the step's peak."
    )
    if usable:
        print(
            f"fits / max batch (per GPU): peak <= {_USABLE:.0%} of --memory (the rest for the "
            "CUDA context and fragmentation)."
        )


def _export(args: argparse.Namespace) -> int:
    if args.format == "onnx":
        options = dict(
            which=args.which,
            image_size=args.image_size,
            force=args.force,
            tolerance=args.onnx_tolerance,
        )
        result = export_onnx(args.source, args.output, data=args.data, **options)
        print(json.dumps(result, indent=2))
        return 0
    if is_weights_name(args.source):  # released weights: their backbone, in another format
        if args.full or args.student:
            raise ValueError(f"--full and --student take a dino-opt run; {args.source} names "
                             "released weights (their backbone is what is written)")  # fmt: skip
        check_output(args.output, args.force)  # before a download
        net = open_backbone(args.source, args.which).net
        result = export_backbone(
            net, args.format, args.output, image_size=args.image_size, force=args.force
        )
    else:
        result = export_weights(
            args.source, args.format, args.output, which=args.which, full=args.full,
            image_size=args.image_size, force=args.force, student=args.student,
        )  # fmt: skip
    print(json.dumps(result.to_json(), indent=2))
    return 0


def _models(args: argparse.Namespace) -> int:
    rows = model_rows()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(format_models(rows))
    return 0


def _report(args: argparse.Namespace) -> int:
    report = DINOTrainingAnalyzer(args.run_dir).generate_report(args.output_dir)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_report(report), end="")
    return 0


def _prepare_shards(args: argparse.Namespace) -> int:
    r = write_shards(
        args.src, args.dst, shard_size_mb=args.shard_size, max_side=args.max_side,
        quality=args.quality, seed=args.seed, shuffle=not args.no_shuffle,
        num_threads=args.threads, overwrite=args.overwrite, verify=not args.no_verify,
        progress=not args.quiet, source_format=args.src_format,
    )  # fmt: skip
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


def _add_prepare(sub) -> None:
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
        "--max-side", type=int, default=None,
        help="longer side in pixels (default 512 for folders; shards keep the bytes unless given)",
    )  # fmt: skip
    p.add_argument("--quality", type=int, default=90, help="JPEG quality 1-100 (default 90)")
    p.add_argument("--shard-size", type=float, default=256.0, help="MB per shard (default 256)")
    p.add_argument("--seed", type=int, default=0, help="seed of the shards' sample order")
    p.add_argument("--no-shuffle", action="store_true", help="shards: keep the source's order")
    p.add_argument("--no-verify", action="store_true", help="shards: skip reading them back")
    p.add_argument(
        "--src-format", choices=("auto", "folder", "shards", "list", "hf"), default="auto",
        help="what SRC is (default: found from the name)",
    )  # fmt: skip
    p.add_argument("--verify", action="store_true", help="with SRC alone: check its shards")
    p.add_argument("--threads", type=int, default=None, help="default: the cores available")
    p.add_argument("--overwrite", action="store_true", help="redo files already prepared")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(run=_prepare)


def _add_train(sub) -> None:
    t = sub.add_parser("train", help="train DINO (default: the demo on the built-in data set)")
    t.add_argument(
        "--config",
        help="YAML configuration, or a packaged one's name (dinov2_vits14, dinov2_vitl14, "
        "dinov2_vitg14); default: the demo preset",
    )
    t.add_argument(
        "--demo",
        choices=tuple(DEMO_PRESETS),
        help="the demo of this recipe on the built-in data set (default without --config: dino)",
    )
    t.add_argument("--adapt", metavar="WEIGHTS", help="continued pretraining from released "
                   "weights (a file, or a name: dino-opt models): " +
                   " ".join(ADAPT_OVERRIDES).replace("{weights}", "WEIGHTS") +
                   " (a name also sets the model it holds; key=value overrides win)")  # fmt: skip
    t.add_argument("--output-dir", help="run folder (default: logging.output_dir or runs/<time>)")
    t.add_argument("--quiet", action="store_true", help="no progress bar")
    t.add_argument(
        "--nproc",
        type=int,
        default=1,
        help="processes on this node, one per GPU (gloo on CPUs without CUDA); default 1. "
        "A failed process restarts them all from the last checkpoint (distributed.max_restarts)",
    )
    t.add_argument(
        "--nnodes", type=int, default=1, help="nodes of the job, each running this command"
    )
    t.add_argument(
        "--node-rank",
        type=int,
        help="this node's rank, 0 to nnodes-1 (node 0 hosts the rendezvous; default under "
        "srun: SLURM_NODEID)",
    )
    t.add_argument(
        "--master-addr", help="node 0's address, where the nodes meet (default: MASTER_ADDR)"
    )
    t.add_argument(
        "--master-port",
        type=int,
        help="the rendezvous port on node 0 (default: MASTER_PORT, else 29500; one node: a "
        "free one)",
    )
    t.add_argument(
        "--verbose",
        action="store_true",
        help="on a failure, the traceback and torch's launcher logs too",
    )
    t.add_argument(
        "--trust-code",
        action="store_true",
        help="model.trust_code=true: build a network a distillation teacher's run config "
        "names as package.module:function",
    )
    t.add_argument("overrides", nargs="*", help="key=value, e.g. data.batch_size=32")
    t.set_defaults(run=_train)


def _add_config(sub) -> None:
    c = sub.add_parser("config", help="print a configuration as YAML")
    c.add_argument("--print-defaults", action="store_true", help="DINO's defaults (the default)")
    c.add_argument("--demo", action="store_true", help="the demo preset instead")
    c.set_defaults(run=_config)


def _add_presets(sub) -> None:
    h = sub.add_parser(
        "presets", help="hardware presets: the table and what hardware.preset=auto picks here"
    )
    h.add_argument("--config", help="YAML configuration whose crops and device to plan for")
    h.add_argument(
        "--memory",
        type=float,
        nargs="?",
        const=_MEMORY_TABLE,
        help="GB: plan for a GPU with this many GiB instead of this machine's; alone: the "
        "memory model's table (as --memory-model)",
    )
    h.add_argument(
        "--measure",
        action="store_true",
        help="refine the batch size by timing training steps on this machine's device",
    )
    h.add_argument(
        "--max-batch", type=int, help="largest batch --measure tries (default: twice the preset's)"
    )
    h.add_argument("--steps", type=int, default=3, help="timed steps per --measure trial")
    h.add_argument(
        "--memory-model",
        action="store_true",
        help="per-rank memory of DDP vs FSDP training (docs/memory.md); --memory GB marks "
        "the rows that fit",
    )
    h.add_argument("--arch", nargs="+", choices=list(MEMORY_ARCHS), help="--memory-model: "
                   "architectures (default all; --config: the config's model instead)")  # fmt: skip
    h.add_argument("--world", nargs="+", type=int, default=[1, 8, 64, 1024],
                   help="--memory-model: world sizes (default 1 8 64 1024)")  # fmt: skip
    h.add_argument("--batch", type=int, help="--memory-model: batch per GPU (default each "
                   "architecture's)")  # fmt: skip
    h.add_argument("--strategy", nargs="+", choices=STRATEGIES, default=list(STRATEGIES),
                   help="--memory-model: ddp, fsdp or both")  # fmt: skip
    h.add_argument("--checkpointing", nargs="+", choices=CHECKPOINT_POLICIES,
                   default=list(CHECKPOINT_POLICIES),
                   help="--memory-model: activation checkpointing of every block")  # fmt: skip
    h.add_argument("--reshard-after-forward", choices=("on", "off"), default="on",
                   help="--memory-model: FSDP frees gathered blocks after the forward")  # fmt: skip
    h.add_argument("--json", action="store_true", help="print the result as JSON")
    h.add_argument("overrides", nargs="*", help="key=value, e.g. augmentation.global_crop_size=160")
    h.set_defaults(run=_presets)


def _add_export(sub) -> None:
    e = sub.add_parser(
        "export", help="write a run's weights for timm, Hugging Face, DINO, DINOv2, DINOv3 or ONNX"
    )
    e.add_argument("source", help="a dino-opt train run folder or checkpoint file (onnx: any "
                   "weights the project reads), or released weights by name "
                   "(dino-opt models)")  # fmt: skip
    e.add_argument(
        "--format", required=True, choices=(*FORMATS, "onnx"), help="the target's format"
    )
    e.add_argument(
        "--output", required=True, help="file (timm, dino, dinov2, dinov3, onnx) or folder (hf)"
    )
    e.add_argument("--data", help="onnx: images to check the export on (default: the run's)")
    e.add_argument(
        "--which", choices=("teacher", "student"), default="teacher", help="default: teacher"
    )
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
    e.set_defaults(run=_export)


def _add_models(sub) -> None:
    m = sub.add_parser(
        "models", help="the released networks by name: sizes, sources, where each is cached"
    )
    m.add_argument("--json", action="store_true", help="print the rows as JSON")
    m.set_defaults(run=_models)


def _add_report(sub) -> None:
    r = sub.add_parser(
        "report", help="analyse a run folder: convergence, weight drift, throughput, phases"
    )
    r.add_argument("run_dir", help="a dino-opt train run folder (or its checkpoints/ folder)")
    r.add_argument(
        "--output-dir",
        help="where checkpoint_report.json, performance_report.json and the plots go "
        "(default: the run folder)",
    )
    r.add_argument("--json", action="store_true", help="print the report as JSON instead")
    r.set_defaults(run=_report)


def _add_doctor(sub) -> None:
    d = sub.add_parser(
        "doctor", help="versions, kernels by device, and a self-check of every operator here"
    )
    doctor.add_arguments(d)
    d.set_defaults(run=doctor.run)


def _bug(parser: argparse.ArgumentParser, command: str) -> None:
    """The traceback of an error no input explains, and a line saying so."""
    traceback.print_exc()
    line = "internal error: a bug in dino-opt, not in what you gave it; please report it with "
    parser.exit(1, f"dino-opt {command}: {line}the traceback above\n")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dino-opt", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_add_prepare, _add_train, _add_config, _add_presets, probing.add_knn,
                probing.add_eval, probing.add_show, probing.add_embed, probing.add_predict,
                _add_export, _add_models, _add_report, _add_doctor):  # fmt: skip
        add(sub)
    args = parser.parse_args(argv)
    args.argv = list(argv if argv is not None else sys.argv[1:])
    try:
        return args.run(args)
    except (ValueError, FileNotFoundError, FileExistsError, ImportError) as e:
        parser.exit(2, f"dino-opt {args.command}: error: {e}\n")
    except OSError as e:
        if e.filename is None:  # not a path's: handled below, as a bug
            _bug(parser, args.command)
        parser.exit(2, f"dino-opt {args.command}: error: {e}\n")  # a path given, or a full disk
    except TrainingHungError as e:
        parser.exit(EXIT_HANG, f"dino-opt {args.command}: {e}\n")
    except (FloatingPointError, CollapseError, WorkerFailedError):
        raise  # a run's own outcome (diverged, collapsed, a worker lost), with its advice
    except Exception:  # noqa: BLE001 - anything else is dino-opt's fault, not the input's
        _bug(parser, args.command)


if __name__ == "__main__":
    sys.exit(main())
