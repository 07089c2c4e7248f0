"""Processes of the tests, as ``python -m dino_opt.cli ARGS`` or ``python
SCRIPT ARGS`` would run them, but forked from a server that imported torch
and the package once per test worker (the launcher's own workers' server,
with the CLI preloaded too): a test that starts, kills and restarts runs, or
starts the ranks of a gloo group, pays no import of torch each time (~7 s on
two busy cores). The child gets its environment, working folder and thread
count explicitly, as the launcher's workers do (the server's are those of
whoever started it), and writes its output and error to files, read back as
text.

A launch of ranks (``dino-opt train --nproc N``) that is let run to its end
(:func:`run_cli`) runs its launcher in this process instead: only its ranks
need processes of their own, and they fork from this process's server, which
is already running, rather than from a server the launcher would start and
fill with imports again (~4-6 s a launch). A launch that a test kills or
signals is a :class:`CliProcess`."""

import contextlib
import faulthandler
import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from dino_opt.cli import main
from dino_opt.distributed.agent import WORKER_PRELOAD, enter_launch_env, start_worker_server

_CONTEXT = multiprocessing.get_context("forkserver")


def _cli(argv: list[str]) -> None:
    sys.argv = ["dino-opt", *argv]
    sys.exit(main(argv))


def _script(argv: list[str]) -> None:
    sys.argv = list(argv)
    runpy.run_path(argv[0], run_name="__main__")


def _child(
    run, argv: list[str], env: dict, cwd: str, out: str, err: str, new_session: bool, before
) -> None:
    if new_session:  # a process group of its own: killpg ends it with its ranks
        os.setsid()
    for fd, path in ((1, out), (2, err)):
        new = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(new, fd)
        os.close(new)
    enter_launch_env(env, cwd)
    if before is not None:
        before()
    run(argv)


class Forked:
    """A process started now; the parts of :class:`subprocess.Popen` the
    tests use (``args``, ``pid``, ``returncode``, ``poll``, ``wait``,
    ``send_signal``, ``kill``, ``communicate``). Use :class:`CliProcess` or
    :class:`ScriptProcess`."""

    def __init__(self, run, argv: list[str], env: dict | None, new_session: bool, before):
        self._files = tempfile.TemporaryDirectory(prefix="dino_opt-forked-")
        self._out = Path(self._files.name, "stdout")
        self._err = Path(self._files.name, "stderr")
        start_worker_server((*WORKER_PRELOAD, "dino_opt.cli"))
        env = dict(os.environ if env is None else env)
        files = (str(self._out), str(self._err))
        args = (run, list(argv), env, os.getcwd(), *files, new_session, before)
        self._process = _CONTEXT.Process(target=_child, args=args)
        self._process.start()
        self.pid = self._process.pid
        self.returncode = None

    def poll(self) -> int | None:
        self.returncode = self._process.exitcode
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Waits for the end (killed after ``timeout`` seconds, then an
        error); its output and error as text."""
        try:
            self.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            self.wait(60)
            raise
        texts = tuple(
            p.read_text(errors="replace") if p.exists() else "" for p in (self._out, self._err)
        )
        self._files.cleanup()
        return texts


class CliProcess(Forked):
    """``dino-opt ARGV``. ``env``: its environment (this process's by
    default); ``new_session``: a process group of its own; ``before``: a
    module-level function the child calls first (to patch something in it)."""

    def __init__(
        self, argv: list[str], env: dict | None = None, new_session: bool = False, before=None
    ):
        self.args = ["dino-opt", *argv]
        super().__init__(_cli, argv, env, new_session, before)


class ScriptProcess(Forked):
    """``python SCRIPT ARGS`` (run as ``__main__``), with ``env`` as
    :class:`CliProcess`."""

    def __init__(self, script: Path, args: list[str], env: dict | None = None):
        self.args = [str(script), *args]
        super().__init__(_script, self.args, env, False, None)


def _completed(p: Forked, timeout: float) -> subprocess.CompletedProcess:
    """``p`` waited for: its arguments, exit status, output and error."""
    stdout, stderr = p.communicate(timeout)
    return subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr)


def run_script(
    script: Path, args: list[str], env: dict | None = None, timeout: float = 600
) -> subprocess.CompletedProcess:
    """``python SCRIPT ARGS`` to its end (:class:`ScriptProcess`): its exit
    status, output and error."""
    return _completed(ScriptProcess(script, args, env), timeout)


def run_cli(
    argv: list[str], env: dict | None = None, timeout: float = 600
) -> subprocess.CompletedProcess:
    """``dino-opt ARGV`` to its end: its exit status, output and error. A
    launch of rank processes runs its launcher here (:func:`run_launcher`)."""
    if _starts_ranks(argv):
        return run_launcher(argv, env, timeout)
    return _completed(CliProcess(argv, env), timeout)


def _starts_ranks(argv: list[str]) -> bool:
    """Whether ``dino-opt ARGV`` launches rank processes (``--nproc N``, N > 1,
    or ``--nnodes``); ``--nproc 1`` trains in the launcher's own process."""
    ranks = argv[argv.index("--nproc") + 1] if "--nproc" in argv[:-1] else "1"
    return ranks != "1" or "--nnodes" in argv


