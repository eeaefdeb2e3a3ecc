"""The wire of the checkpoint transfers between agents (``rallypoint.agent.checkpoints.peers``).

Memory checkpoints between agents: each agent serves the copies it holds, and sends its
newest to the next node of the round, so that the loss of a node loses no checkpoint.

One TCP connection per request. A frame is ``rallypoint.agent.processes.framing``'s, a 4-byte
big-endian length and that many bytes, a JSON object; each kind of frame has a bound, and
a length over it is refused before anything more is read. The messages, in order:

* hello, server to client (``SMALL``): ``{"nonce": ..., "token": bool, "version": 2}``;
* request, client to server (``SMALL``): ``{"op": "get" | "put", "nonce": ..., "rank":
  R, "sharded": bool, "proof": ...}``, with ``"step"`` for a ``get`` (``NEWEST``: the
  newest whole state) and ``"manifest_sha256"`` for a ``put``: the SHA-256 of the
  manifest the client is about to send;
* for a ``put``, the server's go-ahead ``{"ok": true, "proof": ...}``; then the client
  sends the checkpoint (below) and the server answers ``{"ok": true, "proof": ...}`` once
  it is written and checked;
* for a ``get``, the server answers ``{"ok": true, "manifest_sha256": ..., "proof": ...}``
  and sends the checkpoint;
* a checkpoint: its manifest, a frame of its own (``MANIFEST_MOST``) whose SHA-256 is the
  one announced; its files' bytes, in the manifest's order; with a job token, a trailer
  ``{"mac": ...}`` (``SMALL``);
* any refusal or failure: ``{"ok": false, "reason": ...}``, and the connection ends.

The receiving side checks every file against the manifest, and the manifest's file names
(``manifest.safe_name``), before it keeps the copy. Both name the copy: a whole state
(rank 0's), or with ``sharded`` a rank's share of one (``sharded/rank-R/``, R below 2**20).

With a job token (``--rdzv-conf token_file``, ``RALLYPOINT_JOB_TOKEN``) both sides prove
that they know it, challenge and response, with a key derived from it
(``job_token.derive``): the request carries the client's nonce and an HMAC-SHA256 of both
nonces and the request; the go-ahead and every answer an HMAC of both nonces, its purpose
("ready", "answer": neither passes for the other) and the message; the manifest is bound
by the SHA-256 that the proven request or answer carries; the trailer is an HMAC of both
nonces and every byte of the files, which the receiver checks before it writes the
manifest (a CRC-32 finds damage, not an attacker on the path). A refusal carries no
proof, and is believed only as a failure. A request
without a valid proof is refused (``refused`` is called: the agent logs the first and
counts them all), and so is anything unsafe a peer sends; a client drops an answer
without a proof, so that no stray process can take or feed a node a checkpoint. Without
a token the port is open to whoever can reach the node, like torch's TCPStore: it listens
on the address the node gives the rendezvous, on a network the job's nodes share.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import re
from typing import Any, BinaryIO

from rallypoint import job_token
from rallypoint.agent.processes import framing
from rallypoint.checkpoint import manifest as mf
from rallypoint.checkpoint.tier import Held, Tier
from rallypoint.interfaces import CheckpointError

VERSION = 2
#: The step a ``get`` asks for to have the newest whole state the peer holds.
NEWEST = -1
#: Seconds a verified peer may take to send or take the next bytes.
TIMEOUT = 30.0
#: The longest hello, request, answer and trailer.
SMALL = 4 << 10
#: The longest manifest (a checkpoint of many files).
MANIFEST_MOST = 16 << 20
#: The key of the job token this module uses (``job_token.derive``).
PURPOSE = "peer transfers"
_CHUNK = 8 << 20
NONCE = re.compile(r"[0-9a-f]{32}")
DIGEST = re.compile(r"[0-9a-f]{64}")
UNPRINTABLE = re.compile(r"[\x00-\x1f\x7f-\x9f]")


class Refused(ConnectionError):
    """What a peer sent and this side refuses: no proof of the job's token, a frame over
    its bound, a malformed message, an unsafe manifest, files that fail their MAC.
    ``reason`` says what the peer gave (``refused a transfer from X: it gave <reason>``)."""

    def __init__(self, reason: str, message: str | None = None) -> None:
        super().__init__(message or f"refused: it gave {reason}")
        self.reason = reason


# --- frames ---------------------------------------------------------------------------------


def encoded(message: dict[str, Any]) -> bytes:
    """``message``'s frame."""
    return framing.encode(json.dumps(message).encode())


def send(stream: BinaryIO, message: dict[str, Any]) -> None:
    stream.write(encoded(message))


def receive_raw(stream: BinaryIO, most: int, what: str) -> bytes:
    """A frame's bytes; ``Refused`` when its length is over ``most``, before reading it."""
    try:
        return framing.read_frame(stream.read, most, what)
    except framing.Oversize as error:
        raise Refused(str(error)) from None
    except framing.Truncated:
        raise ConnectionError("the peer closed the connection") from None


def parse(body: bytes, what: str) -> dict[str, Any]:
    try:
        message = json.loads(body)
    except (ValueError, RecursionError) as error:  # RecursionError: JSON nested too deep
        raise Refused(f"a malformed {what} ({error})") from None
    if not isinstance(message, dict):
        raise Refused(f"a malformed {what} (not a JSON object)")
    return message


