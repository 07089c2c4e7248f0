"""What several commands share: the backbone source and its ``--which`` and
``--device``, ``--force`` and ``--json`` arguments, and JSON output (printed,
or written to a file)."""

from __future__ import annotations

import json

from ..checkpoint import write_file

__all__ = [
    "device_argument",
    "force_argument",
    "json_argument",
    "print_json",
    "source_arguments",
    "which_argument",
    "write_json",
]


def which_argument(p) -> None:
    p.add_argument(
        "--which", choices=("teacher", "student"), default="teacher", help="default: teacher"
    )


def device_argument(p) -> None:
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default auto)")


def source_arguments(p) -> None:
    """SOURCE (a run, a checkpoint or weights), ``--which`` and ``--device``."""
    p.add_argument(
        "source",
        help="a dino-opt train run folder or checkpoint, or weights in any format "
        "model.init_from reads (timm, hf, dino, dinov2)",
    )
    which_argument(p)
    device_argument(p)


def force_argument(p) -> None:
    p.add_argument(
        "--force",
        action="store_true",
        help="replace an existing output (never one that is or holds a source or the working "
        "folder); without it an existing output is refused before any work",
    )


def json_argument(p, text: str = "print the result as JSON") -> None:
    p.add_argument("--json", action="store_true", help=text)


def print_json(result) -> None:
    print(json.dumps(result, indent=2))


def write_json(result: dict, output: str | None) -> None:
    """``result`` as JSON into ``output`` (atomically), when one is given."""
    if output:
        text = (json.dumps(result, indent=2) + "\n").encode()
        write_file(output, lambda f: f.write(text))
        print(f"wrote {output}")
