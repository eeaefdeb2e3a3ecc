"""The server of the checkpoint transfers between agents: what a node serves its peers, and
what it keeps of theirs (the wire: ``rallypoint.agent.checkpoints.peer_wire``).

Before a request is verified, a connection costs the server little: one thread waits on
all of them (``selectors``), each gets ``HANDSHAKE`` seconds in all to send its request,
at most ``most_pending`` wait at once (the oldest goes when a new one comes: a real
client answers within milliseconds), and its request is read only up to ``SMALL``
bytes. Verified requests are served by ``POOL`` threads, each read or write bounded by
``TIMEOUT``.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import functools
import hashlib
import logging
import queue
import resource
import secrets
import selectors
import socket
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, BinaryIO, cast

from rallypoint.agent.checkpoints import peer_wire as wire
from rallypoint.agent.processes import framing
from rallypoint.checkpoint import manifest as mf
from rallypoint.checkpoint.tier import Held, Tier
from rallypoint.interfaces import CheckpointError

logger = logging.getLogger("rallypoint.agent")

#: Seconds a connection has, from its accept, to send a whole request.
HANDSHAKE = 10.0
#: Threads that serve verified requests, and how many such requests may wait for one.
POOL = 4
QUEUED = 16
#: The most connections waiting to send their request, if the file limit allows.
MOST_PENDING = 1024
#: The soft limit of open files the server raises the process's to, if the hard allows.
FILE_LIMIT = 65536

#: Finds the copy of ``(step, rank, sharded)`` a node holds, held while in use.
Find = Callable[[int, int, bool], AbstractContextManager[Held]]


@functools.cache
def _file_limit() -> int:
    """The soft limit of open files, raised once towards the hard one (``FILE_LIMIT`` at
    most), so that the connections waiting for their request fit beside everything else."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = FILE_LIMIT if hard == resource.RLIM_INFINITY else min(hard, FILE_LIMIT)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            soft = wanted
    return FILE_LIMIT if soft == resource.RLIM_INFINITY else soft


@dataclass(eq=False)
class _Pending:
    """A connection that has not sent its whole request yet."""

    sock: socket.socket
    peer: str
    deadline: float
    nonce: str
    out: bytes  # what is still to wire.send of the hello
    data: bytearray = field(default_factory=bytearray)
    size: int | None = None  # the request's length, once its header is read


@dataclass
class _Session:
    """A wire.verified request, being served by a thread of the pool."""

    reader: BinaryIO
    writer: BinaryIO
    peer: str
    key: bytes | None
    nonces: tuple[str, str]  # the server's, the client's
    request: dict[str, Any]

    def answer(self, message: dict[str, Any], purpose: str = "answer") -> None:
        wire.send(self.writer, wire.signed(self.key, purpose, self.nonces[::-1], message))
        self.writer.flush()


