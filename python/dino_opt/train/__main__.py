"""``torchrun --nproc_per_node=N -m dino_opt.train [--config my.yaml] [key=value ...]``:
``dino-opt train``, one process per rank (see :mod:`dino_opt.distributed`)."""

import sys

from ..cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
