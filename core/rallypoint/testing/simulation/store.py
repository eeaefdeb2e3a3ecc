"""The coordination store on simulated time: one server, the network to it, and each
backend's liveness.

A node's connection (``Connection``) is a ``CoordinationStore``: each call blocks the
calling simulated thread, travels to the server (latency, a slow spell), is applied there
or refused (an outage, a partition that cuts the node off, a store that is gone), and its
reply travels back, or is lost after the write was applied. Waits are held by the server
until a write of one of their keys, or their timeout.

Liveness is each backend's own, with its expiry on the simulated clock:

* ``c10d``: torch's TCPStore, hosted by one agent (node 0's): liveness from counters
  (the real ``CounterLiveness``); the store ends with its host, and a host that comes
  back hosts an empty one (the data loss a c10d job meets);
* ``redis``: a key with a TTL of ``min(ttl, key_ttl)``, deleted when its connection closes;
* ``etcd``: a lease of whole seconds (``lease_seconds``), revoked when its connection closes.
"""

from __future__ import annotations

import contextlib
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from rallypoint.interfaces import StoreError, StoreUnavailable
from rallypoint.rendezvous.liveness import CounterLiveness
from rallypoint.rendezvous.memory_store import MemoryStore
from rallypoint.testing.simulation.hub import Hub, Killed
from rallypoint.testing.simulation.world import NodeWorld, SimThread

#: Calls that change the store: a lost reply to one of them leaves the change made.
WRITES = frozenset({"set", "add", "add_and_get", "compare_set", "delete_prefix"})
WAITS = frozenset({"wait", "wait_value"})
BACKENDS = ("c10d", "redis", "etcd")


@dataclass
class Network:
    """The faults between the nodes and the store, drawn with the schedule."""

    latency: float  # the longest latency, each way
    lose: float  # the chance that a write's reply is lost
    outage: tuple[float, float] | None  # the store unreachable from, until
    slow: tuple[float, float, float] | None  # from, until: each way takes this long
    cuts: list[tuple[int, float, float]]  # node, from, until: cut off from the store
    loss: tuple[float, float] | None  # the store restarts empty: down from, until


@dataclass(eq=False)  # one wait is itself only: found by identity in the lists of its keys
class _Wait:
    conn: Connection
    thread: SimThread
    ticket: int
    method: str
    args: tuple[Any, ...]


