"""``dino-opt config``: a configuration as YAML, DINO's defaults
(:func:`~dino_opt.config.default_config`) or the demo preset
(:data:`~dino_opt.config.DEMO_PRESET`)."""

from __future__ import annotations

import argparse

from ..config import DEMO_PRESET, Config, config_to_yaml, default_config

__all__ = ["add_parser", "run"]


def run(args: argparse.Namespace) -> int:
    cfg = Config.from_dict(DEMO_PRESET) if args.demo else default_config()
    print(config_to_yaml(cfg), end="")
    return 0


def add_parser(sub) -> None:
    c = sub.add_parser("config", help="print a configuration as YAML")
    c.add_argument("--print-defaults", action="store_true", help="DINO's defaults (the default)")
    c.add_argument("--demo", action="store_true", help="the demo preset instead")
    c.set_defaults(run=run)
