"""Memory checkpoints between agents: each agent serves the copies it holds
(``rallypoint.agent.checkpoints.peer_server``), and sends its newest to the next node of the round
(``put``), so that the loss of a node loses no checkpoint; a node that needs a copy it
lacks fetches it from a member that holds it (``get``). What travels, and how it is
proven with the job token: ``rallypoint.agent.checkpoints.peer_wire``.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import secrets
import socket
from collections.abc import Iterator
from typing import Any, BinaryIO

from rallypoint.agent.checkpoints import peer_wire as wire
from rallypoint.checkpoint import manifest as mf
from rallypoint.checkpoint.tier import Held, Tier

# --- the client -----------------------------------------------------------------------------


class _Client:
    """One request to a peer: its nonce and ours, the key, the streams."""

    def __init__(self, reader: BinaryIO, writer: BinaryIO, key: bytes | None) -> None:
        self.reader, self.writer, self.key = reader, writer, key
        hello = wire.receive(reader, wire.SMALL, "hello")
        if key is not None and not hello.get("token"):
            raise wire.Refused(
                "no proof of this job's token",
                "the peer does not ask for this job's token: not one of its agents",
            )
        if hello.get("version") != wire.VERSION:
            raise ConnectionError(
                f"the peer speaks version {mf.shortened(hello.get('version'))} of the "
                f"checkpoint transfers, this agent {wire.VERSION}: give every node the same rallypoint"
            )
        server = hello.get("nonce")
        if not isinstance(server, str) or not wire.NONCE.fullmatch(server):
            raise wire.Refused("a malformed hello (no nonce)")
        self.nonces = (server, secrets.token_hex(16))

    def request(self, message: dict[str, Any]) -> None:
        message = {**message, "nonce": self.nonces[1]}
        wire.send(self.writer, wire.signed(self.key, "request", self.nonces, message))
        self.writer.flush()

    def answer(self, purpose: str = "answer") -> dict[str, Any]:
        """The peer's answer, its proof checked; ConnectionError when refused."""
        answer = wire.receive(self.reader, wire.SMALL, "answer")
        if answer.get("ok") is not True:  # a refusal carries nothing to trust
            raise ConnectionError(wire.UNPRINTABLE.sub(" ", str(answer.get("reason")))[:300])
        server, client = self.nonces
        if not wire.verified(self.key, purpose, (client, server), answer):
            raise wire.Refused(
                "a wrong job token", "the peer's answer does not prove this job's token"
            )
        return answer

    @property
    def mac(self) -> hmac.HMAC | None:
        return wire.files_mac(self.key, self.nonces)


@contextlib.contextmanager
def _connect(address: str, token: bytes | None) -> Iterator[_Client]:
    key = wire.key_of(token)  # derived before the connection: the server's clock is running
    host, _, port = address.rpartition(":")
    with (
        socket.create_connection((host.strip("[]"), int(port)), timeout=wire.TIMEOUT) as sock,
        sock.makefile("rb") as reader,
        sock.makefile("wb") as writer,
    ):
        yield _Client(reader, writer, key)


def put(
    address: str, held: Held, rank: int = 0, sharded: bool = False, token: bytes | None = None
) -> None:
    """Send the checkpoint ``held`` (``rank``'s share with ``sharded``) to the agent at
    ``address``; ``token``: the job's, which both prove they know. ``peer_wire.Refused`` for an
    answer this side refuses, ``ConnectionError`` when the peer refuses."""
    text = held.manifest.encode()
    with _connect(address, token) as client:
        digest = hashlib.sha256(text).hexdigest()
        client.request({"op": "put", "rank": rank, "sharded": sharded, "manifest_sha256": digest})
        client.answer("ready")
        wire.send_checkpoint(client.writer, held, text, client.mac)
        client.answer()


def get(
    address: str,
    step: int,
    into: Tier,
    rank: int = 0,
    sharded: bool = False,
    token: bytes | None = None,
) -> tuple[int, int]:
    """Fetch the checkpoint of ``step`` (``rank``'s share with ``sharded``; ``peer_wire.NEWEST``: the
    newest whole state) from the agent at ``address`` into ``into``; its step, and the
    bytes fetched. ``token``: the job's, which both prove they know. ``peer_wire.Refused`` for what
    this side refuses (an unsafe manifest, files that fail their MAC, an answer without
    proof), and nothing of it is kept."""
    with _connect(address, token) as client:
        client.request({"op": "get", "step": step, "rank": rank, "sharded": sharded})
        digest = client.answer().get("manifest_sha256")
        if not isinstance(digest, str) or not wire.DIGEST.fullmatch(digest):
            raise wire.Refused("a malformed answer (no manifest digest)")
        return wire.receive_checkpoint(client.reader, digest, into, client.mac, step)
