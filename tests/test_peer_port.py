"""The peer checkpoint port (rallypoint.agent.checkpoints.peers) against a hostile peer: names
from a peer are names, never paths (on a put, a get, and a durable checkpoint someone else
wrote); the work a connection costs before it proves the job's token is bounded; and, fuzzed,
the parsers of both ends raise nothing but their documented errors, write nothing outside
their root and read no frame over its bound."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import queue
import resource
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rallypoint import events
from rallypoint.agent.checkpoints import peer_server, peer_wire, peers, resume
from rallypoint.checkpoint import Checkpointer, FileStorage
from rallypoint.checkpoint import manifest as mf
from rallypoint.checkpoint.tier import Held, Tier
from rallypoint.interfaces import CheckpointError
from rallypoint.worker import channel
from servers import recv_exactly

TOKEN = b"the job's secret"
FUZZ = settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def tree(base: Path) -> set[str]:
    """Every path under ``base`` (files, folders, links), relative to it."""
    found = set()
    for folder, folders, files in os.walk(base):
        for name in folders + files:
            found.add(os.path.relpath(os.path.join(folder, name), base))
    return found


def crafted(files: dict[str, bytes], step: int = 5) -> Held:
    """A checkpoint of ``files`` as a hostile peer holds it: its manifest names them as
    given, with their right CRC-32s."""
    entries = {name: mf.checksum(data, mf.FileEntry(0, crc32="0")) for name, data in files.items()}
    manifest = mf.Manifest(step, 1, 0.0, "arena", entries)
    return Held(manifest, lambda name: contextlib.nullcontext(io.BytesIO(files[name])))


def escaping(target: Path) -> str:
    """A file name that leads from any checkpoint folder to ``target``."""
    return "../" * 24 + str(target).lstrip("/")


@contextlib.contextmanager
def server(
    root: Path, find: peer_server.Find, token: bytes | None = None
) -> Iterator[tuple[peer_server.PeerServer, Tier, list[tuple[str, str]]]]:
    inbox = Tier(FileStorage(str(root / "inbox")), 1)
    refused: list[tuple[str, str]] = []
    served = peer_server.PeerServer(
        "127.0.0.1", find, lambda rank, sharded: inbox, token,
        lambda peer, why: refused.append((peer, why)),
    )  # fmt: skip
    try:
        yield served, inbox, refused
    finally:
        served.close()


def holding(held: Held) -> peer_server.Find:
    return lambda step, rank, sharded: contextlib.nullcontext(held)


@pytest.fixture
def saved(tmp_path: Path) -> Tier:
    """A tier holding a real checkpoint of step 5."""
    storage = FileStorage(str(tmp_path / "saved"))
    Checkpointer(storage=storage, rank=0, world_size=1).save({"w": torch.ones(3)}, 5)
    return Tier(storage, 3)


def held_by(tier: Tier) -> peer_server.Find:
    return lambda step, rank, sharded: tier.hold(step)


# --- names from a peer are names --------------------------------------------------------------

UNSAFE = {
    "../x": "'..' component",
    "a/../../x": "'..' component",
    "/etc/passwd": "absolute path",
    "a\\..\\x": "backslash",
    "a\x00b": "control character",
    "a\nb": "control character",
    "a\x85b": "control character",
    "a//b": "empty component",
    "a/": "empty component",
    "": "empty",
    ".": "'.' component",
    "a/./b": "'.' component",
    "manifest.json": "keeps for itself",
    "begun": "keeps for itself",
    ".tmp-state.pt-1234": "keeps for itself",
    "shards/.tmp-x": "keeps for itself",
    "x" * 1025: "longer than 1024 bytes",
    "y" * 241: "longer than 240 bytes",
    "z\ud800": "not valid Unicode",
}


def manifest_text(**changes: Any) -> bytes:
    data: dict[str, Any] = {
        "kind": mf.KIND, "version": mf.VERSION, "step": 5, "world_size": 2, "created": 1.5,
        "format": "torch", "files": {"state.pt": {"size": 3, "sha256": "0" * 64}},
    }  # fmt: skip
    data.update(changes)
    return json.dumps(data).encode()


@pytest.mark.parametrize("name", list(UNSAFE))
def test_a_manifest_naming_a_path_is_refused_naming_the_entry(name: str) -> None:
    raw = manifest_text(files={name: {"size": 1, "crc32": "00000000"}})
    with pytest.raises(mf.Unsafe, match=UNSAFE[name]) as refused:
        mf.Manifest.decode(raw)
    said = str(refused.value)
    assert said.startswith(f"manifest entry {repr(name)[:80]} refused: ")
    assert len(said) < 200 and "\n" not in said


@pytest.mark.parametrize(
    "name", ["state.pt", "shards/__0_0.distcp", "shards/.metadata", "rank-00001.slot", "é/ü"]
)
def test_the_names_checkpoints_use_are_safe(name: str) -> None:
    raw = manifest_text(files={name: {"size": 1, "crc32": "00000000"}})
    assert list(mf.Manifest.decode(raw).files) == [name]


@pytest.mark.parametrize(
    ("changes", "said"),
    [
        ({"step": -1}, "manifest step -1 refused"),
        ({"step": 10**12}, "manifest step 1000000000000 refused"),
        ({"step": "5"}, "manifest step '5' refused"),
        ({"step": 5.0}, "manifest step 5.0 refused"),
        ({"step": True}, "manifest step True refused"),
        ({"world_size": 0}, "manifest world_size 0 refused"),
        ({"files": {"a": {"size": -1, "crc32": "00000000"}}}, "manifest entry 'a' size -1 refused"),
        ({"files": {"a": {"size": 1, "crc32": "../x"}}}, "not a hex digest"),
        ({"files": {"a": {"size": 1}}}, "one checksum"),
        ({"files": {f"f{i}": {"size": 0, "crc32": "00000000"} for i in range(100_001)}}, "most"),
    ],
)
def test_a_manifest_out_of_bounds_is_refused(changes: dict[str, Any], said: str) -> None:
    with pytest.raises(mf.Unsafe, match=said):
        mf.Manifest.decode(manifest_text(**changes))


def test_the_file_storage_touches_nothing_outside_its_root(tmp_path: Path) -> None:
    """The second line: whatever the caller, a name that is a path, or that leads out through
    a symbolic link in the root, is refused before anything is created, read or removed."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "kept").write_bytes(b"kept")
    storage = FileStorage(str(tmp_path / "root"))
    (tmp_path / "root" / "link").symlink_to(outside)
    before = tree(tmp_path)
    for name in ("../outside/evil", "../outside/kept", str(outside / "kept"), "link/kept"):
        with pytest.raises(CheckpointError, match="refused"), storage.writer(name) as handle:
            handle.write(b"evil")
        with pytest.raises(CheckpointError, match="refused"), storage.reader(name):
            pass
        with pytest.raises(CheckpointError, match="refused"):
            storage.delete(name)
    with pytest.raises(CheckpointError, match="leads outside"):
        storage.path("link/evil")
    assert tree(tmp_path) == before and (outside / "kept").read_bytes() == b"kept"


