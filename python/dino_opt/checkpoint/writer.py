"""Asynchronous checkpoints: the step waits only for a copy of the state into
reused host buffers (pinned on a GPU); a thread writes it through the manager.
:class:`ShardedCheckpointWriter` does the same for a sharded run, every rank
writing its own shards through ``torch.distributed.checkpoint``."""

from __future__ import annotations

import contextlib
import copy
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from .files import CheckpointWriteError
from .manager import CheckpointManager, _remove
from .sharded import write_extra

__all__ = ["AsyncCheckpointWriter", "ShardedCheckpointWriter"]


# ------------------------------------------------------------ asynchronous


class _BackgroundWrite:
    """One write at a time in a thread of its own (not a daemon: an
    interpreter that exits on an exception still finishes it): its result,
    or its error raised once by the next :meth:`wait`."""

    def __init__(self, name: str):
        self.name = name
        self.thread: threading.Thread | None = None
        self.result: Path | None = None
        self.error: BaseException | None = None

    @property
    def in_flight(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def run_here(self, work, *args) -> None:
        """``work(*args)`` in the caller's thread, kept as a write's outcome."""
        self.result = None
        try:
            self.result = work(*args)
        except BaseException as e:  # surfaced by the next wait()
            self.error = e

    def start(self, work, *args) -> None:
        """``work(*args)`` in a new thread; the caller has waited for the one before."""
        self.result = None
        self.thread = threading.Thread(
            target=self.run_here, args=(work, *args), name=self.name, daemon=False
        )
        self.thread.start()

    def wait(self, timeout: float | None = None) -> Path | None:
        thread = self.thread
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():
                raise TimeoutError(f"checkpoint write still in flight after {timeout} s")
            self.thread = None
        error, self.error = self.error, None
        if error is not None:
            raise error
        return self.result


class _SnapshotPool:
    """Host buffers for the tensors of a state, reused from one snapshot to
    the next (in the order the state is walked) when shape and dtype match,
    so a save does not page in fresh memory each time; pinned when the
    tensor lives on a GPU, so its copy is a DMA that does not block."""

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor | None] = []
        self._next = 0

    def start(self) -> None:
        self._next = 0

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        i, self._next = self._next, self._next + 1
        t = t.detach()
        if t.layout != torch.strided:  # sparse and friends: a plain copy each time
            return t.to("cpu", copy=True)
        self._buffers += [None] * (i + 1 - len(self._buffers))
        pin = t.device.type == "cuda"
        buf = self._buffers[i]
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype or buf.is_pinned() != pin:
            buf = self._buffers[i] = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
        buf.copy_(t, non_blocking=pin)
        return buf


def _snapshot(obj: Any, pool: _SnapshotPool) -> Any:
    """A copy of ``obj`` that later training cannot change: containers
    rebuilt, tensors copied to host buffers, other leaves deep-copied."""
    if isinstance(obj, torch.Tensor):
        return pool.copy(obj)
    if isinstance(obj, dict):
        return type(obj)((k, _snapshot(v, pool)) for k, v in obj.items())
    if isinstance(obj, list):
        return [_snapshot(v, pool) for v in obj]
    if isinstance(obj, tuple):
        items = [_snapshot(v, pool) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)
    return copy.deepcopy(obj)


class AsyncCheckpointWriter:
    """Writes the checkpoints of ``manager`` in a background thread.

    :meth:`save` takes the arguments of :meth:`CheckpointManager.save`. It
    first waits for the write before it (so at most one is in flight) and
    raises that write's error, if it had one; then it copies the state (the
    only part the caller waits for: tensors to host buffers, pinned and
    reused between saves, one device synchronisation on a GPU) and hands
    the copy to a thread that writes, hashes, renames and rotates exactly
    as a synchronous save does. The index records a checkpoint only once
    its write is complete, so a process killed mid-write loses only that
    write. :meth:`wait` returns the path of the last write or raises its
    error. The thread is not a daemon: an interpreter that exits on an
    exception still finishes the write in flight. On Linux it runs at a
    lower priority (``nice``, default 10), so that on a machine whose cores
    the training step keeps busy (a CPU run) it takes the gaps rather than
    the step's time.
    """

    def __init__(self, manager: CheckpointManager, nice: int = 10):
        self.manager = manager
        self.nice = nice  # the writer thread's scheduling priority on Linux (0: as the caller)
        self._pool = _SnapshotPool()
        self._job = _BackgroundWrite("dino_opt-checkpoint")
        self.last_copy_seconds = 0.0  # what the caller of the last save waited for the copy

    @property
    def in_flight(self) -> bool:
        """Whether a write is still going on."""
        return self._job.in_flight

    def wait(self, timeout: float | None = None) -> Path | None:
        """Waits for the write in flight (at most ``timeout`` seconds; then
        TimeoutError) and returns its path (None when there was none); raises
        its error (:class:`CheckpointWriteError`) once."""
        return self._job.wait(timeout)

    def save(self, state: dict, **kwargs) -> Path:
        """Starts writing ``state`` (see :meth:`CheckpointManager.save` for
        the keywords) and returns the path it will have."""
        if not isinstance(state, dict):
            raise TypeError(f"state must be a dict, got {type(state).__name__}")
        self.wait()
        start = time.perf_counter()
        self._pool.start()
        snapshot = _snapshot(state, self._pool)
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()  # the copies to pinned memory are complete
        self.last_copy_seconds = time.perf_counter() - start
        self._job.start(self._write, snapshot, kwargs)
        return self.manager.path_for(kwargs["epoch"], kwargs["step"])

    def _write(self, snapshot: dict, kwargs: dict) -> Path:
        if sys.platform.startswith("linux"):  # a nice value per thread on Linux only
            # yield the CPU to the training threads where they need it all
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.nice)
        return self.manager.save(snapshot, **kwargs)


