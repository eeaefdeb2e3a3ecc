"""Events from workers to their agent: checkpoint saves and loads, for the metrics sinks,
and progress reports, for hang detection and the goodput account
(``rallypoint.worker.progress``).

The agent listens on a Unix datagram socket and names its path in
``RALLYPOINT_EVENTS_SOCKET``; a worker sends one JSON object per event. The socket lies in
a directory of its own that only the job's user may enter (0700): a process of another
user can neither send to it nor fill its queue (short: ``net.unix.max_dgram_qlen``), which
would make the workers' sends fail. Were it reached all the same, the agent drops what a
process of another user sends (the kernel's credentials of each datagram, Linux's
``SO_PASSCRED``). The agent removes the directory when it stops; its keeper does, if the
agent is killed (``rallypoint.agent.processes.keeper_server``).
Sending never blocks and never fails the worker: without an agent, events are dropped.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import shutil
import socket
import struct
import tempfile
import threading
from collections.abc import Callable
from typing import Any

from rallypoint import events
from rallypoint.worker import variables

ENV = variables.EVENTS_SOCKET
#: The events a worker may send; anything else is ignored by the agent.
WORKER_EVENTS = frozenset({events.CHECKPOINT_SAVED, events.CHECKPOINT_LOADED, events.PEER_REFUSED})
#: A worker's progress report: for the agent's hang detection and step account only, never an
#: event of the run.
PROGRESS = "progress"
#: A worker's messages about saves on notice (``rallypoint.worker.notice_watch``): for the agent
#: only, like progress reports.
NOTICE_WATCHING = "notice_watching"
NOTICE_HELD = "notice_held"
NOTICES = frozenset({NOTICE_WATCHING, NOTICE_HELD})
_MAX = 65536
_CREDENTIALS = struct.Struct("3i")  # struct ucred: pid, uid, gid
#: The socket's name in its directory.
SOCKET_NAME = "events"
#: The longest path a Unix socket may have: ``sun_path`` holds 108 bytes, with a NUL.
MAX_PATH = 107
#: Where the directory goes when ``TMPDIR`` would make the path too long.
FALLBACK_DIR = "/tmp"
#: How many datagrams the receiver still reads once closed: those sent before the end.
_DRAIN = 1024

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
        sock.sendto(message, address)


def socket_directory() -> str:
    """A new directory only this user may enter (``mkdtemp`` makes it 0700), in ``TMPDIR``,
    or in /tmp when ``TMPDIR`` is too deep for a socket's path."""
    for parent in (None, FALLBACK_DIR):
        path = tempfile.mkdtemp(prefix="rp-", dir=parent)
        if len(os.fsencode(os.path.join(path, SOCKET_NAME))) <= MAX_PATH:
            return path
        os.rmdir(path)
    raise OSError(f"no directory for the worker channel: {FALLBACK_DIR} is too deep")


class Receiver:
    """The agent's end: hands every valid worker event to ``deliver(name, data)``, every
    progress report to ``progress(data)`` and every notice message to ``notice(name, data)``
    when given (else they are dropped). Its thread ends with ``close``, and only then."""

    def __init__(
        self,
        deliver: Callable[[str, dict[str, Any]], object],
        progress: Callable[[dict[str, Any]], object] | None = None,
        notice: Callable[[str, dict[str, Any]], object] | None = None,
    ) -> None:
        self._deliver = deliver
        self._progress = progress
        self._notice = notice
        #: The directory that holds the socket: the agent's keeper removes it if the agent
        #: is killed.
        self.directory = socket_directory()
        self.address = os.path.join(self.directory, SOCKET_NAME)
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            # Another user cannot reach the socket (its directory); were it reached, the
            # kernel names each sender's user (SO_PASSCRED, Linux): only the job's count.
            self._credentials = hasattr(socket, "SO_PASSCRED")
            if self._credentials:
                self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
            self._socket.bind(self.address)
            self._socket.setblocking(False)
        except OSError:
            self._socket.close()
            shutil.rmtree(self.directory, ignore_errors=True)
            raise
        self._closing = threading.Event()
        self._wake_read, self._wake_write = socket.socketpair()
        self._thread = threading.Thread(
            target=self._receive, name="rallypoint-worker-events", daemon=True
        )
        self._thread.start()

    def _read(self) -> tuple[bytes, bool]:
        """The next datagram, and whether a process of this agent's user sent it;
        ``BlockingIOError`` when there is none."""
        if not self._credentials:
            return self._socket.recv(_MAX), True
        message, ancillary, _, _ = self._socket.recvmsg(_MAX, socket.CMSG_SPACE(_CREDENTIALS.size))
        for level, kind, data in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                _, uid, _ = _CREDENTIALS.unpack(data[: _CREDENTIALS.size])
                return message, uid == os.getuid()
        return message, False

    def _receive(self) -> None:
        poller = select.poll()
        poller.register(self._socket, select.POLLIN)
        poller.register(self._wake_read, select.POLLIN)
        failed = False
        while not self._closing.is_set():
            poller.poll()  # woken by a datagram, or by close
            # What was sent before close is still handed on, up to a bound.
            for _ in range(_DRAIN):
                try:
                    message, ours = self._read()
                except BlockingIOError:
                    break
                except OSError as error:
                    if self._closing.is_set():
                        return  # closed under it (a slow handler outlived close's wait)
                    if not failed:  # never an end: only close ends the thread
                        logger.warning("reading the workers' events failed: %s", error)
                    failed = True
                    self._closing.wait(0.1)  # no busy loop on an error that stays
                    break
                if ours:  # before anything else: another user's datagram is never looked at
                    self._handle(message)

    def _handle(self, message: bytes) -> None:
        try:
            data = json.loads(message)
            name = data.pop("event")
        except (ValueError, KeyError, TypeError, AttributeError):
            return  # an empty datagram among them
        if name == PROGRESS and self._progress is not None:
            try:
                self._progress(data)
            except Exception:  # a malformed report must not end the receiver
                logger.exception("a worker's progress report could not be handled")
        elif name in NOTICES and self._notice is not None:
            try:
                self._notice(name, data)
            except Exception:  # nor a malformed notice message
                logger.exception("a worker's notice message could not be handled")
        elif name in WORKER_EVENTS:
            try:
                self._deliver(name, data)
            except Exception:  # a sink's problem must not end the receiver
                logger.exception("delivering worker event %s failed", name)

    def close(self) -> None:
        """End the thread (once it handed on what was sent before), then remove the socket
        and its directory."""
        if self._closing.is_set():
            return
        self._closing.set()
        with contextlib.suppress(OSError):
            self._wake_write.send(b"\0")
        self._thread.join(2)
        self._socket.close()
        self._wake_read.close()
        self._wake_write.close()
        shutil.rmtree(self.directory, ignore_errors=True)
