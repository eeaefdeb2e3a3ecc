"""A simulated process's world (``rallypoint.rendezvous.world.World``): its clocks, its
pauses, its wake-ups and threads, its host's ports, on the hub's simulated time."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import greenlet

from rallypoint.testing.simulation.hub import Hub, Killed

#: The wall clock's reading at simulated time 0 (any fixed instant: a run replays).
EPOCH = 1_800_000_000.0


class Ports:
    """Every host's bound ports: a port one process holds, no other can have."""

    def __init__(self) -> None:
        self.held: dict[str, dict[int, NodeWorld]] = {}
        self._next: dict[str, int] = {}

    def reserve(self, world: NodeWorld, port: int) -> HeldPort:
        held = self.held.setdefault(world.host, {})
        if not port:
            port = self._next.get(world.host, 29500)
            while port in held:
                port += 1
            self._next[world.host] = port + 1
        elif port in held:
            raise OSError(98, "Address already in use")
        held[port] = world
        return HeldPort(port, world.host, self)

    def holder(self, host: str, port: int) -> NodeWorld | None:
        return self.held.get(host, {}).get(port)

    def release_all(self, world: NodeWorld) -> None:
        """Its process died: the kernel closes its sockets."""
        held = self.held.get(world.host, {})
        for port in [port for port, holder in held.items() if holder is world]:
            del held[port]


class HeldPort:
    """A port held as ``PortReservation`` holds one: until ``release``, or its process dies."""

    def __init__(self, port: int, host: str, ports: Ports) -> None:
        self.port, self.host, self._ports = port, host, ports

    def release(self) -> None:
        self._ports.held.get(self.host, {}).pop(self.port, None)


class NodeWorld:
    """One agent process: its clock runs at ``rate`` (skew) from its birth, its wall clock
    may step (``step``), and it may be frozen (SIGSTOP) until ``frozen_until``: its threads
    wake only then, while its clocks run on, as CLOCK_MONOTONIC does."""

    def __init__(self, hub: Hub, ports: Ports, host: str, rate: float = 1.0) -> None:
        self.hub = hub
        self.ports = ports
        self.host = host
        self.rate = rate
        self.born = hub.now
        self.frozen_until = 0.0
        self.wall_offset = 0.0  # the steps of its wall clock, in seconds
        self.threads: list[SimThread] = []
        self.dead = False

    # --- World ----------------------------------------------------------------------------

    def monotonic(self) -> float:
        return self.born + (self.hub.now - self.born) * self.rate

    def time_ns(self) -> int:
        return int((EPOCH + self.monotonic() + self.wall_offset) * 1e9)

    def sleep(self, seconds: float) -> None:
        thread = self.hub.current()
        self.after(max(0.0, seconds), thread, thread.ticket)
        thread.block()

    def flag(self) -> SimFlag:
        return SimFlag(self)

    def start(self, target: Callable[[], None], name: str) -> SimThread:
        thread = SimThread(self, target, name)
        self.threads.append(thread)
        if self.dead:
            thread.kill()
        else:
            self.hub.at(self.hub.now, lambda: self.wake(thread, thread.ticket))
        return thread

    def reserve_port(self, port: int) -> Any:
        return self.ports.reserve(self, port)

    # --- the hub's side ---------------------------------------------------------------------

    def seconds(self, own: float) -> float:
        """``own`` seconds of this process's clock, in simulated seconds."""
        return own / self.rate

    def after(self, own: float, thread: SimThread, ticket: int, value: Any = None) -> None:
        """Wake ``thread`` for ``ticket`` after ``own`` seconds of this process's clock."""
        self.hub.at(self.hub.now + self.seconds(own), lambda: self.wake(thread, ticket, value))

    def wake(
        self, thread: SimThread, ticket: int, value: Any = None, error: BaseException | None = None
    ) -> None:
        """A thread of this process is woken: it runs once the process is not frozen."""
        if self.dead:
            return
        if self.hub.now < self.frozen_until:
            self.hub.at(self.frozen_until, lambda: self.wake(thread, ticket, value, error))
            return
        thread.wake(ticket, value, error)

    def interrupt(self, thread: SimThread, error: BaseException) -> None:
        """A signal: ``error`` raised where ``thread`` blocks, once the process runs."""
        self.wake(thread, thread.ticket, None, error)

    def kill(self) -> None:
        """SIGKILL: every thread unwinds where it blocked, and its ports are free."""
        self.dead = True
        for thread in self.threads:
            thread.kill()
        self.ports.release_all(self)


