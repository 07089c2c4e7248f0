"""The signals that ask a run to stop (SIGTERM, SIGINT, SIGUSR1), turned into a
flag the training loop polls: :class:`GracefulStop`."""

from __future__ import annotations

import signal
import threading
import warnings
from collections.abc import Iterable
from typing import Any

__all__ = ["GracefulStop"]


# ---------------------------------------------------------------- signals


def _default_signals() -> tuple[signal.Signals, ...]:
    names = ("SIGTERM", "SIGINT", "SIGUSR1")  # SIGUSR1 does not exist on Windows
    return tuple(getattr(signal, n) for n in names if hasattr(signal, n))


class GracefulStop:
    """Turns termination signals into a flag the training loop polls::

        with GracefulStop() as stop:
            for step in ...:
                train_step()
                if stop.requested:
                    manager.save(state, epoch=epoch, step=step)
                    break

    While active, the handlers of ``signals`` only set :attr:`requested` and
    remember the first signal (:attr:`signal_name`); the step in flight
    finishes, so the checkpoint is consistent. A second SIGINT after a stop
    was requested raises KeyboardInterrupt, so Ctrl-C twice still force-quits.
    On exit the previous handlers are restored.

    Python runs signal handlers only in the main thread and only lets the
    main thread install them, so entered from another thread it is a no-op
    (``active`` is False, a RuntimeWarning says so) whose flag never
    triggers: the main thread keeps its own handlers.
    """

    def __init__(self, signals: Iterable[int] | None = None):
        sigs = _default_signals() if signals is None else tuple(signals)
        self.signals = tuple(signal.Signals(s) for s in sigs)
        self._previous: dict[signal.Signals, Any] = {}
        self._requested = False
        self._signal: signal.Signals | None = None
        self._active = False

    @property
    def requested(self) -> bool:
        """Whether one of the signals arrived while active."""
        return self._requested

    @property
    def signal_name(self) -> str | None:
        """Name of the first signal received (e.g. ``"SIGTERM"``), or None."""
        return self._signal.name if self._signal is not None else None

    @property
    def active(self) -> bool:
        """Whether the handlers are installed (False off the main thread)."""
        return self._active

    def _handle(self, signum, frame) -> None:
        if self._requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        if not self._requested:
            self._signal = signal.Signals(signum)
            self._requested = True

    def __enter__(self) -> GracefulStop:
        if self._active:
            raise RuntimeError("GracefulStop is already active")
        if threading.current_thread() is not threading.main_thread():
            warnings.warn(
                "GracefulStop entered outside the main thread: signal handlers can only be "
                "installed there, so this one will never trigger",
                RuntimeWarning,
                stacklevel=2,
            )
            return self
        self._previous = {}
        try:
            for s in self.signals:
                self._previous[s] = signal.getsignal(s)
                signal.signal(s, self._handle)
        except BaseException:
            self._restore()
            raise
        self._active = True
        return self

    def _restore(self) -> None:
        for s, prev in self._previous.items():
            # None: the old handler was not installed from Python; the default
            # is the closest thing we can put back.
            signal.signal(s, prev if prev is not None else signal.SIG_DFL)
        self._previous = {}

    def __exit__(self, *exc) -> None:
        if self._active:
            self._restore()
            self._active = False
