"""Memory checkpoints between agents: each agent serves the copies it holds, and sends its
newest to the next node of the round, so that the loss of a node loses no checkpoint.

One TCP connection per request. Every message is a 4-byte big-endian length and a JSON
object. The server speaks first, ``{"nonce": ...}``; then the request; ``put`` is followed
by the checkpoint's files, in its manifest's order, and answered ``{"ok": true}`` once they
are written and checked; ``get`` (a step) is answered ``{"ok": true, "manifest": ...}``
and the files, or ``{"ok": false, "reason": ...}``. The receiving side checks every file
against the manifest before it keeps the copy. Both name the copy: a whole state (rank
0's), or with ``sharded`` a rank's share of one.

With a job token (``--rdzv-conf token_file``, ``RALLYPOINT_JOB_TOKEN``) both sides prove
that they know it, challenge and response: the request carries the client's nonce and an
HMAC-SHA256, keyed with the token, of both nonces and the request; the answer an HMAC of
both nonces and the answer. A request without a valid proof is refused (``refused`` is
called: the agent logs the first and counts them all); a client drops an answer without
one, so that no stray process can take or feed a node a checkpoint. The files are bound
by the manifest's checksums, which the proofs cover. Without a token the port is open to
whoever can reach the node, like torch's TCPStore: it listens on the address the node
gives the rendezvous, on a network the job's nodes share.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import logging
import secrets
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


def _proof(token: bytes, purpose: str, first: str, second: str, message: dict[str, Any]) -> str:
    """The HMAC of a message and the nonces of both sides: ``purpose`` ("request",
    "answer") keeps an answer from being replayed as a request."""
    body = json.dumps(message, sort_keys=True, separators=(",", ":"))
    text = "\n".join((purpose, first, second, body)).encode()
    return hmac.new(token, text, hashlib.sha256).hexdigest()


def _signed(
    token: bytes | None, purpose: str, nonces: tuple[str, str], message: dict[str, Any]
) -> dict[str, Any]:
    if token is None:
        return message
    return {**message, "proof": _proof(token, purpose, *nonces, message)}


def _verified(
    token: bytes | None, purpose: str, nonces: tuple[str, str], message: dict[str, Any]
) -> bool:
    """Whether ``message`` carries a valid proof (always, without a token)."""
    if token is None:
        return True
    given = message.pop("proof", None)
    wanted = _proof(token, purpose, *nonces, message)
    return isinstance(given, str) and hmac.compare_digest(given, wanted)


#: Finds the copy of ``(step, rank, sharded)`` a node holds, held while in use.
Find = Callable[[int, int, bool], AbstractContextManager[Held]]


class PeerServer:
    """Serves the copies ``find`` finds (the node's own memory copies and the peers' it
    holds), and keeps what peers send in ``inbox(rank, sharded)``. Listens on ``host``, a
    free port."""

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
        self.token = token
        self.refused = refused  # (the peer's address, why): a request without the token
        self._lock = threading.Lock()  # one copy written into the inbox at a time
        owner = self

        class Handler(socketserver.StreamRequestHandler):
            timeout = TIMEOUT

            def handle(self) -> None:
                with contextlib.suppress(OSError, ValueError, ConnectionError):
                    peer = str(self.client_address[0])
                    owner._serve(self.rfile, self.wfile, peer)  # type: ignore[arg-type]

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

    def _serve(self, reader: BinaryIO, writer: BinaryIO, peer: str) -> None:
        mine = secrets.token_hex(16)
        _send(writer, {"nonce": mine, "token": self.token is not None})
        writer.flush()
        request = _receive(reader)
        theirs = str(request.get("nonce", ""))
        proved = "proof" in request
        if not _verified(self.token, "request", (mine, theirs), request):
            why = "a wrong job token" if proved else "no job token"
            self.refused(peer, why)
            _send(writer, {"ok": False, "reason": "refused: this job's token is required"})
            writer.flush()
            return

        def answer(message: dict[str, Any]) -> None:
            _send(writer, _signed(self.token, "answer", (theirs, mine), message))

        rank, sharded = int(request.get("rank", 0)), bool(request.get("sharded", False))
        if request.get("op") == "put":
            manifest = mf.Manifest.decode(str(request["manifest"]).encode())
            try:
                with self._lock:
                    self.inbox(rank, sharded).receive(
                        manifest, lambda _file: contextlib.nullcontext(reader)
                    )
            except Exception as error:  # a damaged or cut copy: the one before stays
                answer({"ok": False, "reason": str(error)})
                return
            answer({"ok": True})
        elif request.get("op") == "get":
            step = int(request["step"])
            with contextlib.suppress(mf.Damaged), self.find(step, rank, sharded) as held:
                answer({"ok": True, "manifest": held.manifest.encode().decode()})
                _send_files(writer, held)
                return
            answer({"ok": False, "reason": f"no complete copy of step {step} here"})
        writer.flush()


class _Client:
    """One request to a peer: its nonce and ours, the token, the streams."""

    def __init__(self, reader: BinaryIO, writer: BinaryIO, token: bytes | None) -> None:
        self.reader, self.writer, self.token = reader, writer, token
        hello = _receive(reader)
        if token is not None and not hello.get("token"):
            raise ConnectionError(
                "the peer does not ask for this job's token: not one of its agents"
            )
        self.nonces = (str(hello.get("nonce", "")), secrets.token_hex(16))

    def request(self, message: dict[str, Any]) -> None:
        message = {**message, "nonce": self.nonces[1]}
        _send(self.writer, _signed(self.token, "request", self.nonces, message))

    def answer(self) -> dict[str, Any]:
        """The peer's answer, its proof checked; ConnectionError when refused."""
        answer = _receive(self.reader)
        if not answer.get("ok"):  # a refusal carries nothing to trust
            raise ConnectionError(str(answer.get("reason")))
        server, client = self.nonces
        if not _verified(self.token, "answer", (client, server), answer):
            raise ConnectionError("the peer's answer does not prove this job's token")
        return answer


