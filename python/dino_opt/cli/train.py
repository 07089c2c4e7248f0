"""``dino-opt train``: the configuration of the flags
(:func:`~dino_opt.api.training_config`) trained in this process
(:func:`~dino_opt.job.run_training`) or on several
(:func:`~dino_opt.distributed.launch_distributed_training`); the report as
JSON, and one line for a person."""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
import time
import traceback

from ..api import ADAPT_OVERRIDES, training_config
from ..config import Config
from ..distributed import WorkerFailedError, launch_distributed_training
from ..job import run_training
from ..runtime import EXIT_HANG, TrainingHungError, launched_world
from ..train import DEMO_PRESETS
from .common import print_json

__all__ = ["add_parser", "resume_command", "run", "summary_line"]


def run(args: argparse.Namespace) -> int:
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
                cfg,
                args.nproc,
                addr,
                port,
                output_dir=out,
                nnodes=args.nnodes,
                node_rank=node_rank,
                verbose=args.verbose,
            )
        except (WorkerFailedError, TrainingHungError) as e:  # out of restarts: one line
            if args.verbose:
                traceback.print_exc()
            print(f"dino-opt: {e}; resume with: {resume_command(args, out, cfg)}", file=sys.stderr)
            return EXIT_HANG if isinstance(e, TrainingHungError) else e.exit_status
    else:
        report = run_training(cfg, output_dir=args.output_dir, quiet=args.quiet)
    print_json(report)
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


def resume_command(args: argparse.Namespace, out, cfg: Config) -> str:
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
    return line + (
        f"\ndino-opt train: {report['adapt_verdict']}" if "adapt_verdict" in report else ""
    )


def add_parser(sub) -> None:
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
    t.add_argument(
        "--adapt",
        metavar="WEIGHTS",
        help="continued pretraining from released "
        "weights (a file, or a name: dino-opt models): "
        + " ".join(ADAPT_OVERRIDES).replace("{weights}", "WEIGHTS")
        + " (a name also sets the model it holds; key=value overrides win)",
    )
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
    t.set_defaults(run=run)
