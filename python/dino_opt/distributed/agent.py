"""The launcher's agent: torch's elastic agent on one node of the job, which
restarts every worker when one fails.

:func:`run_agent` is what ``torchrun --max-restarts`` runs on each node:
torch's :class:`LocalElasticAgent` starts the node's workers, all nodes meet
through a c10d rendezvous (a TCP store hosted by node 0's agent), and when a
worker fails (a signal, a non-zero exit status, the hang watchdog's exit)
the agent stops the node's workers and meets the others again; the other
nodes' agents see a node waiting and restart theirs too, so every worker of
the job starts afresh (and resumes from the newest complete checkpoint).

The workers are forks of one server process per launcher (multiprocessing's
forkserver, where the platform has one), which imported torch and the package
once, before any CUDA call: a worker starts in a fraction of a second instead
of importing torch afresh (~4-7 s), and a restart costs no import at all. The
server outlives a launch (a notebook or a test session that launches several
jobs reuses it), so nothing of a launch's state may come from it: each
worker is given its launch's environment and working folder explicitly
(:func:`enter_launch_env`), and two launches from one process cannot leak
into each other.

What torch's agent does not keep, this one does (:class:`_RecordingAgent`):
every worker's exit status as it sees them (torch reports one worker per
failure, not necessarily the first to fail), and, before each restart, a
record of the failure in the run folder (``RUN/failures/``) with the last
completed step of its ranks, which rank 0 of the restarted job makes a
restart row of. Out of restarts, it raises one error naming the rank, its
exit status or signal, its last completed step and the last checkpoint.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import multiprocessing
import os
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from multiprocessing import forkserver, reduction
from pathlib import Path
from typing import Any, NoReturn

import torch
from torch.distributed.elastic.agent.server.api import WorkerGroup, WorkerSpec, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException
from torch.distributed.elastic.rendezvous import (
    RendezvousError,
    RendezvousParameters,
    dynamic_rendezvous,
)
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

from ..checkpoint import CheckpointManager
from ..job import describe_exit, first_failure, read_progress, record_failure, stuck_ranks
from ..observe import RunFolder
from ..runtime import EXIT_HANG, TrainingHungError

__all__ = [
    "EXIT_NO_RESTART",
    "NO_RESTART_DIR",
    "WORKER_PRELOAD",
    "WorkerFailedError",
    "enter_launch_env",
    "exit_no_restart",
    "run_agent",
    "start_worker_server",
    "worker_start_method",
]

#: A worker's exit status for a failure that a restart would repeat (a bad
#: config, a checkpoint this run cannot resume): the job ends without restarts.
EXIT_NO_RESTART = 3

#: The environment variable naming the folder where a worker of
#: :func:`run_agent` says, before it exits, that a restart would fail again
#: (:func:`exit_no_restart`): its exit status alone can be lost, when the
#: process crashes in its teardown or torch sees another rank's end first.
NO_RESTART_DIR = "DINO_OPT_NO_RESTART_DIR"

# torch's loggers that print a worker's failure as a traceback (and the
# agent's progress); quiet unless verbose: the launcher says it in one line.
_TORCH_LOGGERS = ("torch.distributed.elastic", "torch.multiprocessing")
_SHARED_STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"  # torch's switch, read by its rendezvous

#: What the workers' server imports once, before it forks any worker: the
#: training, and torch's compiler front end, which torch's optimizers import
#: on their first step (1-3 s in each worker, at each restart, otherwise).
WORKER_PRELOAD = ("dino_opt.distributed.launch", "torch._dynamo")

#: This process's environment when this module was imported. In a worker
#: forked from the server, that is the server's, which torch's agent then
#: overlays with the worker's own variables (its rank, the rendezvous's
#: address): what differs from it is torch's.
_IMPORT_ENV = dict(os.environ)

# The variables torch's agent sets for each worker (also seen when a value
# happens to equal the server's).
_TORCH_WORKER_VARS = frozenset(
    (
        "RANK",
        "LOCAL_RANK",
        "GROUP_RANK",
        "ROLE_RANK",
        "ROLE_NAME",
        "LOCAL_WORLD_SIZE",
        "WORLD_SIZE",
        "GROUP_WORLD_SIZE",
        "ROLE_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    )
)
# What torch reads once, when it is imported: left out of the server's environment.
_THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def worker_start_method() -> str:
    """How the launcher starts its workers: ``forkserver`` where the
    platform has it, else ``spawn``."""
    return "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"


def start_worker_server(preload: tuple[str, ...] = WORKER_PRELOAD) -> None:
    """Starts the workers' server (multiprocessing's forkserver), which
    imports the modules ``preload`` once, unless one runs already in this
    process (a worker then imports what it lacks itself). It starts without
    the thread-count variables, so that torch in it takes its default: a
    worker sets its own from its launch's environment
    (:func:`enter_launch_env`), as a spawned one would read it."""
    if worker_start_method() != "forkserver":
        return
    multiprocessing.set_forkserver_preload(list(preload))
    kept = {name: os.environ.pop(name) for name in _THREAD_VARS if name in os.environ}
    try:
        forkserver.ensure_running()
    finally:
        os.environ.update(kept)


def enter_launch_env(env: dict[str, str], cwd: str) -> None:
    """In a worker: its launch's environment ``env`` (taken when the launch
    began), with the variables torch's agent set for this worker over it,
    its launch's working folder ``cwd`` and its intra-op thread count
    (``OMP_NUM_THREADS``, which torch reads only when it is imported). What
    it inherited from the server is frozen out of the garbage collector's
    passes, which would otherwise walk every imported module (docs/testing.md)."""
    gc.freeze()
    own = {
        k: v
        for k, v in os.environ.items()
        if k in _TORCH_WORKER_VARS or k.startswith("TORCHELASTIC_") or _IMPORT_ENV.get(k) != v
    }
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(own)
    os.chdir(cwd)
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))


class _LaunchStreams:
    """The launcher's standard output and error, handed to a worker: pickled
    as duplicates of its descriptors 1 and 2, which multiprocessing passes
    to the new process, where :func:`_take_streams` puts them in place of
    the worker's own (a forked worker's are the server's: those of whoever
    launched first)."""

    def __reduce__(self):
        return _take_streams, tuple(_dup_for_worker(fd) for fd in (1, 2))


def _dup_for_worker(fd: int):
    """``fd`` passed to the process being started (None when it is closed)."""
    try:
        os.fstat(fd)
    except OSError:
        return None
    return reduction.DupFd(fd)


def _take_streams(*passed) -> tuple[int, ...]:
    """In a worker: the launcher's descriptors ``passed`` become 1 and 2."""
    for fd, dup in zip((1, 2), passed, strict=True):
        if dup is not None:
            new = dup.detach()
            if new != fd:
                os.dup2(new, fd)
                os.close(new)
    return (1, 2)