@contextlib.contextmanager
def _connect(address: str, token: bytes | None) -> Iterator[_Client]:
    host, _, port = address.rpartition(":")
    with (
        socket.create_connection((host.strip("[]"), int(port)), timeout=TIMEOUT) as sock,
        sock.makefile("rb") as reader,
        sock.makefile("wb") as writer,
    ):
        yield _Client(reader, writer, token)


def put(
    address: str, held: Held, rank: int = 0, sharded: bool = False, token: bytes | None = None
) -> None:
    """Send the checkpoint ``held`` (``rank``'s share with ``sharded``) to the agent at
    ``address``; ``token``: the job's, which both prove they know."""
    with _connect(address, token) as client:
        manifest = held.manifest.encode().decode()
        client.request({"op": "put", "manifest": manifest, "rank": rank, "sharded": sharded})
        _send_files(client.writer, held)
        client.writer.flush()
        client.answer()


#: The step a ``get`` asks for to have the newest whole state the peer holds.
NEWEST = -1


def get(
    address: str,
    step: int,
    into: Tier,
    rank: int = 0,
    sharded: bool = False,
    token: bytes | None = None,
) -> tuple[int, int]:
    """Fetch the checkpoint of ``step`` (``rank``'s share with ``sharded``; NEWEST: the
    newest whole state) from the agent at ``address`` into ``into``; its step, and the
    bytes fetched. ``token``: the job's, which both prove they know."""
    with _connect(address, token) as client:
        client.request({"op": "get", "step": step, "rank": rank, "sharded": sharded})
        client.writer.flush()
        answer = client.answer()
        manifest = mf.Manifest.decode(str(answer["manifest"]).encode())
        files = lambda _file: contextlib.nullcontext(client.reader)  # noqa: E731
        return manifest.step, into.receive(manifest, files)
