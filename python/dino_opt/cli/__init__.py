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

Each command is a module of this folder: its parser (``add_parser``) and
the call of the library function it faces; :mod:`.common` holds the
arguments and outputs several commands share.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Sequence

from ..data import prepare_dataset
from ..distributed import WorkerFailedError
from ..observe import CollapseError
from ..runtime import EXIT_HANG, TrainingHungError
from . import (
    config,
    doctor,
    embed,
    export,
    knn,
    models,
    predict,
    prepare,
    presets,
    report,
    show,
    train,
)
from . import eval as evaluate

__all__ = ["COMMANDS", "main", "prepare_dataset"]

#: The command modules, in the order ``dino-opt --help`` lists them.
COMMANDS = (
    prepare,
    train,
    config,
    presets,
    knn,
    evaluate,
    show,
    embed,
    predict,
    export,
    models,
    report,
    doctor,
)


def _bug(parser: argparse.ArgumentParser, command: str) -> None:
    """The traceback of an error no input explains, and a line saying so."""
    traceback.print_exc()
    line = "internal error: a bug in dino-opt, not in what you gave it; please report it with "
    parser.exit(1, f"dino-opt {command}: {line}the traceback above\n")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dino-opt", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(sub)
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
