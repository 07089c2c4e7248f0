"""``dino-opt models``: the released networks a weights argument takes by
name, their sizes, sources and where each is cached
(:func:`~dino_opt.weights.model_rows`)."""

from __future__ import annotations

import argparse

from ..weights import format_models, model_rows
from .common import json_argument, print_json

__all__ = ["add_parser", "run"]


def run(args: argparse.Namespace) -> int:
    rows = model_rows()
    if args.json:
        print_json(rows)
        return 0
    print(format_models(rows))
    return 0


def add_parser(sub) -> None:
    m = sub.add_parser(
        "models", help="the released networks by name: sizes, sources, where each is cached"
    )
    json_argument(m, "print the rows as JSON")
    m.set_defaults(run=run)
