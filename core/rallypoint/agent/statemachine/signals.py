"""The signals the agent handles (``--signals-to-handle``), and how they reach its waits.

The first signal is the one the agent acts on: it forwards it to the workers and exits with
128 + N. It wakes any wait through a socket pair (``fileno``); a rendezvous wait, which can
be long and has no workers to stop, it interrupts outright (``interruptible``).
"""

from __future__ import annotations

import contextlib
import select
import signal
import socket
import time
from collections.abc import Callable, Iterable
from types import FrameType
from typing import Any, TypeVar

T = TypeVar("T")


class Interrupted(BaseException):
    """Raised by the signal handler, in the main thread, to leave a rendezvous wait (a
    BaseException, like KeyboardInterrupt, so that no ``except Exception`` of a store
    swallows it)."""


class SignalWatch:
    """The signal this agent received, if any, and the wake-up of its waits."""

    def __init__(self) -> None:
        self.signalled: signal.Signals | None = None
        self._interruptible = False  # in a rendezvous wait: a signal raises Interrupted
        self._previous: dict[signal.Signals, Any] = {}
        self._wake_read, self._wake_write = socket.socketpair()
        self._wake_read.setblocking(False)
        self._wake_write.setblocking(False)

    def install(self, names: Iterable[str]) -> None:
        """Handle the signals ``names`` (``SIGTERM``...) until ``close``."""
        for name in names:
            sig = signal.Signals[name]
            try:
                self._previous[sig] = signal.signal(sig, self._on_signal)
            except (OSError, ValueError):  # not in the main thread, or not catchable
                continue

    def close(self) -> None:
        """Put back the handlers ``install`` replaced; close the wake-up pair."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        self._wake_read.close()
        self._wake_write.close()

    def exit(self) -> tuple[int, str]:
        """The agent's exit code and reason for the signal it received."""
        assert self.signalled is not None
        return 128 + int(self.signalled), f"stopped by {self.signalled.name}"

    def fileno(self) -> int:
        """Readable once a signal arrived: for a wait to wake on (``drain`` it after)."""
        return self._wake_read.fileno()

    def drain(self) -> None:
        try:
            while self._wake_read.recv(64):
                pass
        except (BlockingIOError, OSError):
            pass

    def sleep(self, seconds: float) -> bool:
        """Sleep, waking early on a signal; return whether a signal arrived (before or during)."""
        deadline = time.monotonic() + seconds
        while self.signalled is None and time.monotonic() < deadline:
            select.select([self._wake_read], [], [], max(0.0, deadline - time.monotonic()))
            self.drain()
        return self.signalled is not None

    def interruptible(self, wait: Callable[[], T]) -> T | None:
        """``wait()``, which a signal interrupts; None when a signal came before or during it."""
        try:
            try:
                self._interruptible = self.signalled is None
                return wait() if self._interruptible else None
            finally:
                self._interruptible = False
        except Interrupted:
            return None

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.signalled is None:
            self.signalled = signal.Signals(signum)
        with contextlib.suppress(OSError):
            self._wake_write.send(b"\0")
        if self._interruptible:
            self._interruptible = False  # once: the way out (leaving the store) runs on
            raise Interrupted()
