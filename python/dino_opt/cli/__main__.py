"""``python -m dino_opt.cli ARGS``: ``dino-opt ARGS``."""

import sys

from . import main

if __name__ == "__main__":
    sys.exit(main())