class PeerServer:
    """Serves the copies ``find`` finds (the node's own memory copies and the peers' it
    holds), and keeps what peers wire.send in ``inbox(rank, sharded)``. Listens on ``host``, a
    free port. ``refused(peer, reason)`` is called for every transfer it refuses."""

    def __init__(
        self,
        host: str,
        find: Find,
        inbox: Callable[[int, bool], Tier],
        token: bytes | None = None,
        refused: Callable[[str, str], object] = lambda peer, why: None,
    ) -> None:
        self.find = find
        self.inbox = inbox
        self.key = wire.key_of(token)
        self.refused = refused
        self._lock = threading.Lock()  # one copy written into the inbox at a time
        # A quarter of the descriptors for waiting connections: the job needs the rest.
        self.most_pending = max(16, min(MOST_PENDING, _file_limit() // 4))
        self._pending: collections.OrderedDict[_Pending, None] = collections.OrderedDict()
        self._queue: queue.Queue[tuple[socket.socket, _Session] | None] = queue.Queue(QUEUED)
        self._closing = threading.Event()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._listener.bind((host, 0))
            self._listener.listen(socket.SOMAXCONN)
            self._listener.setblocking(False)
        except OSError:
            self._listener.close()
            raise
        self.port = int(self._listener.getsockname()[1])
        self.address = f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"
        self._wake_read, self._wake_write = socket.socketpair()
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, "listener")
        self._selector.register(self._wake_read, selectors.EVENT_READ, "wake")
        self._thread = threading.Thread(target=self._loop, name="rallypoint-peers", daemon=True)
        self._thread.start()
        for number in range(POOL):
            threading.Thread(
                target=self._work, name=f"rallypoint-peers-{number}", daemon=True
            ).start()

    def close(self) -> None:
        """Stop listening and drop the connections not being served; a transfer under way
        ends with its connection's next timeout or the process."""
        self._closing.set()
        with contextlib.suppress(OSError):
            self._wake_write.send(b"\0")
        self._thread.join(5.0)  # the loop ends at the wake; a bound all the same
        with contextlib.suppress(queue.Empty):
            while (job := self._queue.get_nowait()) is not None:
                sock, session = job
                for closing in (session.reader, session.writer, sock):
                    closing.close()
        for _ in range(POOL):
            with contextlib.suppress(queue.Full):
                self._queue.put_nowait(None)

    # --- waiting for requests, one thread -------------------------------------------------

    def _loop(self) -> None:
        try:
            while not self._closing.is_set():
                oldest = next(iter(self._pending), None)
                timeout = None if oldest is None else max(0.0, oldest.deadline - time.monotonic())
                for selected, mask in self._selector.select(timeout):
                    if selected.data == "listener":
                        self._accept()
                    elif selected.data in self._pending:  # not dropped by this batch
                        try:
                            self._step(selected.data, mask)
                        except Exception:  # a bug: the loop must stay, for the next peers
                            logger.exception("a checkpoint transfer's request failed")
                            self._drop(selected.data)
                now = time.monotonic()
                while self._pending and next(iter(self._pending)).deadline <= now:
                    self._drop(next(iter(self._pending)))  # a whole request takes no 10 s
        finally:
            for pending in list(self._pending):
                self._drop(pending)
            self._selector.close()
            self._listener.close()
            self._wake_read.close()
            self._wake_write.close()

    def _accept(self) -> None:
        for _ in range(256):  # then the waiting ones get their turn
            try:
                sock, address = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as error:  # out of descriptors: make room, or wait for some
                if error.errno not in (errno.EMFILE, errno.ENFILE):
                    return
                if not self._pending:  # all the job's own
                    self._closing.wait(0.05)
                    return
                self._drop(next(iter(self._pending)))
                continue
            if len(self._pending) >= self.most_pending:
                self._drop(next(iter(self._pending)))
            sock.setblocking(False)
            nonce = secrets.token_hex(16)
            hello = {"nonce": nonce, "token": self.key is not None, "version": wire.VERSION}
            out = wire.encoded(hello)
            with contextlib.suppress(BlockingIOError):
                out = out[sock.send(out) :]  # a new socket's buffer takes it, nearly always
            pending = _Pending(sock, str(address[0]), time.monotonic() + HANDSHAKE, nonce, out)
            self._pending[pending] = None
            events = selectors.EVENT_READ | (selectors.EVENT_WRITE if out else 0)
            self._selector.register(sock, events, pending)

    def _drop(self, pending: _Pending) -> None:
        self._pending.pop(pending, None)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(pending.sock)
        pending.sock.close()

    def _step(self, pending: _Pending, mask: int) -> None:
        """Send what is left of the hello, read what came of the request."""
        try:
            if mask & selectors.EVENT_WRITE and pending.out:
                pending.out = pending.out[pending.sock.send(pending.out) :]
                if not pending.out:
                    self._selector.modify(pending.sock, selectors.EVENT_READ, pending)
            if not mask & selectors.EVENT_READ:
                return
            if pending.size is None:
                want = framing.HEADER.size - len(pending.data)
            else:
                want = pending.size - len(pending.data)
            chunk = pending.sock.recv(want) if want else b""
            if want and not chunk:  # the peer closed it
                self._drop(pending)
                return
        except BlockingIOError:
            return
        except OSError:
            self._drop(pending)
            return
        pending.data += chunk
        if pending.size is None and len(pending.data) == framing.HEADER.size:
            try:
                pending.size = framing.length(pending.data, wire.SMALL, "a request")
            except framing.Oversize as error:
                self._refuse(pending, str(error))
                return
            pending.data = bytearray()
        if pending.size is not None and len(pending.data) == pending.size:
            self._requested(pending)

    def _requested(self, pending: _Pending) -> None:
        """The whole request is in: verify it, and hand it to the pool."""
        try:
            request = wire.parse(bytes(pending.data), "request")
        except wire.Refused as error:
            self._refuse(pending, error.reason)
            return
        theirs = request.get("nonce")
        if not isinstance(theirs, str) or not wire.NONCE.fullmatch(theirs):
            self._refuse(pending, "a malformed request (no nonce)")
            return
        proved = "proof" in request
        if not wire.verified(self.key, "request", (pending.nonce, theirs), request):
            why = "a wrong job token" if proved else "no job token"
            self._refuse(pending, why, "refused: this job's token is required")
            return
        problem = wire.request_problem(request)
        if problem is not None:
            self._refuse(pending, f"a malformed request ({problem})")
            return
        self._pending.pop(pending, None)
        self._selector.unregister(pending.sock)
        sock = pending.sock
        sock.settimeout(wire.TIMEOUT)
        reader, writer = cast(BinaryIO, sock.makefile("rb")), cast(BinaryIO, sock.makefile("wb"))
        session = _Session(reader, writer, pending.peer, self.key, (pending.nonce, theirs), request)
        try:
            self._queue.put_nowait((sock, session))
        except queue.Full:  # a flood of wire.verified requests (no token): this one waits not
            self._answer_now(sock, {"ok": False, "reason": "busy with other transfers"})
            for closing in (reader, writer, sock):
                closing.close()

    def _refuse(self, pending: _Pending, reason: str, answer: str | None = None) -> None:
        self._tell(pending.peer, reason)
        self._answer_now(
            pending.sock, {"ok": False, "reason": answer or f"refused: it gave {reason}"}
        )
        self._drop(pending)

    def _tell(self, peer: str, reason: str) -> None:
        try:
            self.refused(peer, reason)
        except Exception:  # the owner's: serving goes on
            logger.exception("reporting a refused checkpoint transfer failed")

    @staticmethod
    def _answer_now(sock: socket.socket, message: dict[str, Any]) -> None:
        """Send a short answer without waiting: the socket's buffer holds it, or it is lost
        with a peer that sends but does not read."""
        with contextlib.suppress(OSError):
            blocking = sock.gettimeout()
            sock.setblocking(False)
            sock.send(wire.encoded(message))
            sock.settimeout(blocking)

    # --- serving wire.verified requests, the pool ----------------------------------------------

    def _work(self) -> None:
        while (job := self._queue.get()) is not None:
            sock, session = job
            try:
                with sock, session.reader, session.writer:
                    if session.request["op"] == "put":
                        self._put(session)
                    else:
                        self._get(session)
            except (OSError, ValueError, CheckpointError, mf.Damaged) as error:
                # The peer went away or stopped in the middle; or a copy went while it was
                # sent (its client sees the transfer cut short).
                logger.debug("a checkpoint transfer with %s ended: %s", session.peer, error)
            except Exception:  # a bug: the thread must stay, for the next transfers
                logger.exception("serving a checkpoint transfer to %s failed", session.peer)

    def _put(self, session: _Session) -> None:
        request = session.request
        if not self._lock.acquire(timeout=wire.TIMEOUT):
            session.answer({"ok": False, "reason": "busy receiving another checkpoint"})
            return
        try:
            session.answer({"ok": True}, "ready")
            inbox = self.inbox(request["rank"], request["sharded"])
            mac = wire.files_mac(self.key, session.nonces)
            wire.receive_checkpoint(session.reader, request["manifest_sha256"], inbox, mac)
        except wire.Refused as error:
            self._tell(session.peer, error.reason)
            session.answer({"ok": False, "reason": str(error)})
            return
        except (CheckpointError, mf.Damaged) as error:  # damaged or cut: the one before stays
            session.answer({"ok": False, "reason": str(error)})
            return
        finally:
            self._lock.release()
        session.answer({"ok": True})

    def _get(self, session: _Session) -> None:
        request = session.request
        step, rank, sharded = request["step"], request["rank"], request["sharded"]
        with contextlib.ExitStack() as stack:
            try:
                held = stack.enter_context(self.find(step, rank, sharded))
            except mf.Damaged:
                session.answer({"ok": False, "reason": f"no complete copy of step {step} here"})
                return
            text = held.manifest.encode()
            session.answer({"ok": True, "manifest_sha256": hashlib.sha256(text).hexdigest()})
            mac = wire.files_mac(self.key, session.nonces)
            wire.send_checkpoint(session.writer, held, text, mac)