def _in_launch_env(
    env: dict[str, str], cwd: str, streams: tuple[int, ...], entry: Callable, *args: Any
) -> Any:
    """A worker's first call: :func:`enter_launch_env` (its output and error,
    ``streams``, were put in place as it was unpickled), then
    ``entry(*args)``."""
    enter_launch_env(env, cwd)
    return entry(*args)


class WorkerFailedError(RuntimeError):
    """A worker of a job started by :func:`run_agent` failed with no restart
    left, the other nodes were lost, or the launcher itself got a signal.
    The message is one line: the rank, its signal or exit status, its last
    completed step, the restarts used and the last checkpoint.
    ``exit_status``: what the launcher exits with (1; 128 + the signal's
    number when it got one). (A hang raises
    :class:`~dino_opt.runtime.TrainingHungError` instead.)"""

    def __init__(self, message: str, exit_status: int = 1):
        super().__init__(message)
        self.exit_status = exit_status


def exit_no_restart(message: str) -> NoReturn:
    """Ends a worker on a failure a restart would repeat: prints ``message``
    in one line, tells the agent (when one started this process) and exits
    with :data:`EXIT_NO_RESTART`."""
    print(message, file=sys.stderr, flush=True)
    folder = os.environ.get(NO_RESTART_DIR)
    if folder:
        with contextlib.suppress(OSError):
            Path(folder, f"rank{os.environ.get('RANK', '0')}").write_text(message)
    raise SystemExit(EXIT_NO_RESTART)


def _no_restart_ranks(folder: str) -> list[int]:
    """The ranks that said a restart would fail again (:func:`exit_no_restart`)."""
    return sorted(int(p.name[4:]) for p in Path(folder).glob("rank*") if p.name[4:].isdigit())


