"""What the job does about hangs: the watchdog started with its heartbeat
store, the report written when a rank stops making progress, and the hang
injected for tests (``debug.inject_hang_at_step``)."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from ..checkpoint import AsyncCheckpointWriter, CheckpointManager, atomic_write
from ..config import DebugConfig
from ..runtime import HangWatchdog, broadcast_object, host_store, join_store

__all__ = ["injected_hang", "read_hang", "report_hang", "start_watchdog"]


def start_watchdog(
    timeout_s: float | None, rank: int, world: int, on_hang: Callable[[str, list[int]], str]
) -> HangWatchdog | None:
    """The hang watchdog with a heartbeat store hosted by rank 0 when there
    are several ranks (collective then); None when ``timeout_s`` is 0/None."""
    if not timeout_s:
        return None
    store = None
    if world > 1:
        store = host_store() if rank == 0 else None
        port = broadcast_object(store.port if store is not None else None)
        if store is None:
            store = join_store(os.environ.get("MASTER_ADDR", "localhost"), port)
    watchdog = HangWatchdog(timeout_s, rank=rank, world_size=world, store=store, on_hang=on_hang)
    return watchdog.start()


def read_hang(hang_file: Path, after: float) -> dict | None:
    """``hang.json`` when it was written after ``after`` (``time.time()``), else None."""
    with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
        hang = json.loads(hang_file.read_text())
        if float(hang["time"]) > after:
            return hang
    return None


def report_hang(
    message: str,
    stuck: list[int],
    writer: AsyncCheckpointWriter | None,
    manager: CheckpointManager,
    hang_file: Path | None,
    world: int,
    since: float = 0.0,
) -> str:
    """Before a hung process ends: the checkpoint write in flight finishes;
    ``hang_file`` (the run's ``hang.json``) names the stuck ranks and the last
    checkpoint on disk. The first rank to write it since ``since`` (this
    attempt's start) wins: that rank fired while every rank was there, while
    a later one may find the first one's heartbeat already gone. So the
    diagnosis is written at once, before the wait for the checkpoint write
    (which can take seconds, while another rank's watchdog fires), and
    written again by the same rank with the checkpoint on disk after it.
    Returns the notes for the watchdog's message."""
    first = hang_file is not None and read_hang(hang_file, since) is None
    if first:
        _write_hang(hang_file, message, stuck, world, manager)
    notes = []
    if writer is not None and writer.in_flight:
        try:
            notes.append(f"the checkpoint write in flight finished: {writer.wait(300)}")
        except Exception as e:
            notes.append(f"the checkpoint write in flight did not finish: {e}")
    last = _write_hang(hang_file, message, stuck, world, manager) if first else _last(manager)
    notes.append(
        f"last checkpoint on disk: {last.path} (step {last.step}); run the same command "
        "again to resume from it"
        if last
        else "no checkpoint on disk yet"
    )
    return "\n".join(notes)


def _last(manager: CheckpointManager):
    records = manager.checkpoints()
    return records[-1] if records else None


def _write_hang(hang_file: Path, message: str, stuck: list[int], world: int,
                manager: CheckpointManager):  # fmt: skip
    """Writes ``hang.json`` with the newest checkpoint on disk; returns that checkpoint."""
    last = _last(manager)
    hang = {
        "message": message,
        "stuck_ranks": stuck,
        "world_size": world,
        "checkpoint": str(last.path) if last else None,
        "checkpoint_step": last.step if last else None,
        "time": time.time(),
    }
    with contextlib.suppress(OSError):
        text = json.dumps(hang, indent=2) + "\n"
        atomic_write(hang_file, lambda w: w.write(text.encode()))
    return last


def injected_hang(debug: DebugConfig, step: int, rank: int, attempt: int = 0) -> None:
    """``debug.inject_hang_at_step``: this rank stops before the metrics
    all-reduce (until the hang watchdog ends the process), on the first
    ``debug.inject_attempts`` attempts (``attempt``: the restarts so far)."""
    if (debug.inject_hang_at_step == step and rank == debug.inject_hang_rank
            and attempt < debug.inject_attempts):  # fmt: skip
        print(
            f"rank {rank}: debug.inject_hang_at_step={step}: stopping", file=sys.stderr, flush=True
        )
        while True:
            time.sleep(60)
