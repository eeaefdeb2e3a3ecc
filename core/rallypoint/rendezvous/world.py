"""What the rendezvous handler takes from the machine it runs on: clocks, pauses, threads,
wake-ups and ports.

``REAL`` is this process's own (``time``, ``threading``, a bound socket for a port). The
deterministic simulation (``rallypoint.testing.simulation``) gives every simulated node a
world of its own on one simulated clock (rate, steps and freezes of its own), so that the
handler that ships (``protocol.StoreRendezvous`` over ``RetryingStore``, ``SignedStore``
and the backend's liveness) runs there unchanged, one thread at a time, replayable from a
seed. Nothing of the protocol reads ``time`` or starts a ``threading.Thread`` but through
a ``World``: that is what lets the simulation drive it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Protocol

from rallypoint.rendezvous.ports import PortReservation


class Flag(Protocol):
    """The part of ``threading.Event`` the handler uses: a wake-up one thread gives another."""

    def set(self) -> None: ...

    def clear(self) -> None: ...

    def is_set(self) -> bool: ...

    def wait(self, timeout: float | None = None) -> bool: ...


class Strand(Protocol):
    """A thread the handler started (its heartbeat)."""

    def join(self, timeout: float | None = None) -> None: ...

    def is_alive(self) -> bool: ...


class Port(Protocol):
    """A port held on this host until ``release`` (``ports.PortReservation``)."""

    port: int

    def release(self) -> None: ...


class World(Protocol):
    def monotonic(self) -> float:
        """Seconds on a clock that never steps (``time.monotonic``): every timeout."""
        ...

    def time_ns(self) -> int:
        """The wall clock (``time.time_ns``), which may step: only liveness marks use it."""
        ...

    def sleep(self, seconds: float) -> None: ...

    def flag(self) -> Flag: ...

    def start(self, target: Callable[[], None], name: str) -> Strand:
        """Run ``target`` in a daemon thread of its own."""
        ...

    def reserve_port(self, port: int) -> Port:
        """Hold ``port`` (0: a free one) on this host; ``OSError`` if it is taken."""
        ...


class _Real:
    """This process's world."""

    monotonic = staticmethod(time.monotonic)
    time_ns = staticmethod(time.time_ns)
    sleep = staticmethod(time.sleep)

    def flag(self) -> Flag:
        return threading.Event()

    def start(self, target: Callable[[], None], name: str) -> Strand:
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        return thread

    def reserve_port(self, port: int) -> Port:
        return PortReservation(port)


REAL: World = _Real()