class SimFlag:
    """``threading.Event`` in a simulated process."""

    def __init__(self, world: NodeWorld) -> None:
        self.world = world
        self._set = False
        self._waiting: list[tuple[SimThread, int]] = []

    def set(self) -> None:
        self._set = True
        waiting, self._waiting = self._waiting, []
        for thread, ticket in waiting:
            self.world.hub.at(self.world.hub.now, partial(self.world.wake, thread, ticket, True))

    def clear(self) -> None:
        self._set = False

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout: float | None = None) -> bool:
        if self._set:
            return True
        thread = self.world.hub.current()
        entry = (thread, thread.ticket)
        self._waiting.append(entry)
        if timeout is not None:
            self.world.after(max(0.0, timeout), thread, thread.ticket, False)
        try:
            return bool(thread.block())
        finally:
            if entry in self._waiting:
                self._waiting.remove(entry)


class SimThread:
    """A thread of a simulated process: a greenlet that runs only when the hub resumes
    it (``resume``), and switches back where it blocks (``block``)."""

    def __init__(self, world: NodeWorld, target: Callable[[], None], name: str) -> None:
        self.world = world
        self.hub = world.hub
        self.name = name
        self._target = target
        self.ticket = 0  # which wake-up it waits for: a later one makes an earlier stale
        self.blocked = True
        self.killed = False
        self.done = False
        self.joiners: list[tuple[SimThread, int]] = []
        self._greenlet = greenlet.greenlet(self._main, parent=self.hub.greenlet)

    def _main(self, *_: Any) -> None:  # the first switch's value: nothing
        try:
            if not self.killed:
                self._target()
        except Killed:
            pass
        finally:
            self.done = True
            for joiner, ticket in self.joiners:
                self.hub.at(self.hub.now, partial(joiner.world.wake, joiner, ticket))
            self.joiners.clear()

    # --- in the hub ---------------------------------------------------------------------

    def resume(self, value: Any = None, error: BaseException | None = None) -> None:
        """Run it until it blocks again or ends; what escapes it (a broken invariant)
        is raised here."""
        if self.done:
            return
        self.blocked = False
        self.hub.running = self
        try:
            if error is not None:
                self._greenlet.throw(error)
            else:
                self._greenlet.switch(value)
        finally:
            self.hub.running = None

    def wake(self, ticket: int, value: Any = None, error: BaseException | None = None) -> None:
        """The wake-up ``ticket`` came: resume it, unless it no longer waits for that one."""
        if self.blocked and not self.done and ticket == self.ticket:
            self.ticket += 1
            self.resume(value, error)

    def kill(self) -> None:
        """Its process died: it unwinds from where it blocked, and is gone."""
        self.killed = True
        if not self.done:
            self.ticket += 1
            if self._greenlet:  # started: unwind it from where it blocked
                self.resume(error=Killed())
            else:
                self.done = True

    # --- in itself ----------------------------------------------------------------------

    def block(self) -> Any:
        """Switch back to the hub until woken; what it was woken with (or its error)."""
        if self.killed:
            raise Killed
        self.blocked = True
        return self.hub.greenlet.switch()

    def join(self, timeout: float | None = None) -> None:
        """``Thread.join``, from another simulated thread."""
        if self.done:
            return
        me = self.hub.current()
        self.joiners.append((me, me.ticket))
        if timeout is not None:
            me.world.after(timeout, me, me.ticket)
        me.block()

    def is_alive(self) -> bool:
        return not self.done
