"""What the job keeps for the restarts of its launcher (``dino-opt train
--nproc``/``--nnodes``, :mod:`dino_opt.distributed`).

* Each rank's last completed step, in ``RUN/progress/rank<R>.json``
  (:class:`ProgressFile`): one ``pwrite`` per step into a file that stays
  open, so what a process wrote is there even after a SIGKILL, and the
  launcher reads it (:func:`read_progress`) once the process is gone.
* The failures a launcher saw, one file each in ``RUN/failures/``
  (:func:`record_failure`), written before it restarts its workers.
* The restart rows: rank 0 of the restarted job turns the failures it finds
  (:func:`pending_failures`) into one row of ``RUN/restarts.json``
  (:func:`claim_restart`): when, which rank, why, its last completed step,
  and the step the job resumed from.

The restarts live in the run folder, not in the checkpoints: a restart
resumes from a checkpoint written before the failure, which cannot hold it,
and a later restart may resume from the same one. The folder keeps them
across further restarts and resumes; the job adds the rows its history
lacks to ``metrics.jsonl`` (:func:`rows_to_log`) and lists them all in
``report.json``. Also here: the kill injected for tests
(``debug.inject_kill_at_step``).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys
import time
from datetime import datetime
from pathlib import Path

from ..checkpoint import atomic_write
from ..config import DebugConfig
from ..observe import RunFolder
from ..runtime import EXIT_HANG
from .hang import read_hang

__all__ = [
    "ProgressFile",
    "claim_restart",
    "describe_exit",
    "first_failure",
    "injected_kill",
    "pending_failures",
    "read_progress",
    "read_restarts",
    "record_failure",
    "rows_to_log",
    "stuck_ranks",
]

_PROGRESS_BYTES = 80  # one fixed-size record, overwritten in place


def _progress_path(folder: RunFolder, rank: int) -> Path:
    return folder.progress / f"rank{rank}.json"


class ProgressFile:
    """Rank ``rank``'s last completed step in ``RUN/progress/rank<R>.json``.

    :meth:`update` costs one ``pwrite`` of a fixed-size record at offset 0
    (no fsync, no rename): the kernel keeps it when the process dies, even
    by SIGKILL, though not when the node does."""

    def __init__(self, folder: RunFolder, rank: int, step: int):
        path = _progress_path(folder, rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fd: int | None = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self.update(step)

    def update(self, step: int) -> None:
        if self._fd is not None:
            text = json.dumps({"step": int(step), "time": round(time.time(), 3)})
            os.pwrite(self._fd, text.ljust(_PROGRESS_BYTES).encode(), 0)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def read_progress(folder: RunFolder, rank: int) -> int | None:
    """The last completed step that rank ``rank`` wrote, None if unknown."""
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        return int(json.loads(_progress_path(folder, rank).read_text())["step"])
    return None


# ---------------------------------------------------------------- failures


def _signal_name(exitcode: int) -> str | None:
    if exitcode >= 0:
        return None
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return f"signal {-exitcode}"


def describe_exit(rank: int, exitcode: int, step: int | None) -> str:
    """``rank 1 was killed by SIGKILL after step 7`` and the like
    (``exitcode``: a process's exit status, minus the signal that killed it)."""
    after = f" after step {step}" if step is not None else ""
    if exitcode < 0:
        return f"rank {rank} was killed by {_signal_name(exitcode)}{after}"
    if exitcode == EXIT_HANG:
        return (
            f"rank {rank} made no progress{after}: the hang watchdog ended the run "
            f"(exit status {EXIT_HANG})"
        )
    return f"rank {rank} exited with status {exitcode}{after}"


def first_failure(exits: list[dict]) -> dict:
    """Of the ranks that ended (``rank``, ``exitcode``, optional ``time``),
    the one that most likely brought the others down: killed by a signal
    first (nothing in the job sends one), then ended by the hang watchdog,
    then the earliest seen, then the lowest rank. When one rank dies the
    others fail in their next collective, so a launcher that sees them
    always sees the first one too."""

    def order(e: dict) -> tuple:
        kind = 0 if e["exitcode"] < 0 else 1 if e["exitcode"] == EXIT_HANG else 2
        return kind, e.get("time", 0.0), e["rank"]

    return min(exits, key=order)


def record_failure(
    folder: RunFolder, exits: list[dict], progress: dict[int, int | None], restart: int
) -> Path:
    """A launcher's record of the ranks of its node that ended (``rank``,
    ``exitcode``, ``step``: last completed step), with the last completed
    step of each of its ranks (``progress``); ``restart``: the number of the
    restart it is about to make. One file in ``RUN/failures/``."""
    now = time.time()
    record = {
        "time": now,
        "host": socket.gethostname(),
        "restart": restart,
        "exits": exits,
        "progress": {str(r): s for r, s in progress.items()},
    }
    folder.failures.mkdir(parents=True, exist_ok=True)
    path = folder.failures / f"{socket.gethostname()}-{os.getpid()}-{time.time_ns()}.json"
    text = json.dumps(record, indent=2) + "\n"
    atomic_write(path, lambda f: f.write(text.encode()))
    return path


def read_restarts(folder: RunFolder) -> list[dict]:
    """The restart rows of ``RUN/restarts.json`` (none when there is no file)."""
    try:
        rows = json.loads(folder.restarts.read_text())
    except FileNotFoundError:
        return []
    except (OSError, ValueError) as e:
        print(
            f"warning: {folder.restarts} unreadable, restarts so far not known: {e}",
            file=sys.stderr,
        )
        return []
    return rows if isinstance(rows, list) else []


def pending_failures(folder: RunFolder) -> list[dict]:
    """The failures recorded in ``RUN/failures/`` that no restart row has
    claimed yet, oldest first (each with its file name as ``id``)."""
    if not folder.failures.is_dir():
        return []
    claimed = {i for row in read_restarts(folder) for i in row.get("records", ())}
    found = []
    for path in folder.failures.glob("*.json"):
        if path.name in claimed:
            continue
        with contextlib.suppress(OSError, ValueError):
            found.append({**json.loads(path.read_text()), "id": path.name})
    return sorted(found, key=lambda r: r["time"])


def stuck_ranks(folder: RunFolder, after: float) -> list[int]:
    """The stuck ranks of ``hang.json`` when it was written after ``after``."""
    hang = read_hang(folder.hang, after)
    with contextlib.suppress(KeyError, ValueError, TypeError):
        return [int(r) for r in hang["stuck_ranks"]] if hang else []
    return []


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t).astimezone().isoformat(timespec="seconds")


