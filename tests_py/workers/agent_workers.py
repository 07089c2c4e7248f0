"""Entry points for workers that torch's elastic agent spawns in the tests
(importable by name in a spawned process)."""

import json
import os
import sys
import time
from pathlib import Path

import torch
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


def report_launch(folder: str) -> int:
    """Writes what this worker was given (its marker variable, rank, working
    folder and intra-op threads) to FOLDER/rankN.json, and says its rank on
    its standard error."""
    rank = int(os.environ["RANK"])
    seen = {
        "mark": os.environ.get("DINO_OPT_TEST_MARK"),
        "rank": rank,
        "cwd": os.getcwd(),
        "threads": torch.get_num_threads(),
        "world": os.environ["WORLD_SIZE"],
    }
    Path(folder, f"rank{rank}.json").write_text(json.dumps(seen))
    print(f"report_launch rank {rank} mark {seen['mark']}", file=sys.stderr, flush=True)
    return rank
