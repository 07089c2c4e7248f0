"""Runs a worker script as the ranks of a gloo process group (one process
each, one intra-op thread) and reads back what each wrote."""

import json
import os
from collections.abc import Callable
from pathlib import Path

from forked import ScriptProcess


def launch_ranks(
    script: Path, world: int, args_of: Callable[[int], list[str]], timeout: int
) -> None:
    """``python script RANK WORLD *args_of(RANK)`` for every rank at once
    (forked from the tests' preloaded server: :mod:`forked`); each must exit
    0 (else its stderr's end is the failure)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        ScriptProcess(script, [str(rank), str(world), *args_of(rank)], env) for rank in range(world)
    ]
    for p in procs:
        _, err = p.communicate(timeout=timeout)
        assert p.returncode == 0, err[-4000:]


def run_ranks(script: Path, out: Path, *args: str, world: int = 2, timeout: int = 900) -> list:
    """``python script RANK WORLD INIT_FILE OUT *args`` for every rank; each
    writes OUT/rank{rank}.json, returned in rank order."""
    launch_ranks(script, world, lambda rank: [str(out / "init"), str(out), *args], timeout)
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(world)]