def _peek_exit(pid: int) -> int | None:
    """The exit status of the child process ``pid`` (minus the signal that
    killed it) if it has ended, else None; it is not reaped, so its owner
    (torch's process context) still collects it."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except OSError:  # not our child, or already collected
        return None
    if info is None:
        return None
    return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status


class _RecordingAgent(LocalElasticAgent):
    """torch's local agent, which also keeps every failed worker's exit
    status and last completed step (``exits``) and records each failure in
    the run folder before it restarts the workers."""

    def __init__(self, spec: WorkerSpec, folder: RunFolder, no_restart_dir: str):
        super().__init__(spec, DefaultLogsSpecs(), start_method=worker_start_method())
        self.folder = folder
        self.no_restart_dir = no_restart_dir  # where workers say a restart would fail again
        self.exits: list[dict] = []  # the failure the last check saw
        self.progress: dict[int, int | None] = {}
        self.restarts_used = 0

    def _worker_processes(self) -> list | None:
        """torch's process objects of the running workers, by local rank
        (None when its process context is not the one this version of
        torch is known to keep)."""
        context = getattr(self._pcontext, "_pc", None)
        processes = getattr(context, "processes", None)
        return processes if isinstance(processes, list) else None

    def _ended(self, worker_group: WorkerGroup) -> dict[int, int]:
        """The non-zero exit status (minus the signal's number) of every
        worker that has ended, by global rank. Read from torch's process
        objects, which keep it for their owner (a forked worker is the
        server's child, not this process's); else peeked by pid."""
        processes = self._worker_processes()
        ended = {}
        for w in worker_group.workers:
            if processes is not None and w.local_rank < len(processes):
                code = processes[w.local_rank].exitcode
            else:
                code = _peek_exit(w.id) if isinstance(w.id, int) else None
            if code:
                ended[w.global_rank] = code
        return ended

    def _monitor_workers(self, worker_group: WorkerGroup):
        ended = self._ended(worker_group)
        result = super()._monitor_workers(worker_group)
        if result.state == WorkerState.FAILED:
            for rank, failure in result.failures.items():
                ended.setdefault(rank, failure.exitcode)
            for rank in _no_restart_ranks(self.no_restart_dir):  # even if it crashed on exit
                ended[rank] = EXIT_NO_RESTART
            self.progress = {
                w.global_rank: read_progress(self.folder, w.global_rank)
                for w in worker_group.workers
            }
            self.exits = [
                {"rank": r, "exitcode": c, "step": self.progress.get(r)}
                for r, c in sorted(ended.items())
            ]
        if EXIT_NO_RESTART in ended.values():  # the same failure again on a restart
            self._remaining_restarts = 0
        return result

    def _restart_workers(self, worker_group: WorkerGroup) -> None:
        if self.exits:  # a failure (not another node arriving or restarting)
            self.restarts_used += 1
            with contextlib.suppress(OSError):
                record_failure(self.folder, self.exits, self.progress, self.restarts_used)
            root = first_failure(self.exits)
            what = describe_exit(root["rank"], root["exitcode"], root["step"])
            if root["exitcode"] == EXIT_HANG:  # which rank hung: the diagnosis, not the exit
                what = f"the hang watchdog ended the run (exit status {EXIT_HANG})"
            print(
                f"dino-opt: {what}; restarting every worker (restart {self.restarts_used} of "
                f"{worker_group.spec.max_restarts}) from the newest complete checkpoint",
                file=sys.stderr,
                flush=True,
            )
            self.exits = []
        else:
            print(
                "dino-opt: another node is restarting; restarting this node's workers too",
                file=sys.stderr,
                flush=True,
            )
        super()._restart_workers(worker_group)


def _last_checkpoint(folder: RunFolder) -> str:
    records = CheckpointManager(folder.checkpoints).checkpoints()
    return f"step {records[-1].step} ({records[-1].path})" if records else "none"


def _failure(agent: _RecordingAgent, started: float) -> RuntimeError:
    """The one-line error of a job out of restarts."""
    spec = agent.get_worker_group().spec
    said = [e for e in agent.exits if e["exitcode"] == EXIT_NO_RESTART]  # bad input: the cause
    root = said[0] if said else first_failure(agent.exits) if agent.exits else None
    if root is None:
        what = "a worker failed"
    else:
        rank, code, step = root["rank"], root["exitcode"], root["step"]
        if code == EXIT_HANG:
            stuck = stuck_ranks(agent.folder, started)
            if stuck:
                rank, step = stuck[0], agent.progress.get(stuck[0], step)
        what = describe_exit(rank, code, step)
        if agent.get_worker_group().group_world_size > 1 and code > 0 and code != EXIT_HANG:
            what += " (a rank of another node may have failed first: see that node's line)"
    used = (
        f"{agent.restarts_used} of {spec.max_restarts} restarts used"
        if spec.max_restarts
        else "distributed.max_restarts=0"
    )
    message = f"{what} ({used}); last checkpoint: {_last_checkpoint(agent.folder)}"
    if root is not None and root["exitcode"] == EXIT_HANG:
        return TrainingHungError(f"{message}; the diagnosis is above and in {agent.folder.hang}")
    return WorkerFailedError(message)


def _method_name(depth: int = 2) -> str:
    """The name of the function ``depth`` frames up, as torch's
    ``dynamic_rendezvous.get_method_name`` gives it, without its
    ``inspect.stack()``, which reads the source of every frame on the stack
    at each rendezvous event (its cost: docs/testing.md)."""
    try:
        return sys._getframe(depth).f_code.co_name  # frame 0: this function's
    except ValueError:
        return "no_method_name"


@contextlib.contextmanager
def _rendezvous_event_names():
    """While a launch runs, from its rendezvous's creation to its shutdown:
    the rendezvous's events named by :func:`_method_name`."""
    named_by = getattr(dynamic_rendezvous, "get_method_name", None)
    if named_by is not None:
        dynamic_rendezvous.get_method_name = _method_name
    try:
        yield
    finally:
        if named_by is not None:
            dynamic_rendezvous.get_method_name = named_by


@contextlib.contextmanager
def _agent_settings(verbose: bool, no_restart_dir: str):
    """While the agent runs: torch's launcher logs at their level when
    verbose (else the launcher's own line says what failed), and a fresh
    store for the workers of each attempt. By default torch's c10d
    rendezvous shares one store with every attempt's workers, where the
    keys of the attempt before (a dead rank's address) are still found, so
    a restarted process group may connect to a process that is gone."""
    loggers = [
        logging.getLogger(name)
        for name in list(logging.root.manager.loggerDict)
        if name.startswith(_TORCH_LOGGERS)
    ]
    levels = [lg.level for lg in loggers]
    kept = {
        name: os.environ.get(name) for name in (_SHARED_STORE, "PYTHONWARNINGS", NO_RESTART_DIR)
    }
    os.environ[_SHARED_STORE] = "1"
    os.environ[NO_RESTART_DIR] = no_restart_dir
    # a killed worker's semaphores: its resource tracker would warn after the last line
    quiet_tracker = "ignore::UserWarning:multiprocessing.resource_tracker"
    os.environ["PYTHONWARNINGS"] = ",".join(w for w in (kept["PYTHONWARNINGS"], quiet_tracker) if w)
    if not verbose:
        for lg in loggers:
            lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)
        for name, value in kept.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@_rendezvous_event_names()
