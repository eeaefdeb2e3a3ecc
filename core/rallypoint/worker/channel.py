"""Events from workers to their agent: checkpoint saves and loads, for the metrics sinks,
and heartbeats, for the watchdog (``rallypoint.worker.progress``).

The agent listens on a Unix datagram socket in the abstract namespace (nothing on disk)
and names it in ``RALLYPOINT_EVENTS_SOCKET``; a worker sends one JSON object per event.
Such a socket has no file mode, so the agent drops what a process of another user sends
(the kernel's credentials of each datagram, Linux's ``SO_PASSCRED``).
Sending never blocks and never fails the worker: without an agent, events are dropped.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import struct
import threading
import uuid
from collections.abc import Callable
from typing import Any

from rallypoint import events
from rallypoint.worker import variables

ENV = variables.EVENTS_SOCKET
#: The events a worker may send; anything else is ignored by the agent.
WORKER_EVENTS = frozenset({events.CHECKPOINT_SAVED, events.CHECKPOINT_LOADED})
#: A worker's sign of progress: for the agent's watchdog only, never an event of the run.
HEARTBEAT = "heartbeat"
#: A worker's messages about saves on notice (``rallypoint.worker.notice``): for the agent
#: only, like heartbeats.
NOTICE_WATCHING = "notice_watching"
NOTICE_HELD = "notice_held"
NOTICES = frozenset({NOTICE_WATCHING, NOTICE_HELD})
_MAX = 65536
_CREDENTIALS = struct.Struct("3i")  # struct ucred: pid, uid, gid

logger = logging.getLogger(__name__)


def send(name: str, **data: Any) -> None:
    """Tell this worker's agent that ``name`` happened (no-op outside ``rallypoint run``)."""
    address = os.environ.get(ENV)
    if not address:
        return
    # RALLYPOINT_LOCAL_RANK: the real one, also under --virtual-local-rank (LOCAL_RANK 0).
    local_rank = variables.env_int(variables.NODE_LOCAL_RANK)
    if local_rank is None:
        local_rank = variables.env_int(variables.LOCAL_RANK)
    payload = {"event": name, "rank": variables.env_int(variables.RANK), "local_rank": local_rank}
    message = json.dumps({**payload, **data}, default=str).encode()
    with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.setblocking(False)
        sock.sendto(message, "\0" + address)


class Receiver:
    """The agent's end: hands every valid worker event to ``deliver(name, data)``, every
    heartbeat to ``heartbeat(data)`` and every notice message to ``notice(name, data)``
    when given (else they are dropped)."""

    def __init__(
        self,
        deliver: Callable[[str, dict[str, Any]], object],
        heartbeat: Callable[[dict[str, Any]], object] | None = None,
        notice: Callable[[str, dict[str, Any]], object] | None = None,
    ) -> None:
        self.address = f"rallypoint-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self._deliver = deliver
        self._heartbeat = heartbeat
        self._notice = notice
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        # An abstract socket has no file mode: any process of the host may send to it.
        # The kernel names each sender's user (SO_PASSCRED, Linux): only the job's count.
        self._credentials = hasattr(socket, "SO_PASSCRED")
        if self._credentials:
            self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self._socket.bind("\0" + self.address)
        self._thread = threading.Thread(target=self._receive, daemon=True)
        self._thread.start()

    def _read(self) -> tuple[bytes, bool]:
        """The next datagram, and whether a process of this agent's user sent it."""
        if not self._credentials:
            return self._socket.recv(_MAX), True
        message, ancillary, _, _ = self._socket.recvmsg(_MAX, socket.CMSG_SPACE(_CREDENTIALS.size))
        for level, kind, data in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                _, uid, _ = _CREDENTIALS.unpack(data[: _CREDENTIALS.size])
                return message, uid == os.getuid()
        return message, False

    def _receive(self) -> None:
        while True:
            try:
                message, ours = self._read()
            except OSError:
                return  # closed
            if not message:
                return
            if not ours:
                continue  # another user's process: never an event of this job
            try:
                data = json.loads(message)
                name = data.pop("event")
            except (ValueError, KeyError, TypeError, AttributeError):
                continue
            if name == HEARTBEAT and self._heartbeat is not None:
                try:
                    self._heartbeat(data)
                except Exception:  # a malformed heartbeat must not end the receiver
                    logger.exception("a worker heartbeat could not be handled")
            elif name in NOTICES and self._notice is not None:
                self._notice(name, data)
            elif name in WORKER_EVENTS:
                try:
                    self._deliver(name, data)
                except Exception:  # a sink's problem must not end the receiver
                    logger.exception("delivering worker event %s failed", name)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._socket.shutdown(socket.SHUT_RDWR)
        # recv on a datagram socket is not woken by shutdown everywhere: send an empty one.
        with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.sendto(b"", "\0" + self.address)
        self._thread.join(2)
        self._socket.close()
