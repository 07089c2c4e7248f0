"""``dino-opt doctor``: the versions, the kernels of this build by device,
and every fused operator checked on the device (:mod:`dino_opt.doctor`);
exit status 1 on any mismatch."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import torch

from ..doctor import environment, kernel_table, run_checks
from ..runtime import resolve_device

__all__ = ["add_parser", "run"]


def add_parser(sub) -> None:
    d = sub.add_parser(
        "doctor", help="versions, kernels by device, and a self-check of every operator here"
    )
    d.add_argument(
        "--device",
        default="auto",
        help="auto (CUDA when there is one), cpu, cuda, cuda:N, mps, xpu",
    )
    d.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    d.set_defaults(run=run)


def _print_rows(title: str, rows: Sequence[tuple[str, str]]) -> None:
    print(title)
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")


def run(args: argparse.Namespace) -> int:
    """Prints the report; 0 when every check passed, else 1."""
    device = resolve_device("auto") if args.device == "auto" else torch.device(args.device)
    _print_rows("dino_opt doctor", environment(device))
    _print_rows("kernels", kernel_table(device))
    print(f"self-check on {device} (seed {args.seed}):")
    checks = run_checks(device, args.seed)
    for check in checks:
        print("  " + check.line())
    failed = [c.name for c in checks if not c.ok]
    print(f"{len(checks) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0
