"""Memory checkpoints between agents: each agent serves the copies it holds, and sends its
newest to the next node of the round, so that the loss of a node loses no checkpoint.

One TCP connection per request. A request is a 4-byte big-endian length and a JSON
object; ``put`` is followed by the checkpoint's files, in its manifest's order, and
answered ``{"ok": true}`` once they are written and checked; ``get`` (a step) is answered
``{"ok": true, "manifest": ...}`` and the files, or ``{"ok": false, "reason": ...}``. The
receiving side checks every file against the manifest before it keeps the copy. Both
name the copy: a whole state (rank 0's), or with ``sharded`` a rank's share of one.

Like torch's TCPStore, the port is open to whoever can reach the node: it listens on the
address the node gives the rendezvous, on a network the job's nodes share.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import socketserver
import struct
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any, BinaryIO

from rallypoint.checkpoint import manifest as mf
from rallypoint.checkpoint.tier import Held, Tier

logger = logging.getLogger("rallypoint.agent")

#: Seconds a peer may take to answer or to send the next bytes.
TIMEOUT = 30.0
_HEADER = struct.Struct(">I")
_CHUNK = 8 << 20
_MOST = 1 << 20  # the longest request or answer header (a manifest of many files)


def _send(stream: BinaryIO, message: dict[str, Any]) -> None:
    body = json.dumps(message).encode()
    stream.write(_HEADER.pack(len(body)) + body)


def _receive(stream: BinaryIO) -> dict[str, Any]:
    head = stream.read(_HEADER.size)
    if len(head) != _HEADER.size:
        raise ConnectionError("the peer closed the connection")
    (size,) = _HEADER.unpack(head)
    if size > _MOST:
        raise ConnectionError(f"a header of {size} bytes from the peer")
    message = json.loads(stream.read(size))
    if not isinstance(message, dict):
        raise ConnectionError("the peer sent something other than a request")
    return message


def _send_files(stream: BinaryIO, held: Held) -> None:
    for file_name in held.manifest.files:
        with held.open(file_name) as reader:
            while chunk := reader.read(_CHUNK):
                stream.write(chunk)


#: Finds the copy of ``(step, rank, sharded)`` a node holds, held while in use.
Find = Callable[[int, int, bool], AbstractContextManager[Held]]


class PeerServer:
    """Serves the copies ``find`` finds (the node's own memory copies and the peers' it
    holds), and keeps what peers send in ``inbox(rank, sharded)``. Listens on ``host``, a
    free port."""

    def __init__(self, host: str, find: Find, inbox: Callable[[int, bool], Tier]) -> None:
        self.find = find
        self.inbox = inbox
        self._lock = threading.Lock()  # one copy written into the inbox at a time
        owner = self

        class Handler(socketserver.StreamRequestHandler):
            timeout = TIMEOUT

            def handle(self) -> None:
                with contextlib.suppress(OSError, ValueError, ConnectionError):
                    owner._serve(self.rfile, self.wfile)  # type: ignore[arg-type]

        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        server_class = type(
            "Server",
            (socketserver.ThreadingTCPServer,),
            {"address_family": family, "daemon_threads": True, "allow_reuse_address": True},
        )
        self._server = server_class((host, 0), Handler)
        self.port = int(self._server.server_address[1])
        self.address = f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="rallypoint-peers", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _serve(self, reader: BinaryIO, writer: BinaryIO) -> None:
        request = _receive(reader)
        rank, sharded = int(request.get("rank", 0)), bool(request.get("sharded", False))
        if request.get("op") == "put":
            manifest = mf.Manifest.decode(str(request["manifest"]).encode())
            try:
                with self._lock:
                    self.inbox(rank, sharded).receive(
                        manifest, lambda _file: contextlib.nullcontext(reader)
                    )
            except Exception as error:  # a damaged or cut copy: the one before stays
                _send(writer, {"ok": False, "reason": str(error)})
                return
            _send(writer, {"ok": True})
        elif request.get("op") == "get":
            step = int(request["step"])
            with contextlib.suppress(mf.Damaged), self.find(step, rank, sharded) as held:
                _send(writer, {"ok": True, "manifest": held.manifest.encode().decode()})
                _send_files(writer, held)
                return
            _send(writer, {"ok": False, "reason": f"no complete copy of step {step} here"})
        writer.flush()


@contextlib.contextmanager
def _connect(address: str) -> Iterator[tuple[BinaryIO, BinaryIO]]:
    host, _, port = address.rpartition(":")
    with (
        socket.create_connection((host.strip("[]"), int(port)), timeout=TIMEOUT) as sock,
        sock.makefile("rb") as reader,
        sock.makefile("wb") as writer,
    ):
        yield reader, writer


def put(address: str, held: Held, rank: int = 0, sharded: bool = False) -> None:
    """Send the checkpoint ``held`` (``rank``'s share with ``sharded``) to the agent at
    ``address``."""
    with _connect(address) as (reader, writer):
        manifest = held.manifest.encode().decode()
        _send(writer, {"op": "put", "manifest": manifest, "rank": rank, "sharded": sharded})
        _send_files(writer, held)
        writer.flush()
        answer = _receive(reader)
    if not answer.get("ok"):
        raise ConnectionError(str(answer.get("reason")))


#: The step a ``get`` asks for to have the newest whole state the peer holds.
NEWEST = -1


def get(
    address: str, step: int, into: Tier, rank: int = 0, sharded: bool = False
) -> tuple[int, int]:
    """Fetch the checkpoint of ``step`` (``rank``'s share with ``sharded``; NEWEST: the
    newest whole state) from the agent at ``address`` into ``into``; its step, and the
    bytes fetched."""
    with _connect(address) as (reader, writer):
        _send(writer, {"op": "get", "step": step, "rank": rank, "sharded": sharded})
        writer.flush()
        answer = _receive(reader)
        if not answer.get("ok"):
            raise ConnectionError(str(answer.get("reason")))
        manifest = mf.Manifest.decode(str(answer["manifest"]).encode())
        return manifest.step, into.receive(manifest, lambda _file: contextlib.nullcontext(reader))
