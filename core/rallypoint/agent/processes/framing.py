"""The one length-prefixed framing of rallypoint's streams: a 4-byte big-endian length, then
that many bytes. The worker channel (``rallypoint.agent.processes.wire``: the agent, its
keeper and the preloaded interpreter) and the checkpoint transfers between agents
(``rallypoint.agent.checkpoints.peer_wire``) both speak it, each with its own bounds, which
the caller passes: every length is a hostile number until it is checked against one.

Reading a frame asks the stream for at most ``CHUNK`` bytes at a time, so that its memory
grows with what arrives, never with what a header claims; each ask is bounded by the
stream's own timeout (the peer transfers') and either brings a byte or ends the frame, so a
frame takes at most as many asks as its bytes.

Stdlib-only and importing nothing of rallypoint: the keeper and the preloaded interpreter
import it, with ``wire``, without the package (``keeper_server``, ``zygote``).
"""

from __future__ import annotations

import struct
from collections.abc import Callable

HEADER = struct.Struct(">I")
#: The longest frame the prefix can say.
LARGEST = (1 << (8 * HEADER.size)) - 1
#: The most bytes asked of a stream at once.
CHUNK = 1 << 20

#: A stream's read: at most ``size`` bytes, at least one unless the stream ended.
Read = Callable[[int], bytes]


class FrameError(ValueError):
    """A broken frame."""


class Oversize(FrameError):
    """A frame's length over its bound: refused before its body is read, or sent."""

    def __init__(self, what: str, size: int, most: int) -> None:
        super().__init__(f"{what} of {size} bytes, over the {most} allowed")
        self.size, self.most = size, most


class Truncated(FrameError):
    """The stream ended in the middle of a frame."""


def encode(body: bytes, most: int = LARGEST, what: str = "a frame") -> bytes:
    """``body`` with its length in front; ``Oversize`` over ``most``."""
    if len(body) > most:
        raise Oversize(what, len(body), most)
    return HEADER.pack(len(body)) + body


def length(header: bytes | bytearray, most: int, what: str = "a frame") -> int:
    """The length ``header`` (``HEADER.size`` bytes) says; ``Oversize`` over ``most``."""
    size: int = HEADER.unpack(header)[0]
    if size > most:
        raise Oversize(what, size, most)
    return size


def read_frame(read: Read, most: int, what: str = "a frame", head: bytes = b"") -> bytes:
    """The body of the next frame of ``read``'s stream, whose first bytes ``head`` were read
    already (a stream that brings descriptors with them); ``Oversize`` for a length over
    ``most``, before anything more is read, ``Truncated`` when the stream ends first."""
    header = head + read_exactly(read, HEADER.size - len(head), what)
    return read_exactly(read, length(header, most, what), what)


def read_exactly(read: Read, count: int, what: str = "a frame") -> bytes:
    """``count`` bytes of ``read``'s stream; ``Truncated`` when it ends first."""
    chunks = []
    while count > 0:
        chunk = read(min(count, CHUNK))
        if not chunk:  # the end; or None, from a stream with nothing to read now
            raise Truncated(f"the stream ended in the middle of {what}")
        chunks.append(chunk)
        count -= len(chunk)
    return b"".join(chunks)
