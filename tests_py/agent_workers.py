"""Entry points for workers that torch's elastic agent spawns in the tests
(importable by name in a spawned process)."""

import os
import time

from dino_opt.distributed.agent import exit_no_restart


def bad_input_then_abort(said: bool) -> int:
    """Rank 1 ends at once: with ``said``, through ``exit_no_restart`` and
    then a crash on its way out (SIGABRT, as a library's teardown can);
    without, by the crash alone. Rank 0 is still working when that happens."""
    rank = int(os.environ["RANK"])
    if rank == 1:
        if said:
            try:
                exit_no_restart("dino-opt: rank 1: model.widht is not a key")
            except SystemExit:
                pass
        os.abort()
    time.sleep(60)
    return rank
