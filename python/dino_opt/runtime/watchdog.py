"""Hang detection: a rank that makes no progress ends the job, saying where.

A collective that one rank never joins blocks every other rank until the
process group's timeout (30 minutes by default, hours in some set-ups).
:class:`HangWatchdog` runs a thread beside the training loop. The loop
reports each completed step (:meth:`HangWatchdog.progress`) and names the
collective it waits in (:meth:`HangWatchdog.phase`); the thread publishes
that, with a heartbeat counter, to a small key-value store shared by the
ranks (a ``torch.distributed.TCPStore`` of its own, hosted by rank 0, apart
from the process group's, so it works while the group is stuck). When its
own rank has made no progress for ``timeout_s``, it reads every rank's
beacon, tells the stuck ranks from the waiting ones
(:func:`describe_hang`), calls ``on_hang(message, stuck)`` (the training job
finishes the checkpoint write in flight there and writes ``hang.json``),
prints the message and ends the process with :data:`EXIT_HANG`, which the
launcher (torchrun) passes on. Every rank's watchdog comes to the same
diagnosis, so every rank exits.

Alone (``store=None``) the watchdog still ends a process stuck for
``timeout_s`` (a loader or a device that stopped), naming rank 0.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

__all__ = [
    "EXIT_HANG",
    "HangWatchdog",
    "TrainingHungError",
    "describe_hang",
    "host_store",
    "join_store",
]

# The exit status of a process the watchdog ends (EX_TEMPFAIL: try again,
# which for a training run means: resume it).
EXIT_HANG = 75

_COLLECTIVE = "collective: "


class TrainingHungError(RuntimeError):
    """Raised by a launcher whose processes were ended by the hang watchdog
    (exit status :data:`EXIT_HANG`); the watchdog's diagnosis is on stderr
    and in the run folder's ``hang.json``."""


def host_store(timeout_s: float = 60.0) -> dist.TCPStore:
    """Rank 0's heartbeat store, on a free port (``store.port``) of every interface."""
    return dist.TCPStore(
        "0.0.0.0", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s)
    )


def join_store(host: str, port: int, timeout_s: float = 60.0) -> dist.TCPStore:
    """Another rank's connection to the heartbeat store of rank 0 at ``host:port``."""
    return dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout_s))


def _key(rank: int) -> str:
    return f"dino_opt/heartbeat/{rank}"


def describe_hang(me: int, stalled_s: float, beacons: dict[int, dict | None]) -> tuple[list, str]:
    """Which ranks are stuck, and the message saying so.

    ``beacons``: every rank's last beacon (``step``: last completed step,
    ``phase``: what it is doing, ``stalled_s``: seconds without progress,
    ``alive``: whether its heartbeat moved while we looked), None for a rank
    that never published one. The stuck ranks are those not responding;
    else, when some ranks wait in a collective, those that are not in it;
    else those furthest behind; else (all alike) every rank.
    """
    silent = [r for r, b in beacons.items() if b is None or not b.get("alive", True)]
    live = {r: b for r, b in beacons.items() if r not in silent}
    waiting = [r for r, b in live.items() if str(b["phase"]).startswith(_COLLECTIVE)]
    if silent:
        stuck = silent
    elif waiting and len(waiting) < len(live):
        stuck = [r for r in live if r not in waiting]
    elif live and len({b["step"] for b in live.values()}) > 1:
        low = min(b["step"] for b in live.values())
        stuck = [r for r, b in live.items() if b["step"] == low]
    else:
        stuck = sorted(live)

    def line(r: int) -> str:
        b = beacons[r]
        if b is None:
            return f"rank {r}: never reported (did it start?)"
        state = "no heartbeat (process dead, frozen or unreachable); " if r in silent else ""
        return (
            f"rank {r}: {state}last completed step {b['step']}, then {b['phase']!r}, "
            f"no progress for {b['stalled_s']:.0f} s"
        )

    names = ", ".join(f"rank {r}" for r in stuck) or "none found"
    lines = [f"training hung: rank {me} made no progress for {stalled_s:.0f} s; stuck: {names}"]
    lines += [f"  {line(r)}" for r in sorted(beacons)]
    return stuck, "\n".join(lines)