class Server:
    """The store's server: its data (a ``MemoryStore`` on the hub's clock), the waits it
    holds, and the network's faults."""

    def __init__(
        self,
        hub: Hub,
        rng: random.Random,
        network: Network,
        backend: str,
        log: Callable[[str], None],
        tracing: bool = False,
    ) -> None:
        self.hub = hub
        self.tracing = tracing
        self.rng = rng
        self.network = network
        self.backend = backend
        self.log = log
        self.data = MemoryStore(clock=lambda: hub.now)
        self._waits: dict[str, list[_Wait]] = {}
        self.dirty = True  # a write since the simulation last looked
        self.host: NodeWorld | None = None  # c10d: the agent whose process holds the store
        self.gone = False  # c10d: its host died; nothing answers until another hosts it
        self.leases: dict[str, float] = {}  # etcd: lease -> when it expires
        self.epoch = 0  # how many times it lost its data
        self.spells: list[tuple[float, float | None]] = []  # c10d: no host, from, until

    # --- what the network and the server do -----------------------------------------------

    def delay(self) -> float:
        network, now = self.network, self.hub.now
        seconds = self.rng.uniform(0, network.latency) if network.latency else 0.0
        if network.slow is not None and network.slow[0] <= now < network.slow[1]:
            seconds += network.slow[2]
        return seconds

    def unreachable(self, world: NodeWorld, index: int) -> str | None:
        """Why a call from node ``index`` finds no store now, if it does not."""
        network, now = self.network, self.hub.now
        if self.backend == "c10d" and (self.host is None or self.gone):
            return "connection refused (no agent hosts the store)"
        if network.outage is not None and network.outage[0] <= now < network.outage[1]:
            return "simulated outage"
        if network.loss is not None and network.loss[0] <= now < network.loss[1]:
            return "the store is restarting"
        for node, begin, end in network.cuts:
            if node == index and begin <= now < end:
                return "cut off from the store"
        return None

    def reset(self, error: StoreUnavailable, index: int | None = None) -> None:
        """Connections reset (every node's, or node ``index``'s): the waits they held fail."""
        waits = {id(w): w for ws in self._waits.values() for w in ws}
        for wait in waits.values():
            if index is None or wait.conn.index == index:
                self._drop(wait, _keys(wait))
                self._reply(wait.conn, wait.thread, wait.ticket, None, error)

    def lose_data(self) -> None:
        """Every key gone at once (a store restarted without its data)."""
        self.log("the store lost every key")
        self.reset(StoreUnavailable("the store restarted"))
        self.data = MemoryStore(clock=lambda: self.hub.now)
        self.leases.clear()
        self.epoch += 1
        self.dirty = True

    def host_died(self) -> None:
        """c10d: the store was in its host's process."""
        if not self.gone:
            self.spells.append((self.hub.now, None))
        self.gone = True
        self.lose_data()

    def hosted_by(self, world: NodeWorld) -> None:
        """c10d: an agent on the store's host started one (empty, if its last host died)."""
        if self.host is None or self.gone:
            if self.spells and self.spells[-1][1] is None:
                self.spells[-1] = (self.spells[-1][0], self.hub.now)
            self.host, self.gone = world, False

    # --- a call's trip ------------------------------------------------------------------------

    def request(self, conn: Connection, method: str, args: tuple[Any, ...]) -> Any:
        """In the caller's thread: send the call, block until its reply; the reply."""
        if conn.process.dead:
            raise Killed
        thread = self.hub.current()
        ticket = thread.ticket
        self.hub.at(
            self.hub.now + self.delay(), lambda: self._receive(conn, method, args, thread, ticket)
        )
        return thread.block()

    def _reply(
        self,
        conn: Connection,
        thread: SimThread,
        ticket: int,
        value: Any,
        error: BaseException | None = None,
    ) -> None:
        self.hub.at(
            self.hub.now + self.delay(), lambda: conn.process.wake(thread, ticket, value, error)
        )

    def _receive(
        self, conn: Connection, method: str, args: tuple[Any, ...], thread: SimThread, ticket: int
    ) -> None:
        why = self.unreachable(conn.process, conn.index)
        if why is not None:
            self._reply(conn, thread, ticket, None, StoreUnavailable(why))
            return
        if method in WAITS:
            self._wait(_Wait(conn, thread, ticket, method, args))
            return
        own = getattr(self, "_" + method, None)
        try:
            value = own(*args) if own is not None else getattr(self.data, method)(*args)
        except ValueError:  # an add to a key that holds no number: the server refuses
            self._reply(conn, thread, ticket, None, StoreError(f"{args[0]!r} holds no number"))
            return
        if self.tracing:  # formatting every call costs a tenth of a large run
            self.log(f"{conn.name} {method}{_short(args)} -> {_short(value)}")
        if method in WRITES:
            self.dirty = True
            if method != "delete_prefix":
                self._written(args[0])
            if self.network.lose and self.rng.random() < self.network.lose:
                self.log(f"{conn.name}: reply lost")
                self._reply(conn, thread, ticket, None, StoreUnavailable("simulated lost reply"))
                return
        self._reply(conn, thread, ticket, value)

    # --- waits ---------------------------------------------------------------------------

    def _found(self, wait: _Wait) -> tuple[bool, Any]:
        if wait.method == "wait":
            keys = wait.args[0]
            return all(v is not None for v in self.data.get_many(keys)), True
        value = self.data.get(wait.args[0])
        return value is not None, value

    def _wait(self, wait: _Wait) -> None:
        done, value = self._found(wait)
        if done:
            self._reply(wait.conn, wait.thread, wait.ticket, value)
            return
        keys = _keys(wait)
        for key in keys:
            self._waits.setdefault(key, []).append(wait)
        # The wait's timeout is the client's: on its process's clock.
        timeout = wait.conn.process.seconds(float(wait.args[-1]))
        self.hub.at(self.hub.now + timeout, lambda: self._timed_out(wait, keys))

    def _timed_out(self, wait: _Wait, keys: Sequence[str]) -> None:
        if self._drop(wait, keys):
            self._reply(
                wait.conn, wait.thread, wait.ticket, False if wait.method == "wait" else None
            )

    def _drop(self, wait: _Wait, keys: Sequence[str]) -> bool:
        """Take ``wait`` out of the waits; whether it was still held."""
        held = False
        for key in keys:
            waits = self._waits.get(key)
            if waits is not None and wait in waits:
                waits.remove(wait)
                held = True
                if not waits:
                    del self._waits[key]
        return held

    def _written(self, key: str) -> None:
        for wait in list(self._waits.get(key, ())):
            done, value = self._found(wait)
            if done:
                self._drop(wait, _keys(wait))
                self._reply(wait.conn, wait.thread, wait.ticket, value)

    # --- liveness by expiry (Redis, etcd), on the server's clock --------------------------------

    def _keep_alive(self, key: str, seconds: float) -> None:
        if self.backend == "etcd":
            self.leases[key] = self.hub.now + seconds
        else:
            self.data.keep_alive(key, seconds)

    def _alive(self, key: str, _ttl: float) -> bool:
        if self.backend == "etcd":
            return self.leases.get(key, -math.inf) >= self.hub.now
        return self.data.alive(key, _ttl)

    def _expire(self, keys: Sequence[str]) -> None:
        """A connection closed: its keys deleted (Redis), its leases revoked (etcd)."""
        for key in keys:
            self.leases.pop(key, None)
        self.data.expire(keys)

    def kept_keys(self) -> list[str]:
        """The keys the store keeps for good (values and counters): what a clean finish
        must have deleted. Expiring keys and leases go by themselves."""
        return self.data.stored_keys()


