"""The framing the agent, its keeper and the preloaded interpreter speak
(``rallypoint.agent.processes.wire``): whole messages with their descriptors, and every broken
stream refused the same way; and the length-prefixed frames under it and under the peer
transfers (``rallypoint.agent.processes.framing``)."""

from __future__ import annotations

import json
import os
import socket
import struct
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from rallypoint.agent.processes import framing, wire


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    for end in (a, b):
        end.settimeout(10)  # a bound on every read and write of these tests
    with a, b:
        yield a, b


def test_a_message_and_its_descriptors_arrive_whole(pair: tuple[socket.socket, ...]) -> None:
    a, b = pair
    read, write = os.pipe()
    try:
        wire.send(a, {"op": "spawn", "argv": ["x"]}, (write, write))
        received = wire.receive(b)
        assert received is not None
        message, fds = received
        assert message == {"op": "spawn", "argv": ["x"]} and len(fds) == 2
        assert not any(os.get_inheritable(fd) for fd in fds)  # no worker inherits them
        os.write(fds[0], b"through the passed descriptor")
        assert os.read(read, 100) == b"through the passed descriptor"
        for fd in fds:
            os.close(fd)
    finally:
        os.close(read)
        os.close(write)


def test_a_message_larger_than_the_socket_buffer_arrives_whole(
    pair: tuple[socket.socket, ...],
) -> None:
    """An environment of 1 MiB: one SOCK_SEQPACKET packet could hold 208 KiB of it."""
    a, b = pair
    big = {"op": "spawn", "env": {f"V{i}": "x" * 1000 for i in range(1024)}}
    got: list[Any] = []
    reader = threading.Thread(target=lambda: got.append(wire.receive(b)))
    reader.start()
    wire.send(a, big)
    reader.join(10)
    assert got == [(big, [])]


def test_a_frame_cut_into_pieces_is_read_whole(pair: tuple[socket.socket, ...]) -> None:
    a, b = pair
    body = json.dumps({"op": "ready"}).encode()
    frame = struct.pack(">I", len(body)) + body
    got: list[Any] = []
    reader = threading.Thread(target=lambda: got.append(wire.receive(b)))
    reader.start()
    for piece in (frame[:1], frame[1:3], frame[3:7], frame[7:]):
        a.sendall(piece)
    reader.join(10)
    assert got == [({"op": "ready"}, [])]


def test_the_other_end_closing_between_messages_is_none(pair: tuple[socket.socket, ...]) -> None:
    a, b = pair
    wire.send(a, {"op": "exited"})
    a.close()
    assert wire.receive(b) == ({"op": "exited"}, [])
    assert wire.receive(b) is None


@pytest.mark.parametrize(
    "frame",
    [
        struct.pack(">I", 10) + b'{"op"',  # closed mid-message
        b"\x00\x00",  # closed mid-header
        struct.pack(">I", wire.MAX_MESSAGE + 1),  # over the bound: nothing more is read
        struct.pack(">I", 2) + b"[]",  # not an object
        struct.pack(">I", 3) + b"{no",  # not JSON
    ],
    ids=["mid-message", "mid-header", "over-the-bound", "not-an-object", "not-json"],
)
def test_a_broken_stream_is_a_value_error_that_closes_the_descriptors(
    pair: tuple[socket.socket, ...], frame: bytes
) -> None:
    a, b = pair
    read, write = os.pipe()
    try:
        socket.send_fds(a, [frame], [write])
        a.shutdown(socket.SHUT_WR)
        before = set(os.listdir("/proc/self/fd"))
        with pytest.raises(ValueError):
            wire.receive(b)
        assert set(os.listdir("/proc/self/fd")) <= before  # what came with it is closed
    finally:
        os.close(read)
        os.close(write)


def test_sending_over_a_bound_is_refused_before_anything_is_sent(
    pair: tuple[socket.socket, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = pair
    monkeypatch.setattr(wire, "MAX_MESSAGE", 100)
    with pytest.raises(ValueError, match="over the wire's bounds"):
        wire.send(a, {"env": "x" * 200})
    with pytest.raises(ValueError, match="over the wire's bounds"):
        wire.send(a, {}, [0] * (wire.MAX_FDS + 1))
    a.close()
    assert wire.receive(b) is None


# --- the frames under both wires -----------------------------------------------------------


class Stream:
    """A stream of ``data`` that records what each read asked for."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.asked: list[int] = []

    def read(self, size: int) -> bytes:
        self.asked.append(size)
        chunk, self.data = self.data[:size], self.data[size:]
        return chunk


@pytest.mark.parametrize("body", [b"", b"{}", bytes(range(256)) * 5000])
def test_a_frame_round_trips(body: bytes) -> None:
    encoded = framing.encode(body)
    assert encoded[:4] == struct.pack(">I", len(body))  # the wire both sides always spoke
    stream = Stream(encoded + b"the next frame")
    assert framing.read_frame(stream.read, len(body)) == body
    assert stream.data == b"the next frame"
    assert max(stream.asked) <= framing.CHUNK  # memory grows with what arrives


def test_a_length_over_the_bound_is_refused_before_the_body_is_read() -> None:
    stream = Stream(struct.pack(">I", 101) + b"x" * 101)
    with pytest.raises(framing.Oversize, match="a reply of 101 bytes, over the 100 allowed"):
        framing.read_frame(stream.read, 100, "a reply")
    assert stream.asked == [4]  # the header alone
    assert framing.read_frame(Stream(struct.pack(">I", 100) + b"x" * 100).read, 100)
    with pytest.raises(framing.Oversize):  # nor is one sent
        framing.encode(b"x" * 101, 100)


def test_a_header_claiming_much_costs_only_what_arrives() -> None:
    stream = Stream(struct.pack(">I", framing.LARGEST) + b"x" * 10)
    with pytest.raises(framing.Truncated, match="ended in the middle of a frame"):
        framing.read_frame(stream.read, framing.LARGEST)
    assert stream.asked == [4, framing.CHUNK, framing.CHUNK]  # not 4 GiB at once


@pytest.mark.parametrize(
    "data", [b"", b"\x00\x00", struct.pack(">I", 5), struct.pack(">I", 5) + b"abcd"]
)
def test_a_short_read_is_truncated(data: bytes) -> None:
    with pytest.raises(framing.Truncated):
        framing.read_frame(Stream(data).read, 100)
    assert issubclass(framing.Truncated, ValueError)  # the worker channel's broken stream


def test_a_frame_may_start_with_bytes_read_already() -> None:
    frame = framing.encode(b"body")
    assert framing.read_frame(Stream(frame[2:]).read, 10, head=frame[:2]) == b"body"


def test_a_sender_that_stalls_mid_frame_meets_the_stream_timeout(
    pair: tuple[socket.socket, ...],
) -> None:
    a, b = pair
    b.settimeout(0.2)
    a.sendall(struct.pack(">I", 100) + b"x" * 10)  # and the rest never
    with pytest.raises(TimeoutError):
        framing.read_frame(b.recv, 100)