class ShardedCheckpointWriter:
    """Writes the checkpoints of a sharded run: every rank calls :meth:`save`
    at the same step with its shards (sharded state dicts of the student,
    teacher and optimizer) and, on rank 0 (``lead``), the small rest of the
    state.

    Rank 0 prepares the hidden folder (:meth:`CheckpointManager.partial_path`)
    and writes the small state into it; then every rank writes its shards
    with ``torch.distributed.checkpoint``, asynchronously (``async_save``:
    the caller waits only for the copy of its shards to host memory) unless
    ``asynchronous=False``. The description (``.metadata``) is written once
    every rank has written, and only then does rank 0 publish the folder
    through the manager (renamed into place, recorded in the index), so a
    checkpoint that any rank did not finish is never listed. At most one save
    is in flight: :meth:`save` first waits for the one before and raises its
    error on every rank. The writes go through a gloo group of their own
    (``process_group``; by default made here, a collective), so that the
    background thread's collectives never interleave with the training's.
    """

    def __init__(
        self,
        manager: CheckpointManager,
        *,
        lead: bool,
        asynchronous: bool = True,
        process_group=None,
    ):
        self.manager = manager
        self.lead = lead
        self.asynchronous = asynchronous
        self.group = process_group if process_group is not None else dist.new_group(backend="gloo")
        self._job = _BackgroundWrite("dino_opt-dcp")
        self.last_copy_seconds = 0.0  # what the caller of the last save waited for

    @property
    def in_flight(self) -> bool:
        return self._job.in_flight

    def wait(self, timeout: float | None = None) -> Path | None:
        """Waits for the save in flight; returns its path on rank 0 (None
        elsewhere, or when there was none) or raises its error once."""
        return self._job.wait(timeout)

    def save(self, shards: dict, extra: dict | None, **kwargs) -> Path:
        """Collective. ``shards``: this rank's sharded state dicts; ``extra``:
        the rest of the state (used on rank 0); ``kwargs``: ``epoch``,
        ``step``, ``milestone``, ``end_of_epoch`` as for
        :meth:`CheckpointManager.publish_sharded`. Returns the folder's path.
        Raises, on every rank, the error of the save before (any rank's) or of
        rank 0's preparation of this one."""
        path = self.manager.path_for(kwargs["epoch"], kwargs["step"], sharded=True)
        partial = self.manager.partial_path(path)
        error = self._error_of_previous()
        if error is None and self.lead:
            try:
                _remove(partial)  # left by a save that was killed
                partial.mkdir(parents=True)
                write_extra(partial, extra)
            except Exception as e:
                error = CheckpointWriteError(path, e)
        self._agree(error)  # also the barrier: the folder is ready for every rank
        start = time.perf_counter()
        if not self.asynchronous:
            dcp.save(shards, checkpoint_id=os.fspath(partial), process_group=self.group)
            self._job.run_here(self._publish, partial, kwargs)
            self.wait()
            return path
        future = dcp.async_save(shards, checkpoint_id=os.fspath(partial), process_group=self.group)
        self.last_copy_seconds = time.perf_counter() - start
        self._job.start(self._finish, future, partial, kwargs)
        return path

    def _error_of_previous(self) -> BaseException | None:
        try:
            self.wait()
        except BaseException as e:
            return e
        return None

    def _agree(self, error: BaseException | None) -> None:
        """Collective: raises ``error`` here, and on the other ranks an error
        saying that a rank failed, when any rank has one."""
        failed = torch.tensor([float(error is not None)])
        dist.all_reduce(failed, group=self.group)
        if error is not None:
            raise error
        if failed.item() > 0:
            raise RuntimeError("a checkpoint write failed on another rank (see its log)")

    def _finish(self, future, partial: Path, kwargs: dict) -> Path | None:
        future.result()  # every rank's shards are written
        return self._publish(partial, kwargs)

    def _publish(self, partial: Path, kwargs: dict) -> Path | None:
        return self.manager.publish_sharded(partial, **kwargs) if self.lead else None