@pytest.mark.parametrize("token", [None, TOKEN])
def test_a_put_naming_a_path_is_refused_and_writes_nothing(
    tmp_path: Path, saved: Tier, token: bytes | None
) -> None:
    """The reported attack: a put whose manifest names ``../../<elsewhere>/evil.pth``; with
    a token, made by one who holds it."""
    evil = tmp_path / "elsewhere" / "evil.pth"
    with (
        server(tmp_path / "node", held_by(saved), token) as (served, inbox, refused),
        pytest.raises(OSError),
    ):
        peers.put(served.address, crafted({escaping(evil): b"payload"}), token=token)
    assert not evil.parent.exists()
    [(peer, why)] = refused
    assert peer == "127.0.0.1" and why.startswith("an unusable manifest (manifest entry ")
    assert "'..' component" in why and inbox.all_steps() == set()


@pytest.mark.parametrize("token", [None, TOKEN])
def test_a_get_from_a_hostile_server_is_refused_and_writes_nothing(
    tmp_path: Path, token: bytes | None
) -> None:
    evil = tmp_path / "elsewhere" / "evil.pth"
    hostile = crafted({"state.pt": b"fine", escaping(evil): b"payload"})
    with server(tmp_path / "hostile", holding(hostile), token) as (served, _, _):
        into = Tier(FileStorage(str(tmp_path / "node")), 1)
        with pytest.raises(peer_wire.Refused, match=r"'\.\.' component") as refused:
            peers.get(served.address, 5, into, token=token)
    assert refused.value.reason.startswith("an unusable manifest (manifest entry ")
    assert not evil.parent.exists() and tree(tmp_path / "node") == set()


