"""The job's token: where an agent reads it, and the checkpoint transfers between agents
that it authenticates (rallypoint.agent.checkpoints.peers). A stray client without it can neither
fetch a node's checkpoint nor push one into it; a stray server cannot feed one to a node."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import queue
import shutil
import socket
import struct
import subprocess
import sys
import threading
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from launch import rallypoint, worker
from rallypoint.agent.checkpoints import peer_server, peer_wire, peers
from rallypoint.checkpoint import Checkpointer, FileStorage
from rallypoint.checkpoint import manifest as mf
from rallypoint.checkpoint.tier import Held, Tier
from rallypoint.config import TOKEN_ENV, job_token
from rallypoint.errors import UsageError
from rallypoint.worker.channel import Receiver
from servers import recv_exactly

TOKEN = b"the job's secret"


def test_the_token_comes_from_a_file_or_the_environment(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_bytes(b"  s3cret\n")
    assert job_token({"token_file": str(path)}, {TOKEN_ENV: "other"}) == b"s3cret"
    assert job_token({}, {TOKEN_ENV: " s3cret "}) == b"s3cret"
    assert job_token({}, {}) is None


@pytest.mark.parametrize(
    ("file", "environ", "said"),
    [
        ("missing", {}, r"token_file=.*missing: no such file\."),
        ("", {}, r"token_file=.*empty: the file is empty; put the job's secret in it\."),
        (None, {TOKEN_ENV: "  "}, r"RALLYPOINT_JOB_TOKEN is set but empty"),
    ],
)
def test_a_bad_token_is_one_sentence(
    tmp_path: Path, file: str | None, environ: dict[str, str], said: str
) -> None:
    options = {}
    if file is not None:
        path = tmp_path / (file or "empty")
        if file == "":
            path.write_text("\n")
        options["token_file"] = str(path)
    with pytest.raises(UsageError, match=said):
        job_token(options, environ)


GOOD = b"0123456789abcdef0123"  # 20 bytes


@pytest.mark.parametrize(
    ("mode", "who"), [(0o644, "others"), (0o640, "its group"), (0o604, "others")]
)
def test_a_token_file_others_may_read_is_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, mode: int, who: str
) -> None:
    path = tmp_path / "token"
    path.write_bytes(GOOD)
    path.chmod(mode)
    with caplog.at_level(logging.WARNING):
        assert job_token({"token_file": str(path)}, {}) == GOOD
    assert [r.getMessage() for r in caplog.records] == [
        f"--rdzv-conf token_file={path} is readable by {who} (mode {mode:04o}): chmod 600 {path}"
    ]


def test_a_private_long_token_says_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "token"
    path.write_bytes(GOOD)
    path.chmod(0o600)
    with caplog.at_level(logging.WARNING):
        assert job_token({"token_file": str(path)}, {}) == GOOD
        assert job_token({}, {TOKEN_ENV: GOOD.decode()}) == GOOD
    assert caplog.records == []


@pytest.mark.parametrize("where", ["file", "environment"])
def test_a_short_token_is_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, where: str
) -> None:
    path = tmp_path / "token"
    path.write_bytes(b"0123456789abcde\n")  # 15 bytes
    path.chmod(0o600)
    options, environ = (
        ({"token_file": str(path)}, {}) if where == "file" else ({}, {TOKEN_ENV: "0123456789abcde"})
    )
    with caplog.at_level(logging.WARNING):
        job_token(options, environ)
    [said] = [r.getMessage() for r in caplog.records]
    source = f"--rdzv-conf token_file={path}" if where == "file" else TOKEN_ENV
    assert said.startswith(f"{source}: the job token is short (15 bytes)")
    assert "head -c 32 /dev/urandom | base64" in said


def test_rallypoint_run_warns_once_on_stderr(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_bytes(b"short\n")
    path.chmod(0o644)
    result = rallypoint(
        "run", "--standalone", "--rdzv-conf", f"token_file={path}", worker("steps.py"), "1",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stderr.count(f"token_file={path} is readable by others (mode 0644)") == 1
    assert result.stderr.count("the job token is short (5 bytes)") == 1


def test_rallypoint_run_with_a_missing_token_file_exits_2(tmp_path: Path) -> None:
    result = rallypoint(
        "run", "--nnodes", "1:2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:1",
        "--rdzv-conf", f"token_file={tmp_path / 'nope'}", worker("steps.py"), "1",
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "token_file=" in result.stderr and "no such file" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.fixture
def held(tmp_path: Path) -> Tier:
    """A tier holding the checkpoint of step 5."""
    storage = FileStorage(str(tmp_path / "saved"))
    Checkpointer(storage=storage, rank=0, world_size=1).save({"w": torch.ones(3)}, 5)
    return Tier(storage, 3)


@contextlib.contextmanager
def server(
    tmp_path: Path, held: Tier, token: bytes | None
) -> Iterator[tuple[peer_server.PeerServer, Tier, list[tuple[str, str]]]]:
    inbox = Tier(FileStorage(str(tmp_path / "inbox")), 1)
    refused: list[tuple[str, str]] = []
    served = peer_server.PeerServer(
        "127.0.0.1",
        lambda step, rank, sharded: held.hold(step),
        lambda rank, sharded: inbox,
        token,
        lambda peer, why: refused.append((peer, why)),
    )
    try:
        yield served, inbox, refused
    finally:
        served.close()


def copy(held: Tier) -> contextlib.AbstractContextManager[Held]:
    return held.hold(5)


def test_agents_with_the_token_fetch_and_push(tmp_path: Path, held: Tier) -> None:
    with server(tmp_path, held, TOKEN) as (served, inbox, refused):
        into = Tier(FileStorage(str(tmp_path / "fetched")), 1)
        assert peers.get(served.address, 5, into, token=TOKEN)[0] == 5
        with copy(held) as checkpoint:
            peers.put(served.address, checkpoint, token=TOKEN)
    assert into.complete_steps() == {5} and inbox.complete_steps() == {5}
    assert refused == []


@pytest.mark.parametrize("token", [None, b"another job's secret"])
def test_a_stray_client_cannot_fetch_nor_push(
    tmp_path: Path, held: Tier, token: bytes | None
) -> None:
    with server(tmp_path, held, TOKEN) as (served, inbox, refused):
        into = Tier(FileStorage(str(tmp_path / "fetched")), 1)
        with pytest.raises(ConnectionError, match="refused: this job's token is required"):
            peers.get(served.address, 5, into, token=token)
        with copy(held) as checkpoint, pytest.raises(ConnectionError, match="refused"):
            peers.put(served.address, checkpoint, token=token)
    assert into.complete_steps() == set() and inbox.complete_steps() == set()
    why = "no job token" if token is None else "a wrong job token"
    assert refused == [("127.0.0.1", why), ("127.0.0.1", why)]


def test_a_stray_server_cannot_feed_a_node(tmp_path: Path, held: Tier) -> None:
    """An agent with the token does not take a checkpoint from a server without it."""
    with server(tmp_path, held, None) as (served, _, _):
        into = Tier(FileStorage(str(tmp_path / "fetched")), 1)
        with pytest.raises(ConnectionError, match="does not ask for this job's token"):
            peers.get(served.address, 5, into, token=TOKEN)
    assert into.complete_steps() == set()


def same_crc(data: bytes, at: int) -> bytes:
    """``data`` with its byte at ``at`` flipped and the 4 after it changed so that its CRC-32
    stays the same: what an attacker on the path does to a file that only a CRC guards.

    A CRC is linear: over messages of one length, the change a bit makes to it does not
    depend on the rest; so solve for the bits of the 4 bytes that undo the flip's change."""
    zero = zlib.crc32(bytes(len(data)))

    def change(position: int, mask: int) -> int:
        changed = bytearray(len(data))
        changed[position] = mask
        return zlib.crc32(bytes(changed)) ^ zero

    rows: list[tuple[int, int]] = []  # reduced changes, by leading bit, and the bits they take
    for bit in range(32):
        vector, bits = change(at + 1 + bit // 8, 1 << bit % 8), 1 << bit
        for row, row_bits in rows:
            if vector ^ row < vector:
                vector, bits = vector ^ row, bits ^ row_bits
        if vector:
            rows = sorted([*rows, (vector, bits)], reverse=True)
    wanted, bits = change(at, 0xFF), 0
    for row, row_bits in rows:
        if wanted ^ row < wanted:
            wanted, bits = wanted ^ row, bits ^ row_bits
    forged = bytearray(data)
    forged[at] ^= 0xFF
    for bit in range(32):
        if bits >> bit & 1:
            forged[at + 1 + bit // 8] ^= 1 << bit % 8
    assert forged != data and zlib.crc32(forged) == zlib.crc32(data)
    return bytes(forged)


def _frame(sock: socket.socket) -> bytes:
    head = recv_exactly(sock, 4)
    return head + recv_exactly(sock, struct.unpack(">I", head)[0])


def _pump(source: socket.socket, target: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while chunk := source.recv(1 << 16):
            target.sendall(chunk)
        target.shutdown(socket.SHUT_WR)


@contextlib.contextmanager
def man_in_the_middle(port: int, upstream: bool) -> Iterator[str]:
    """A relay to the server at ``port`` for one connection that changes a byte of the first
    file the client (``upstream``) or the server sends, keeping its CRC-32."""
    listener = socket.create_server(("127.0.0.1", 0))

    def relay() -> None:
        client, _ = listener.accept()
        with client, socket.create_connection(("127.0.0.1", port), timeout=10) as server:
            source, target = (client, server) if upstream else (server, client)
            back = threading.Thread(target=_pump, args=(target, source), daemon=True)
            back.start()
            for _ in range(1 if upstream else 2):  # the request; or the hello and the answer
                target.sendall(_frame(source))
            manifest = _frame(source)
            target.sendall(manifest)
            [entry, *_] = json.loads(manifest[4:])["files"].values()
            target.sendall(same_crc(recv_exactly(source, entry["size"]), 100))
            _pump(source, target)
            back.join(10)

    thread = threading.Thread(target=relay, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{listener.getsockname()[1]}"
    finally:
        thread.join(10)
        listener.close()


def crc_checkpoint(data: bytes) -> Held:
    """A memory checkpoint's copy as the agents send it: one file, guarded by a CRC-32."""
    entry = mf.checksum(data, mf.FileEntry(0, crc32="0"))
    manifest = mf.Manifest(5, 1, 0.0, "arena", {"rank-00000.slot": entry})
    return Held(manifest, lambda name: contextlib.nullcontext(io.BytesIO(data)))


PAYLOAD = bytes(range(256)) * 64


@pytest.mark.parametrize("token", [None, TOKEN])
def test_a_file_changed_on_the_way_to_a_put_is_refused(
    tmp_path: Path, held: Tier, token: bytes | None
) -> None:
    """The CRC-32 finds damage, not an attacker: with the token, the files' MAC refuses
    the forged copy before its manifest is written, and nothing of it is kept; without
    it, the forged copy passes (the limit of a port without a token)."""
    with (
        server(tmp_path, held, token) as (served, inbox, refused),
        man_in_the_middle(served.port, upstream=True) as address,
    ):
        if token is None:
            peers.put(address, crc_checkpoint(PAYLOAD))
        else:
            with pytest.raises(ConnectionError, match="files that do not match their MAC"):
                peers.put(address, crc_checkpoint(PAYLOAD), token=token)
    if token is None:
        kept = inbox.storage.path(f"{mf.directory(5)}/rank-00000.slot").read_bytes()
        assert kept != PAYLOAD and len(kept) == len(PAYLOAD) and refused == []
        return
    assert refused == [("127.0.0.1", "files that do not match their MAC")]
    assert inbox.all_steps() == set() and inbox.storage.names() == []


def test_a_file_changed_on_the_way_from_a_get_is_refused(tmp_path: Path) -> None:
    inbox = Tier(FileStorage(str(tmp_path / "unused")), 1)
    served = peer_server.PeerServer(
        "127.0.0.1", lambda step, rank, sharded: contextlib.nullcontext(crc_checkpoint(PAYLOAD)),
        lambda rank, sharded: inbox, TOKEN,
    )  # fmt: skip
    into = Tier(FileStorage(str(tmp_path / "fetched")), 1)
    try:
        with (
            man_in_the_middle(served.port, upstream=False) as address,
            pytest.raises(peer_wire.Refused, match="files that do not match their MAC"),
        ):
            peers.get(address, 5, into, token=TOKEN)
    finally:
        served.close()
    assert into.all_steps() == set() and into.storage.names() == []


def test_the_transfers_are_keyed_by_a_key_derived_from_the_token() -> None:
    """Not the token itself: a proof recorded from a transfer is no cheap guess of it."""
    from rallypoint import job_token

    assert peer_wire.key_of(TOKEN) == job_token.derive(TOKEN, "peer transfers") != TOKEN
    assert peer_wire.key_of(None) is None


def test_workers_do_not_inherit_the_token() -> None:
    from types import SimpleNamespace

    from rallypoint.agent.processes.environment import job_environment

    config = SimpleNamespace(nproc_per_node=1)  # all job_environment reads
    environment = job_environment(config, {TOKEN_ENV: "s3cret", "PATH": "/bin"})  # type: ignore[arg-type]
    assert TOKEN_ENV not in environment and environment["PATH"] == "/bin"


@pytest.mark.skipif(os.geteuid() != 0, reason="sending as another user needs root")
def test_the_worker_channel_takes_nothing_from_another_user() -> None:
    """The agent's worker channel lies in a directory only the job's user may enter:
    another user's process cannot send to it; the job's own can (tests/test_worker_channel.py
    has the rest)."""
    delivered: queue.Queue[dict[str, object]] = queue.Queue()
    receiver = Receiver(lambda name, data: delivered.put(data))
    send = (
        "import json, socket, sys; s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM); "
        "s.sendto(json.dumps({'event': 'checkpoint_saved', 'step': int(sys.argv[2])}).encode(), "
        "sys.argv[1])"
    )
    try:
        # The system's Python (the test's may sit where nobody may read), from "/".
        python = shutil.which("python3", path="/usr/bin:/bin") or sys.executable
        stranger = subprocess.run(
            [python, "-c", send, receiver.address, "1"],
            user=65534, cwd="/", timeout=30, capture_output=True, text=True,
        )  # fmt: skip
        assert stranger.returncode == 1 and "PermissionError" in stranger.stderr
        own = subprocess.run([sys.executable, "-c", send, receiver.address, "2"], timeout=30)
        assert own.returncode == 0
        assert delivered.get(timeout=10)["step"] == 2
    finally:
        receiver.close()
    assert delivered.empty()
