"""The framing of every message between the agent, its keeper and the preloaded
interpreter: a 4-byte big-endian length, then that many bytes of one JSON object, over a
``SOCK_STREAM`` Unix socket pair. Descriptors (a worker's stdout and stderr) travel with a
message's first bytes (``SCM_RIGHTS``).

Why a length prefix over a stream rather than one message per ``SOCK_SEQPACKET`` packet
(what the keeper and the preloaded interpreter used to speak): a packet must fit the
socket's send buffer, 208 KiB by default (``net.core.wmem_default``; EMSGSIZE beyond),
and a request to start a cold worker or the preloaded interpreter carries a whole
environment, which ``exec`` accepts up to a quarter of the stack limit (2 MiB by
default). A packet larger than the reader's buffer is cut silently, too; a length is
checked against ``MAX_MESSAGE`` before anything is read. The frames are
``rallypoint.agent.processes.framing``'s, the peer transfers' too; what is this channel's own is
here: the descriptors that travel with a frame's first bytes, and sending the rest of a
frame a signal cut short.

Stdlib-only and importing nothing of rallypoint (``framing`` relatively): the keeper and
the preloaded interpreter import it without the package (``keeper_server``, ``zygote``).
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Sequence
from typing import Any

# Relative: imported as _rallypoint_keeper's and _rallypoint_zygote's too (see above).
from . import framing

#: The largest message, either way: above anything ``exec`` accepts (6 MiB at most), so
#: that only a broken or hostile stream meets it.
MAX_MESSAGE = 16 << 20
#: The most descriptors one message carries (a ``spawn`` request: stdout and stderr).
MAX_FDS = 4


def send(sock: socket.socket, message: dict[str, Any], fds: Sequence[int] = ()) -> None:
    """Send ``message`` and ``fds`` as one frame. ``ValueError`` when it is over a bound."""
    body = json.dumps(message).encode()
    if len(body) > MAX_MESSAGE or len(fds) > MAX_FDS:
        raise ValueError(
            f"a message of {len(body)} bytes and {len(fds)} descriptors is over the "
            f"wire's bounds ({MAX_MESSAGE} bytes, {MAX_FDS} descriptors)"
        )
    frame = memoryview(framing.encode(body))
    # A signal may cut a sendmsg short; the descriptors went with its first bytes.
    sent = socket.send_fds(sock, [frame], list(fds)) if fds else 0
    if sent < len(frame):
        sock.sendall(frame[sent:])


def receive(sock: socket.socket) -> tuple[dict[str, Any], list[int]] | None:
    """The next message and the descriptors it carried (not inherited across ``exec``);
    None when the other end closed between messages. ``ValueError`` when the stream is
    broken: closed mid-message, a length over ``MAX_MESSAGE``, or a body that is not a JSON
    object; the descriptors that came with it are closed then."""
    header, fds, _flags, _addr = socket.recv_fds(sock, framing.HEADER.size, MAX_FDS)
    try:
        for fd in fds:
            os.set_inheritable(fd, False)
        message = _body(sock, header) if header else None
    except BaseException:
        _close(fds)
        raise
    if message is None:
        _close(fds)
        return None
    return message, fds


def _body(sock: socket.socket, header: bytes) -> dict[str, Any]:
    """The message whose frame starts with ``header`` (a stream may cut it short)."""
    body = framing.read_frame(sock.recv, MAX_MESSAGE, "a message", head=header)
    try:
        message = json.loads(body)
    except RecursionError:  # JSON nested too deep: as broken as any other
        raise ValueError("a message nested too deep") from None
    if not isinstance(message, dict):
        raise ValueError(f"a message is a JSON object, not {type(message).__name__}")
    return message


def _close(fds: Sequence[int]) -> None:
    for fd in fds:
        os.close(fd)
