"""Processes of the tests, as ``python -m dino_opt.cli ARGS`` or ``python
SCRIPT ARGS`` would run them, but forked from a server that imported torch
and the package once per test worker (the launcher's own workers' server,
with the CLI preloaded too): a test that starts, kills and restarts runs, or
starts the ranks of a gloo group, pays no import of torch each time (~7 s on
two busy cores). The child gets its environment, working folder and thread
count explicitly, as the launcher's workers do (the server's are those of
whoever started it), and writes its output and error to files, read back as
text."""

import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import time
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


def _child(run, argv: list[str], env: dict, cwd: str, out: str, err: str, new_session: bool,
           before) -> None:  # fmt: skip
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
        texts = tuple(p.read_text(errors="replace") if p.exists() else "" for p in (
            self._out, self._err))  # fmt: skip
        self._files.cleanup()
        return texts


class CliProcess(Forked):
    """``dino-opt ARGV``. ``env``: its environment (this process's by
    default); ``new_session``: a process group of its own; ``before``: a
    module-level function the child calls first (to patch something in it)."""

    def __init__(self, argv: list[str], env: dict | None = None, new_session: bool = False,
                 before=None):  # fmt: skip
        self.args = ["dino-opt", *argv]
        super().__init__(_cli, argv, env, new_session, before)


class ScriptProcess(Forked):
    """``python SCRIPT ARGS`` (run as ``__main__``), with ``env`` as
    :class:`CliProcess`."""

    def __init__(self, script: Path, args: list[str], env: dict | None = None):
        self.args = [str(script), *args]
        super().__init__(_script, self.args, env, False, None)


def run_cli(argv: list[str], env: dict | None = None, timeout: float = 600) -> (
        subprocess.CompletedProcess):  # fmt: skip
    """``dino-opt ARGV`` to its end: its exit status, output and error."""
    p = CliProcess(argv, env)
    stdout, stderr = p.communicate(timeout)
    return subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr)


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