def receive(stream: BinaryIO, most: int, what: str) -> dict[str, Any]:
    article = "an" if what[0] in "aeiou" else "a"
    return parse(receive_raw(stream, most, f"{article} {what}"), what)


# --- proofs ---------------------------------------------------------------------------------


def key_of(token: bytes | None) -> bytes | None:
    """The key of ``token`` for the transfers (None without a token)."""
    return None if token is None else job_token.derive(token, PURPOSE)


def _proof(key: bytes, purpose: str, first: str, second: str, message: dict[str, Any]) -> str:
    """The HMAC of a message and the nonces of both sides: ``purpose`` ("request",
    "ready", "answer") keeps one message from being replayed as another."""
    body = json.dumps(message, sort_keys=True, separators=(",", ":"))
    text = "\n".join((purpose, first, second, body)).encode()
    return hmac.new(key, text, hashlib.sha256).hexdigest()


def signed(
    key: bytes | None, purpose: str, nonces: tuple[str, str], message: dict[str, Any]
) -> dict[str, Any]:
    if key is None:
        return message
    return {**message, "proof": _proof(key, purpose, *nonces, message)}


def verified(
    key: bytes | None, purpose: str, nonces: tuple[str, str], message: dict[str, Any]
) -> bool:
    """Whether ``message`` carries a valid proof (always, without a token)."""
    if key is None:
        return True
    given = message.pop("proof", None)
    wanted = _proof(key, purpose, *nonces, message)
    return isinstance(given, str) and given.isascii() and hmac.compare_digest(given, wanted)


def files_mac(key: bytes | None, nonces: tuple[str, str]) -> hmac.HMAC | None:
    """The MAC of a transfer's files (None without a token), bound to its nonces (the
    server's first): recorded files cannot be sent again."""
    if key is None:
        return None
    server, client = nonces
    return hmac.new(key, f"files\n{server}\n{client}".encode(), hashlib.sha256)


# --- a checkpoint on the wire -----------------------------------------------------------------


def send_checkpoint(stream: BinaryIO, held: Held, text: bytes, mac: hmac.HMAC | None) -> None:
    """The manifest ``text``, the files, the MAC's trailer."""
    stream.write(framing.encode(text))
    for file_name in held.manifest.files:
        with held.open(file_name) as reader:
            while chunk := reader.read(_CHUNK):
                if mac is not None:
                    mac.update(chunk)
                stream.write(chunk)
    if mac is not None:
        send(stream, {"mac": mac.hexdigest()})
    stream.flush()


class _Macced:
    """A stream whose bytes read are added to a MAC."""

    def __init__(self, stream: BinaryIO, mac: hmac.HMAC) -> None:
        self.stream, self.mac = stream, mac

    def read(self, size: int = -1) -> bytes:
        data = self.stream.read(size)
        self.mac.update(data)
        return data


def receive_checkpoint(
    stream: BinaryIO, digest: str, into: Tier, mac: hmac.HMAC | None, step: int = NEWEST
) -> tuple[int, int]:
    """Read a checkpoint announced with the SHA-256 ``digest`` into ``into``: its step, and
    the bytes written; ``Refused`` for a manifest over its bound, another than announced,
    unsafe or of another step than ``step`` (unless NEWEST), and for files that fail their
    MAC (nothing of them is kept)."""
    raw = receive_raw(stream, MANIFEST_MOST, "a manifest")
    if not hmac.compare_digest(hashlib.sha256(raw).hexdigest(), digest):
        raise Refused("a manifest other than the one announced")
    try:
        manifest = mf.Manifest.decode(raw)
    except mf.Damaged as error:
        raise Refused(f"an unusable manifest ({error})") from None
    if step not in (NEWEST, manifest.step):  # authenticated, yet not what was asked for
        raise Refused(f"the checkpoint of step {manifest.step} for step {step}")
    source: Any = stream if mac is None else _Macced(stream, mac)

    def check() -> None:
        assert mac is not None
        given = receive(stream, SMALL, "trailer").get("mac")
        wanted = mac.hexdigest()
        if not (isinstance(given, str) and given.isascii() and hmac.compare_digest(given, wanted)):
            raise Refused("files that do not match their MAC")

    try:
        copied = into.receive(
            manifest, lambda _file: contextlib.nullcontext(source), None if mac is None else check
        )
    except CheckpointError as error:  # the tier's wrapping of what failed the copy
        if isinstance(error.__cause__, Refused):
            raise error.__cause__ from None
        raise
    return manifest.step, copied


# --- requests -------------------------------------------------------------------------------


def request_problem(request: dict[str, Any]) -> str | None:
    """What is wrong with a (verified) request's fields, None if nothing."""
    op, rank, sharded = request.get("op"), request.get("rank"), request.get("sharded")
    if op not in ("get", "put"):
        return f"operation {mf.shortened(op)}"
    if type(rank) is not int or not 0 <= rank < mf.MAX_RANKS:
        return f"rank {mf.shortened(rank)}"
    if not isinstance(sharded, bool):
        return f"sharded {mf.shortened(sharded)}"
    if op == "get":
        step = request.get("step")
        if type(step) is not int or not (step == NEWEST or 0 <= step < mf.MAX_STEP):
            return f"step {mf.shortened(step)}"
    else:
        digest = request.get("manifest_sha256")
        if not isinstance(digest, str) or not DIGEST.fullmatch(digest):
            return f"manifest digest {mf.shortened(digest)}"
    return None
