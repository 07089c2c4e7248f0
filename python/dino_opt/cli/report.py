"""``dino-opt report RUN``: a run folder analysed (convergence, weight drift
between checkpoints, throughput, phases) by
:class:`~dino_opt.observe.DINOTrainingAnalyzer`, its reports and plots
written there."""

from __future__ import annotations

import argparse

from ..observe import DINOTrainingAnalyzer, format_report
from .common import json_argument, print_json

__all__ = ["add_parser", "run"]


def run(args: argparse.Namespace) -> int:
    report = DINOTrainingAnalyzer(args.run_dir).generate_report(args.output_dir)
    if args.json:
        print_json(report)
    else:
        print(format_report(report), end="")
    return 0


def add_parser(sub) -> None:
    r = sub.add_parser(
        "report", help="analyse a run folder: convergence, weight drift, throughput, phases"
    )
    r.add_argument("run_dir", help="a dino-opt train run folder (or its checkpoints/ folder)")
    r.add_argument(
        "--output-dir",
        help="where checkpoint_report.json, performance_report.json and the plots go "
        "(default: the run folder)",
    )
    json_argument(r, "print the report as JSON instead")
    r.set_defaults(run=run)