class HangWatchdog:
    """Ends the process when its rank makes no progress for ``timeout_s``.

    ``store``: the shared heartbeat store (:func:`host_store` /
    :func:`join_store`), None alone. ``on_hang(message, stuck_ranks)`` runs in the
    watchdog's thread before the exit (its return value, a string, is added
    to the message). ``exit`` is called with :data:`EXIT_HANG` (``os._exit``:
    the main thread is stuck and cannot unwind). It watches only while armed
    (:meth:`arm`; not during start-up, e.g. compilation, or evaluation).
    """

    def __init__(
        self,
        timeout_s: float,
        *,
        rank: int = 0,
        world_size: int = 1,
        store: dist.Store | None = None,
        on_hang: Callable[[str, list[int]], str | None] | None = None,
        exit: Callable[[int], None] = os._exit,
        interval_s: float | None = None,
    ):
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        self.timeout_s = float(timeout_s)
        self.rank, self.world_size = int(rank), int(world_size)
        self.store = store
        self.on_hang = on_hang
        self._exit = exit
        self.interval_s = interval_s or min(max(self.timeout_s / 10, 0.2), 10.0)
        self._step = 0
        self._phase = "starting"
        self._last_progress = time.monotonic()
        self._beats = 0
        self._armed = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.fired_message: str | None = None

    # ------------------------------------------------------------ the loop's side

    def progress(self, step: int) -> None:
        """Step ``step`` is complete (cheap: no I/O in the caller's thread)."""
        self._step = int(step)
        self._phase = f"training step {step + 1}"
        self._last_progress = time.monotonic()

    @contextlib.contextmanager
    def phase(self, name: str):
        """Marks the caller as waiting in the collective ``name`` meanwhile."""
        previous, self._phase = self._phase, _COLLECTIVE + name
        try:
            yield
        finally:
            self._phase = previous
            self._last_progress = time.monotonic()

    def arm(self) -> None:
        self._last_progress = time.monotonic()
        self._armed = True

    def disarm(self) -> None:
        self._armed = False

    def start(self) -> HangWatchdog:
        self._publish(0.0)
        self._thread = threading.Thread(target=self._run, name="dino_opt-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * self.interval_s + 5)

    def __enter__(self) -> HangWatchdog:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------ the thread

    def _beacon(self, stalled: float) -> dict:
        return {
            "step": self._step,
            "phase": self._phase,
            "stalled_s": stalled,
            "beats": self._beats,
        }

    def _publish(self, stalled: float) -> None:
        self._beats += 1
        if self.store is not None:
            with contextlib.suppress(Exception):  # rank 0 gone: our own clock still counts
                self.store.set(_key(self.rank), json.dumps(self._beacon(stalled)))

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            stalled = time.monotonic() - self._last_progress if self._armed else 0.0
            self._publish(stalled)
            if self._armed and stalled > self.timeout_s:
                self._fire(stalled)
                return

    def _read(self) -> dict[int, dict | None]:
        if self.store is None:
            return {self.rank: self._beacon(time.monotonic() - self._last_progress)}
        out: dict[int, dict | None] = {}
        for r in range(self.world_size):
            try:
                found = self.store.check([_key(r)])
                out[r] = json.loads(self.store.get(_key(r))) if found else None
            except Exception:  # the store itself is gone (rank 0 died)
                out[r] = None
        return out

    def _heartbeats(self) -> dict[int, dict | None]:
        """Every rank's beacon, each other rank's marked ``alive`` when its
        heartbeat moved while we looked. We look until every other rank's has
        moved, or for ``timeout_s`` at most: a live rank's heartbeat comes late
        on a machine busy enough to starve its thread, a dead, frozen or
        unreachable rank's never does. This rank's own is its state here."""
        first = self._read()
        deadline = time.monotonic() + max(2 * self.interval_s, self.timeout_s)
        while True:
            time.sleep(self.interval_s)
            self._publish(time.monotonic() - self._last_progress)
            beacons = self._read()
            moved = {
                r: b is not None
                and (first.get(r) is None or first[r].get("beats") != b.get("beats"))
                for r, b in beacons.items()
                if r != self.rank
            }
            if all(moved.values()) or time.monotonic() >= deadline:
                break
        for r, alive in moved.items():
            if beacons[r] is not None:
                beacons[r]["alive"] = alive
        beacons[self.rank] = self._beacon(time.monotonic() - self._last_progress)
        return beacons

    def _fire(self, stalled: float) -> None:
        stuck, message = describe_hang(self.rank, stalled, self._heartbeats())
        if self.on_hang is not None:
            try:
                extra = self.on_hang(message, stuck)
            except Exception as e:  # the exit must happen regardless
                extra = f"(while finishing up: {type(e).__name__}: {e})"
            if extra:
                message = f"{message}\n{extra}"
        self.fired_message = message
        print(f"dino-opt: {message}", file=sys.stderr, flush=True)
        self._exit(EXIT_HANG)
