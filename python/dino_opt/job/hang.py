"""What the job does about hangs: the watchdog started with its heartbeat
store, the report written when a rank stops making progress
(:class:`HangReporter`), and the hang injected for tests
(``debug.inject_hang_at_step``)."""

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

__all__ = ["HangReporter", "injected_hang", "read_hang", "start_watchdog"]


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


class HangReporter:
    """What a hung process leaves before it ends: the watchdog's ``on_hang``
    (:meth:`report`), held by the job. Built once the job has its checkpoint
    ``writer`` (None when it writes synchronously), with the run's
    ``manager`` of its checkpoints, ``hang_file`` (the run's ``hang.json``;
    None: none written), its ``world`` size, and ``since``, this attempt's
    start (``time.time()``; now by default): an older ``hang.json`` is
    another attempt's. Any rank's may report (the first to exit makes the
    launcher stop the others); the first written stands."""

    def __init__(
        self,
        hang_file: Path | None,
        manager: CheckpointManager,
        writer: AsyncCheckpointWriter | None,
        world: int,
        since: float | None = None,
    ):
        self.hang_file, self.manager, self.writer, self.world = hang_file, manager, writer, world
        self.since = time.time() if since is None else since

    def report(self, message: str, stuck: list[int]) -> str:
        """In the watchdog's thread, before the process ends: the checkpoint
        write in flight finishes; ``hang.json`` names the ``stuck`` ranks and
        the last checkpoint on disk. The first rank to write it since
        ``since`` wins: that rank fired while every rank was there, while a
        later one may find the first one's heartbeat already gone. So the
        diagnosis is written at once, before the wait for the checkpoint
        write (which can take seconds, while another rank's watchdog fires),
        and written again by the same rank with the checkpoint on disk after
        it. Returns the notes for the watchdog's message."""
        first = self.hang_file is not None and read_hang(self.hang_file, self.since) is None
        if first:
            self._write(message, stuck)
        notes = []
        if self.writer is not None and self.writer.in_flight:
            try:
                notes.append(f"the checkpoint write in flight finished: {self.writer.wait(300)}")
            except Exception as e:
                notes.append(f"the checkpoint write in flight did not finish: {e}")
        last = self._write(message, stuck) if first else self._last()
        notes.append(
            f"last checkpoint on disk: {last.path} (step {last.step}); run the same command "
            "again to resume from it"
            if last
            else "no checkpoint on disk yet"
        )
        return "\n".join(notes)

    def _last(self):
        records = self.manager.checkpoints()
        return records[-1] if records else None

    def _write(self, message: str, stuck: list[int]):
        """Writes ``hang.json`` with the newest checkpoint on disk; returns that checkpoint."""
        last = self._last()
        hang = {
            "message": message,
            "stuck_ranks": stuck,
            "world_size": self.world,
            "checkpoint": str(last.path) if last else None,
            "checkpoint_step": last.step if last else None,
            "time": time.time(),
        }
        with contextlib.suppress(OSError):
            text = json.dumps(hang, indent=2) + "\n"
            atomic_write(self.hang_file, lambda w: w.write(text.encode()))
        return last


def injected_hang(debug: DebugConfig, step: int, rank: int, attempt: int = 0) -> None:
    """``debug.inject_hang_at_step``: this rank stops before the metrics
    all-reduce (until the hang watchdog ends the process), on the first
    ``debug.inject_attempts`` attempts (``attempt``: the restarts so far)."""
    if (
        debug.inject_hang_at_step == step
        and rank == debug.inject_hang_rank
        and attempt < debug.inject_attempts
    ):
        print(
            f"rank {rank}: debug.inject_hang_at_step={step}: stopping", file=sys.stderr, flush=True
        )
        while True:
            time.sleep(60)