def test_the_agent_counts_what_it_refuses_on_put_and_get(
    pm: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A node's agent refuses an unsafe put (logged once, a peer_refused event each), and an
    unsafe manifest a member sends it for the round's step (the member's address named)."""
    from rallypoint.agent.checkpoints.node_memory import NodeMemory
    from rallypoint.config import LaunchConfig
    from rallypoint.events import RoundInfo
    from rallypoint.interfaces import Assignment

    script = tmp_path / "train.py"
    script.write_text("")
    config = LaunchConfig.from_flags(
        pm.registry, training_script=str(script), nnodes="1:2", rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0", checkpoint_memory="16MB",
    )  # fmt: skip
    emitted: list[tuple[str, dict[str, Any]]] = []
    memory = NodeMemory(config, "127.0.0.1", lambda name, **data: emitted.append((name, data)))
    evil = tmp_path / "elsewhere" / "evil.pth"
    hostile = crafted({escaping(evil): b"payload"})
    try:
        assert memory.server is not None
        with caplog.at_level(logging.WARNING, "rallypoint.agent"):
            for _ in range(2):
                with pytest.raises(OSError):
                    peers.put(memory.server.address, hostile)
        assert emitted[0][0] == emitted[1][0] == events.PEER_REFUSED
        assert "'..' component" in emitted[0][1]["reason"]
        [said] = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
        assert said.startswith("refused a checkpoint transfer from 127.0.0.1: it gave an unusable")
        emitted.clear()
        with server(tmp_path / "member", holding(hostile)) as (member, _, _):
            offers = ({**resume.encode({5}, {}), "server": member.address}, memory.offer())
            info = RoundInfo(1, 1, 2, 2, "127.0.0.1", 1, ("a", "b"))
            memory.resume_step(Assignment(info, (1, 1), offers))
        [(name, data)] = emitted
        assert (name, data["peer"]) == (events.PEER_REFUSED, member.address)
        assert "'..' component" in data["reason"]
    finally:
        memory.close("the test ends")
    assert not evil.parent.exists()


def _two_checkpoints(directory: Path) -> FileStorage:
    storage = FileStorage(str(directory))
    for step in (5, 6):
        Checkpointer(storage=storage, rank=0, world_size=1).save(
            {"w": torch.full((2,), step)}, step
        )
    return storage


@contextlib.contextmanager
def worker_events(monkeypatch: pytest.MonkeyPatch) -> Iterator[queue.Queue[tuple[str, Any]]]:
    """What a worker in this process sends its agent."""
    delivered: queue.Queue[tuple[str, Any]] = queue.Queue()
    receiver = channel.Receiver(lambda name, data: delivered.put((name, data)))
    monkeypatch.setenv(channel.ENV, receiver.address)
    try:
        yield delivered
    finally:
        receiver.close()


def _refusal(delivered: queue.Queue[tuple[str, Any]]) -> dict[str, Any]:
    while True:
        name, data = delivered.get(timeout=10)
        if name == events.PEER_REFUSED:
            return dict(data)


def test_a_durable_checkpoint_naming_a_path_is_skipped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A manifest someone else wrote into --checkpoint-dir: the checkpoint is skipped as
    damaged, the one before it loaded, and the worker tells its agent (peer_refused)."""
    storage = _two_checkpoints(tmp_path / "checkpoints")
    path = storage.path(f"{mf.directory(6)}/{mf.MANIFEST}")
    data = json.loads(path.read_text())
    data["files"][escaping(tmp_path / "evil")] = {"size": 0, "crc32": "00000000"}
    path.write_text(json.dumps(data))
    with (
        worker_events(monkeypatch) as delivered,
        caplog.at_level(logging.WARNING, "rallypoint.checkpoint"),
    ):
        loaded = Checkpointer(storage=storage, rank=0, world_size=1).load_latest()
        refusal = _refusal(delivered)
    assert loaded is not None and loaded.step == 5
    [skipped] = loaded.skipped
    assert skipped.startswith(f"{mf.directory(6)}: manifest entry ") and "'..'" in skipped
    assert [r.getMessage() for r in caplog.records] == [
        f"checkpoint {skipped.replace(':', ' skipped:', 1)}",
        f"loaded checkpoint {mf.directory(5)} instead",
    ]
    assert refusal["peer"] == storage.url and "'..' component" in refusal["reason"]