def run_launcher(
    argv: list[str], env: dict | None = None, timeout: float = 600
) -> subprocess.CompletedProcess:
    """``dino-opt ARGV`` (a launch of ranks) in this process, as its own
    process would run it: under the environment ``env``, its output and error
    written to files (file descriptors 1 and 2, which the ranks inherit, and
    ``sys.stdout``/``sys.stderr``), an uncaught error printed as a traceback
    with status 1. Past ``timeout`` seconds this whole process ends with every
    thread's traceback (a hang fails the test worker, never blocks it)."""
    start_worker_server((*WORKER_PRELOAD, "dino_opt.cli"))
    with tempfile.TemporaryDirectory(prefix="dino_opt-launcher-") as folder:
        out, err = Path(folder, "stdout"), Path(folder, "stderr")
        with _environment(os.environ if env is None else env), _output_to(out, err):
            faulthandler.dump_traceback_later(timeout, exit=True)
            try:
                code = _exit_status(argv)
            finally:
                faulthandler.cancel_dump_traceback_later()
        texts = [p.read_text(errors="replace") for p in (out, err)]
    return subprocess.CompletedProcess(["dino-opt", *argv], code, *texts)


def _exit_status(argv: list[str]) -> int:
    """What ``sys.exit(main(argv))`` would end a process with."""
    try:
        return main(argv)
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except Exception:
        traceback.print_exc()
        return 1


@contextlib.contextmanager
def _environment(env: dict):
    """``os.environ`` is ``env`` inside."""
    kept = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(kept)


@contextlib.contextmanager
def _output_to(out: Path, err: Path):
    """File descriptors 1 and 2, ``sys.stdout`` and ``sys.stderr`` write to
    the files ``out`` and ``err`` inside."""
    streams = (sys.stdout, sys.stderr)
    for stream in streams:
        stream.flush()
    saved = [os.dup(1), os.dup(2)]
    try:
        for fd, path in ((1, out), (2, err)):
            new = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(new, fd)
            os.close(new)
        sys.stdout, sys.stderr = (open(fd, "w", buffering=1, closefd=False) for fd in (1, 2))
        yield
    finally:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        sys.stdout, sys.stderr = streams
        for fd, old in zip((1, 2), saved, strict=True):
            os.dup2(old, fd)
            os.close(old)


def wait_for(predicate, process: Forked, timeout: float = 240.0, poll_s: float = 0.005) -> bool:
    """Waits until ``predicate()`` holds (True) or ``process`` ends (False);
    an error after ``timeout`` seconds without either."""
    deadline = time.monotonic() + timeout
    while process.poll() is None:
        if predicate():
            return True
        if time.monotonic() > deadline:
            raise TimeoutError(f"{process.args[:3]} made no progress in {timeout:.0f} s")
        time.sleep(poll_s)
    return False