def run_agent(
    entry: Callable,
    args: tuple,
    *,
    folder: RunFolder,
    nproc: int,
    nnodes: int = 1,
    node_rank: int = 0,
    master_addr: str = "localhost",
    master_port: int = 0,
    max_restarts: int = 0,
    verbose: bool = False,
) -> dict[int, Any]:
    """Runs ``entry(*args)`` in ``nproc`` processes on this node, one node of
    ``nnodes`` that meet at ``master_addr:master_port`` (node 0 hosts the
    rendezvous; port 0 on one node: a free one). A failed worker restarts
    every worker of the job, at most ``max_restarts`` times (counted on the
    node where the failure happened); the failure is recorded in the run
    folder ``folder`` first. Returns this node's workers' return values by
    global rank; raises :class:`WorkerFailedError` (or
    :class:`~dino_opt.runtime.TrainingHungError`) with one line when out of
    restarts."""
    run_id = f"dino_opt-{master_port}" if nnodes > 1 else f"dino_opt-{uuid.uuid4().hex[:12]}"
    params = RendezvousParameters(
        backend="c10d",
        endpoint=f"{master_addr}:{master_port}",
        run_id=run_id,
        min_nodes=nnodes,
        max_nodes=nnodes,
        is_host=node_rank == 0,
    )
    spec = WorkerSpec(
        role="dino_opt",
        local_world_size=nproc,
        entrypoint=_in_launch_env,
        args=(),
        rdzv_handler=get_rendezvous_handler(params),
        max_restarts=max_restarts,
        monitor_interval=0.5,
    )
    said = tempfile.TemporaryDirectory(prefix="dino_opt-no-restart-")
    agent = _RecordingAgent(spec, folder, said.name)
    started = time.time()
    close_rendezvous = True
    try:
        with said, _agent_settings(verbose, said.name):
            start_worker_server()
            # this launch's environment and folder, as they are now, for every worker
            spec.args = (dict(os.environ), os.getcwd(), _LaunchStreams(), entry, *args)
            result = agent.run()
    except SignalException as e:
        close_rendezvous = False  # as torch's launcher: the others see this node go
        raise WorkerFailedError(
            f"the launcher got {e.sigval.name}: every worker was stopped (a worker stops at its "
            f"next logging step with a checkpoint when it has the time); last checkpoint: "
            f"{_last_checkpoint(folder)}",
            128 + e.sigval,
        ) from e
    except RendezvousError as e:
        raise WorkerFailedError(
            f"the job's nodes could not meet at {master_addr}:{master_port} (another node's "
            f"launcher ended, or none is there): {type(e).__name__}: {e}"
        ) from e
    finally:
        if close_rendezvous:
            spec.rdzv_handler.shutdown()
    if result is None:  # the rendezvous let this node out
        raise WorkerFailedError(
            f"this node was left out of the rendezvous at {master_addr}:{master_port}"
        )
    if result.is_failed():
        raise _failure(agent, started)
    return result.return_values
