"""The protocol's store calls as values: its steps make no store call, an executor does.

Every part of the rendezvous protocol (joining, the heartbeat, run generations) is written
as a generator that yields a ``Call`` for each store operation or wait and is sent back
the result (or has the store's error thrown into it). ``drive`` performs them on a
``CoordinationStore``, pausing through a ``World`` (``rendezvous.world``): the one executor,
in a process and in the deterministic simulation (``rallypoint.testing.simulation``), whose
nodes run the handler that ships, driven by it, on a simulated store and clock.

The steps do two things besides their calls, both given to them from outside: the joining
reserves a master port (``Joining(reserve_port=...)``: the world's, a socket bound on this
host) and asks the rank assigner for the round's ranks (a plugin's function of the
joiners' records, called where the leader forms the round).
What the handler does around the steps (its token claim, the heartbeat's first renewal,
leaving) calls the store directly (``rendezvous.protocol``, each said there).

Why generators rather than one ``decide(snapshot) -> action`` function, as torch's
``dynamic_rendezvous`` does: the protocol is a sequence of waits on single keys, and a
snapshot of everything it might need would cost O(N) reads per node per decision where it
now costs O(1).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from typing import Any, NamedTuple, TypeVar

from rallypoint.interfaces import CoordinationStore
from rallypoint.rendezvous.world import REAL, Flag, World

T = TypeVar("T")


class Call(NamedTuple):
    """One store operation (a ``CoordinationStore`` method and its arguments), or
    ``pause``: wait ``args[0]`` seconds, or until the node's wake-up. A named tuple: a
    thousand nodes make one for every store call."""

    method: str
    args: tuple[Any, ...]


#: A protocol step: yields calls, receives their results, returns ``T``.
Steps = Generator[Call, Any, T]


def get(key: str) -> Steps[bytes | None]:
    return (yield Call("get", (key,)))  # type: ignore[no-any-return]


def get_many(keys: Sequence[str]) -> Steps[list[bytes | None]]:
    if not keys:
        return []
    return (yield Call("get_many", (list(keys),)))  # type: ignore[no-any-return]


def set_(key: str, value: bytes) -> Steps[None]:
    yield Call("set", (key, value))


def add(key: str, amount: int) -> Steps[int]:
    return (yield Call("add", (key, amount)))  # type: ignore[no-any-return]


def add_and_get(key: str, amount: int, other: str) -> Steps[tuple[int, bytes | None]]:
    return (yield Call("add_and_get", (key, amount, other)))  # type: ignore[no-any-return]


def compare_set(key: str, expected: bytes | None, desired: bytes) -> Steps[bytes]:
    return (yield Call("compare_set", (key, expected, desired)))  # type: ignore[no-any-return]


def wait(keys: Sequence[str], timeout: float) -> Steps[bool]:
    return (yield Call("wait", (list(keys), max(0.0, timeout))))  # type: ignore[no-any-return]


def wait_value(key: str, timeout: float) -> Steps[bytes | None]:
    return (yield Call("wait_value", (key, max(0.0, timeout))))  # type: ignore[no-any-return]


def keep_alive(key: str, ttl: float) -> Steps[None]:
    yield Call("keep_alive", (key, ttl))


def alive(key: str, ttl: float) -> Steps[bool]:
    return (yield Call("alive", (key, ttl)))  # type: ignore[no-any-return]


def delete_prefix(prefix: str) -> Steps[int]:
    return (yield Call("delete_prefix", (prefix,)))  # type: ignore[no-any-return]


def pause(seconds: float) -> Steps[None]:
    """Wait ``seconds``, or less if the node is woken (the heartbeat, when joining ends)."""
    yield Call("pause", (max(0.0, seconds),))


def drive(
    steps: Steps[T], store: CoordinationStore, wake: Flag | None = None, world: World = REAL
) -> T:
    """Run ``steps`` against ``store``, in this thread; its return value. The one
    executor of the protocol's calls: in a process, and in the simulation (its ``world``).

    ``pause`` waits on ``wake`` (then clears it), or sleeps when there is none.
    """
    perform = _performer(store, wake or world.flag())
    result: Any = None
    error: BaseException | None = None
    while True:
        try:
            call = steps.send(result) if error is None else steps.throw(error)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        result, error = None, None
        try:
            result = perform(call)
        except Exception as raised:
            error = raised


def _performer(store: CoordinationStore, pausing: Flag) -> Callable[[Call], Any]:

    def perform(call: Call) -> Any:
        if call.method == "pause":
            pausing.wait(call.args[0])
            pausing.clear()
            return None
        return getattr(store, call.method)(*call.args)

    return perform