class Connection:
    """One connection of a node's process to the store: a ``CoordinationStore``. Its
    liveness is by the server's expiry (Redis's TTL keys, etcd's leases): ended when the
    connection closes (``RedisStore.close``, ``EtcdStore.close``)."""

    def __init__(self, server: Server, process: NodeWorld, index: int, name: str) -> None:
        self.server = server
        self.process = process
        self.index = index
        self.name = name
        self._kept: set[str] = set()

    def _call(self, method: str, *args: Any) -> Any:
        return self.server.request(self, method, args)

    def get(self, key: str) -> bytes | None:
        return self._call("get", key)  # type: ignore[no-any-return]

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        return self._call("get_many", list(keys))  # type: ignore[no-any-return]

    def set(self, key: str, value: bytes) -> None:
        self._call("set", key, value)

    def add(self, key: str, amount: int) -> int:
        return self._call("add", key, amount)  # type: ignore[no-any-return]

    def add_and_get(self, key: str, amount: int, other: str) -> tuple[int, bytes | None]:
        return self._call("add_and_get", key, amount, other)  # type: ignore[no-any-return]

    def compare_set(self, key: str, expected: bytes | None, desired: bytes) -> bytes:
        return self._call("compare_set", key, expected, desired)  # type: ignore[no-any-return]

    def wait(self, keys: Sequence[str], timeout: float) -> bool:
        return self._call("wait", list(keys), timeout)  # type: ignore[no-any-return]

    def wait_value(self, key: str, timeout: float) -> bytes | None:
        return self._call("wait_value", key, timeout)  # type: ignore[no-any-return]

    def delete_prefix(self, prefix: str) -> int:
        return self._call("delete_prefix", prefix)  # type: ignore[no-any-return]

    def lifetime(self, ttl: float) -> float:
        if self.server.backend == "etcd":
            return max(1, math.ceil(ttl))  # EtcdStore.lease_seconds: whole seconds
        return ttl  # RedisStore: min(ttl, key_ttl), key_ttl unset

    def keep_alive(self, key: str, ttl: float) -> None:
        self._call("keep_alive", key, self.lifetime(ttl))
        self._kept.add(key)

    def alive(self, key: str, ttl: float) -> bool:
        return self._call("alive", key, ttl)  # type: ignore[no-any-return]

    def clone(self) -> Connection:
        return type(self)(self.server, self.process, self.index, self.name)

    def close(self) -> None:
        kept, self._kept = sorted(self._kept), set()
        if kept:
            with contextlib.suppress(StoreUnavailable):  # they lapse by themselves
                self._call("expire", kept)


class CounterConnection(CounterLiveness, Connection):
    """TCPStore's: liveness from counters, observed on the process's clock, as
    ``rendezvous.tcpstore.TCPStoreClient`` has it."""

    add = Connection.add  # CounterLiveness only declares it

    def __init__(self, server: Server, process: NodeWorld, index: int, name: str) -> None:
        Connection.__init__(self, server, process, index, name)
        CounterLiveness.__init__(self)
        self.world = process  # CounterLiveness's clock
        self._closed = False

    def clone(self) -> CounterConnection:
        clone = CounterConnection(self.server, self.process, self.index, self.name)
        self._share_liveness(clone)
        clone.trust_drops = self.trust_drops
        return clone

    def close(self) -> None:
        if not self._closed:
            self.end_liveness()
        self._closed = True


def connect(server: Server, process: NodeWorld, index: int, name: str) -> Connection:
    """A new connection of ``process``, with its backend's liveness."""
    kind = CounterConnection if server.backend == "c10d" else Connection
    return kind(server, process, index, name)


def _keys(wait: _Wait) -> list[str]:
    return list(wait.args[0]) if wait.method == "wait" else [wait.args[0]]


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) < 120 else text[:117] + "..."