def claim_restart(
    folder: RunFolder, pending: list[dict], *, step: int, epoch: int, checkpoint: Path | None
) -> list[dict]:
    """Rank 0 of a restarted job: one row for the failures ``pending``
    (:func:`pending_failures`), the job having resumed at ``step`` of
    ``epoch`` from ``checkpoint`` (None: from the start), appended to
    ``RUN/restarts.json``; their files are removed. Returns every row."""
    rows = read_restarts(folder)
    exits = [{**e, "time": r["time"], "host": r["host"]} for r in pending for e in r["exits"]]
    progress = {int(k): v for r in pending for k, v in r.get("progress", {}).items()}
    failed_at = min(r["time"] for r in pending)
    root = first_failure(exits) if exits else {"rank": None, "exitcode": None, "step": None}
    rank, code, at_step = root["rank"], root["exitcode"], root.get("step")
    row = {
        "event": "restart",
        "restart": len(rows) + 1,
        "step": step,
        "epoch": epoch,
        "time": _iso(failed_at),
        "rank": rank,
        "exitcode": code,
        "signal": _signal_name(code) if code is not None else None,
    }
    if code == EXIT_HANG:
        before = datetime.fromisoformat(rows[-1]["time"]).timestamp() if rows else 0.0
        stuck = stuck_ranks(folder, before)
        if stuck:
            rank, at_step = stuck[0], progress.get(stuck[0])
            row.update(rank=rank, stuck_ranks=stuck)
    row.update(
        at_step=at_step,
        message=describe_exit(rank, code, at_step) if code is not None else "unknown failure",
        checkpoint=checkpoint.name if checkpoint is not None else None,
        restart_seconds=round(time.time() - failed_at, 2),
        failures=[{k: e.get(k) for k in ("rank", "exitcode", "host")} for e in exits],
        records=[r["id"] for r in pending],
    )
    rows.append(row)
    text = json.dumps(rows, indent=2) + "\n"
    atomic_write(folder.restarts, lambda f: f.write(text.encode()))
    for record in row["records"]:
        with contextlib.suppress(OSError):
            (folder.failures / record).unlink()
    return rows


def rows_to_log(rows: list[dict], history: list[dict], step: int) -> list[dict]:
    """The restart rows a resumed job's history lacks (it resumed from a
    checkpoint written before them), up to its ``step``."""
    logged = {r.get("restart") for r in history if r.get("event") == "restart"}
    return [r for r in rows if r["restart"] not in logged and r["step"] <= step]


def injected_kill(debug: DebugConfig, step: int, rank: int, attempt: int) -> None:
    """``debug.inject_kill_at_step``: this rank kills itself with SIGKILL
    after that step, on the first ``debug.inject_attempts`` attempts
    (``attempt``: the restarts so far)."""
    if (
        debug.inject_kill_at_step == step
        and rank == debug.inject_kill_rank
        and attempt < debug.inject_attempts
    ):
        print(
            f"rank {rank}: debug.inject_kill_at_step={step}: SIGKILL", file=sys.stderr, flush=True
        )
        os.kill(os.getpid(), signal.SIGKILL)