def test_a_durable_file_linked_outside_is_skipped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A payload file that is a symbolic link out of the directory is not read, even to a
    valid checkpoint file."""
    storage = _two_checkpoints(tmp_path / "checkpoints")
    state = storage.path(f"{mf.directory(6)}/state.pt")
    elsewhere = tmp_path / "state.pt"
    state.rename(elsewhere)
    state.symlink_to(elsewhere)
    with worker_events(monkeypatch) as delivered:
        loaded = Checkpointer(storage=storage, rank=0, world_size=1).load_latest()
        refusal = _refusal(delivered)
    assert loaded is not None and loaded.step == 5
    assert "leads outside the directory" in loaded.skipped[0]
    assert refusal["peer"] == storage.url and "leads outside" in refusal["reason"]


# --- bounded work before authentication -------------------------------------------------------


@contextlib.contextmanager
def fake_server(script: Callable[[socket.socket], None]) -> Iterator[str]:
    """A server that plays ``script`` on every connection (a hostile agent's)."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    done = threading.Event()

    def serve() -> None:
        while not done.is_set():
            try:
                sock, _ = listener.accept()
            except TimeoutError:
                continue
            with sock, contextlib.suppress(OSError):
                sock.settimeout(10)
                script(sock)
                sock.shutdown(socket.SHUT_WR)
                while sock.recv(1 << 16):  # until the client is done
                    pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{listener.getsockname()[1]}"
    finally:
        done.set()
        thread.join(10)
        listener.close()


def frame(message: Any) -> bytes:
    body = message if isinstance(message, bytes) else json.dumps(message).encode()
    return struct.pack(">I", len(body)) + body


HELLO = {"nonce": "0" * 32, "token": False, "version": peer_wire.VERSION}


def read_frame(sock: socket.socket) -> bytes:
    (size,) = struct.unpack(">I", recv_exactly(sock, 4))
    return recv_exactly(sock, size)


def test_a_client_refuses_an_answer_over_its_bound_unread(tmp_path: Path) -> None:
    def script(sock: socket.socket) -> None:
        sock.sendall(frame(HELLO))
        read_frame(sock)
        sock.sendall(struct.pack(">I", 1 << 31))  # and never the body

    with fake_server(script) as address:
        began = time.monotonic()
        with pytest.raises(
            peer_wire.Refused, match=r"an answer of 2147483648 bytes, over the 4096"
        ):
            peers.get(address, 5, Tier(FileStorage(str(tmp_path / "node")), 1))
        assert time.monotonic() - began < peer_wire.TIMEOUT  # refused on the header alone


@pytest.fixture
def many_files() -> int:
    """Room for the idle connections, both of their ends, in this process."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 2 * IDLE + 512
    if hard != resource.RLIM_INFINITY and hard < wanted:
        pytest.skip(f"the hard limit of open files, {hard}, is below the {wanted} needed")
    if soft != resource.RLIM_INFINITY and soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    return wanted


IDLE = 5000


def test_idle_connections_do_not_stop_a_real_transfer(
    tmp_path: Path, saved: Tier, many_files: int
) -> None:
    """5,000 connections that never send a request: a real get and put made while they are
    open go through (the oldest waiting connections make way), the server takes no thread
    for any of them, and it still works once they are gone."""
    with server(tmp_path / "node", held_by(saved), TOKEN) as (served, inbox, refused):
        threads = threading.active_count()
        idle = []
        try:
            for _ in range(IDLE):
                sock = socket.socket()
                sock.setblocking(False)
                sock.connect_ex(("127.0.0.1", served.port))
                idle.append(sock)
            into = Tier(FileStorage(str(tmp_path / "fetched")), 1)
            assert peers.get(served.address, 5, into, token=TOKEN)[0] == 5
            with saved.hold(5) as held:
                peers.put(served.address, held, token=TOKEN)
            assert inbox.complete_steps() == {5}
            assert threading.active_count() == threads
        finally:
            for sock in idle:
                sock.close()
        again = Tier(FileStorage(str(tmp_path / "again")), 1)
        assert peers.get(served.address, 5, again, token=TOKEN)[0] == 5
    assert refused == []


def test_a_huge_request_length_is_refused_on_its_header(tmp_path: Path, saved: Tier) -> None:
    with (
        server(tmp_path / "node", held_by(saved)) as (served, _, refused),
        socket.create_connection(("127.0.0.1", served.port), timeout=10) as sock,
    ):
        json.loads(read_frame(sock))
        sock.sendall(struct.pack(">I", 0xFFFFFFFF))  # and never the body
        answer = json.loads(read_frame(sock))
        assert sock.recv(1) == b""  # closed
    assert answer == {"ok": False, "reason": "refused: it gave a request of 4294967295 bytes, "
                      "over the 4096 allowed"}  # fmt: skip
    assert refused == [("127.0.0.1", "a request of 4294967295 bytes, over the 4096 allowed")]


def test_a_request_dribbled_slower_than_the_deadline_is_dropped(
    tmp_path: Path, saved: Tier, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A byte every 50 ms keeps any per-read timeout happy; the handshake's deadline is for
    the whole request."""
    monkeypatch.setattr(peer_server, "HANDSHAKE", 0.5)
    request = frame(b" " * 100)
    with server(tmp_path / "node", held_by(saved)) as (served, _, refused):
        with socket.create_connection(("127.0.0.1", served.port), timeout=10) as sock:
            began = time.monotonic()
            read_frame(sock)
            for byte in request:  # never all of it: 2 s at this pace
                sock.send(bytes([byte]))
                if select.select([sock], [], [], 0.05)[0]:
                    break
            with contextlib.suppress(ConnectionResetError):
                assert sock.recv(1) == b""  # dropped, without an answer
            assert 0.5 <= time.monotonic() - began < 2
        with saved.hold(5) as held:  # and the server carries on
            peers.put(served.address, held)
    assert refused == []


# --- fuzzing ----------------------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)  # fmt: skip
names = st.one_of(
    st.text(max_size=40),
    st.lists(st.sampled_from(["..", ".", "", "a", "b.pt", "manifest.json", "\\", "/", "\0"]),
             max_size=6).map("/".join),
    st.sampled_from(list(UNSAFE)),
)  # fmt: skip
entries = st.one_of(
    st.fixed_dictionaries({"size": st.integers(-2, 64), "crc32": st.sampled_from(["00000000", "x"])}),
    json_values,
)  # fmt: skip
manifests = st.one_of(
    st.builds(
        lambda files, step, world: manifest_text(files=files, step=step, world_size=world),
        st.dictionaries(names, entries, max_size=4),
        st.one_of(st.integers(-2, 10**13), json_values),
        st.one_of(st.integers(-1, 3), json_values),
    ),
    json_values.map(lambda v: json.dumps(v).encode()),
    st.binary(max_size=64),
)


def test_the_manifest_reader_raises_only_damaged_and_keeps_only_safe_names() -> None:
    @FUZZ
    @given(manifests)
    def read(raw: bytes) -> None:
        try:
            manifest = mf.Manifest.decode(raw)
        except mf.Damaged:
            return
        assert 0 <= manifest.step < mf.MAX_STEP and 1 <= manifest.world_size <= mf.MAX_RANKS
        for name, entry in manifest.files.items():
            assert mf.safe_name(name) == name and 0 <= entry.size < mf.MAX_SIZE

    read()


def test_deep_json_is_damage_not_a_crash() -> None:
    with pytest.raises(mf.Damaged, match="unreadable"):
        mf.Manifest.decode(b"[" * 100_000)


def test_received_names_stay_under_the_root(tmp_path: Path) -> None:
    """Whatever the names, a copy received writes under its tier's root or not at all."""
    base = tmp_path / "base"
    outside = base / "outside"
    outside.mkdir(parents=True)
    (base / "root").mkdir()
    (base / "root" / "link").symlink_to(outside)
    tier = Tier(FileStorage(str(base / "root")), 1)

    @FUZZ
    @given(st.dictionaries(names, st.binary(max_size=8), min_size=1, max_size=3))
    def receive(files: dict[str, bytes]) -> None:
        held = crafted(files)
        with contextlib.suppress(mf.Damaged, CheckpointError):
            tier.receive(held.manifest, held.open)
        assert tree(outside) == set()
        assert all(p.split("/")[0] in ("outside", "root") for p in tree(base))

    receive()


def _exchange(port: int, payload: bytes, shut: bool = True) -> bytes:
    """Send ``payload`` after the hello; what the server sends back before it closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        read_frame(sock)
        with contextlib.suppress(OSError):
            sock.sendall(payload)
            if shut:
                sock.shutdown(socket.SHUT_WR)
        received = b""
        with contextlib.suppress(OSError):
            while chunk := sock.recv(1 << 16):
                received += chunk
        return received


requests = st.fixed_dictionaries(
    {},
    optional={
        "op": st.one_of(st.sampled_from(["get", "put"]), json_values),
        "nonce": st.one_of(st.just("1" * 32), json_values),
        "rank": st.one_of(st.integers(-2, 2**21), json_values),
        "sharded": st.one_of(st.booleans(), json_values),
        "step": st.one_of(st.integers(-2, 10**13), json_values),
        "manifest_sha256": st.one_of(st.just("a" * 64), json_values),
        "proof": json_values,
    },
)


@pytest.mark.parametrize("token", [None, TOKEN])
def test_the_server_survives_whatever_a_client_sends(
    tmp_path: Path, saved: Tier, caplog: pytest.LogCaptureFixture, token: bytes | None
) -> None:
    """Arbitrary bytes, frames of any declared length, requests of any fields and proofs,
    manifests of any names, over a real socket: refused or served, no error escapes
    (logged), nothing is written outside the inbox, and a length over a bound is refused
    on its header (without a token; with one, the request's proof is refused first)."""
    base = tmp_path / "base"
    before = tree(tmp_path)

    def put_with(raw: bytes, body: bytes) -> bytes:
        request = {"op": "put", "nonce": "1" * 32, "rank": 0, "sharded": False,
                   "manifest_sha256": hashlib.sha256(raw).hexdigest()}  # fmt: skip
        return frame(request) + frame(raw) + body

    payloads = st.one_of(
        st.binary(max_size=64),
        st.builds(lambda r: frame(r), requests),
        st.builds(lambda v: frame(v), json_values),
        st.builds(put_with, manifests, st.binary(max_size=64)),
    )
    with caplog.at_level(logging.ERROR), server(base, held_by(saved), token) as (served, _, _):

        @FUZZ
        @given(payloads)
        def send(payload: bytes) -> None:
            _exchange(served.port, payload)

        send()
        for size in (peer_wire.SMALL + 1, 1 << 31, 0xFFFFFFFF):  # refused on the header alone
            answer = _exchange(served.port, struct.pack(">I", size), shut=False)
            assert b"over the 4096 allowed" in answer
        request = {"op": "put", "nonce": "1" * 32, "rank": 0, "sharded": False,
                   "manifest_sha256": "a" * 64}  # fmt: skip
        over = frame(request) + struct.pack(">I", peer_wire.MANIFEST_MOST + 1)
        refusal = b"over the 16777216 allowed" if token is None else b"token is required"
        assert refusal in _exchange(served.port, over, shut=False)
        into = Tier(FileStorage(str(tmp_path / "fetched")), 1)
        assert peers.get(served.address, 5, into, token=token)[0] == 5  # still serving
    assert [r.getMessage() for r in caplog.records if r.name.startswith("rallypoint")] == []
    made = tree(tmp_path) - before
    assert all(p == "base" or p.startswith(("base/inbox", "fetched")) for p in made), made


def test_the_client_survives_whatever_a_server_sends(tmp_path: Path) -> None:
    """A hostile server's arbitrary hello, answer, manifest and files: ``get`` fetches a
    safe copy or raises an OSError or CheckpointError, and writes nothing outside its tier."""
    script: list[bytes] = [b""]
    into = Tier(FileStorage(str(tmp_path / "base" / "node")), 1)

    def play(sock: socket.socket) -> None:
        sock.sendall(script[0])

    def answering(raw: bytes, files: bytes) -> bytes:
        answer = {"ok": True, "manifest_sha256": hashlib.sha256(raw).hexdigest()}
        return frame(HELLO) + frame(answer) + frame(raw) + files

    scripts = st.one_of(
        st.binary(max_size=64),
        st.builds(lambda v: frame(v), json_values),
        st.builds(lambda v, rest: frame(HELLO) + frame(v) + rest, json_values, st.binary(max_size=32)),
        st.builds(answering, manifests, st.binary(max_size=64)),
    )  # fmt: skip
    with fake_server(play) as address:

        @FUZZ
        @given(scripts)
        def fetch(played: bytes) -> None:
            script[0] = played
            with contextlib.suppress(OSError, CheckpointError):
                peers.get(address, 5, into)

        fetch()
    outside = {p for p in tree(tmp_path) if not p.startswith(os.path.join("base", "node"))}
    assert outside == {"base"}
