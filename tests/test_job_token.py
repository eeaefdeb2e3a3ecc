"""The job's token: where an agent reads it, and the checkpoint transfers between agents
that it authenticates (rallypoint.agent.peers). A stray client without it can neither
fetch a node's checkpoint nor push one into it; a stray server cannot feed one to a node."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from launch import rallypoint, worker
from rallypoint.agent import peers
from rallypoint.checkpoint import Checkpointer, FileStorage
from rallypoint.checkpoint.tier import Held, Tier
from rallypoint.config import TOKEN_ENV, job_token
from rallypoint.errors import UsageError
from rallypoint.worker.channel import Receiver

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
) -> Iterator[tuple[peers.PeerServer, Tier, list[tuple[str, str]]]]:
    inbox = Tier(FileStorage(str(tmp_path / "inbox")), 1)
    refused: list[tuple[str, str]] = []
    served = peers.PeerServer(
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


def test_workers_do_not_inherit_the_token() -> None:
    from types import SimpleNamespace

    from rallypoint.agent.environment import job_environment

    config = SimpleNamespace(nproc_per_node=1)  # all job_environment reads
    environment = job_environment(config, {TOKEN_ENV: "s3cret", "PATH": "/bin"})  # type: ignore[arg-type]
    assert TOKEN_ENV not in environment and environment["PATH"] == "/bin"


@pytest.mark.skipif(os.geteuid() != 0, reason="sending as another user needs root")
def test_the_worker_channel_takes_nothing_from_another_user() -> None:
    """The agent's worker channel is an abstract Unix socket, which has no file mode: it
    drops what a process of another user sends, and takes its own user's."""
    delivered: list[dict[str, object]] = []
    receiver = Receiver(lambda name, data: delivered.append(data))
    send = (
        "import json, socket, sys; s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM); "
        "s.sendto(json.dumps({'event': 'checkpoint_saved', 'step': int(sys.argv[2])}).encode(), "
        "'\\0' + sys.argv[1])"
    )
    try:
        # The system's Python (the test's may sit where nobody may read), from "/".
        python = shutil.which("python3", path="/usr/bin:/bin") or sys.executable
        stranger = subprocess.run(
            [python, "-c", send, receiver.address, "1"],
            user=65534, cwd="/", timeout=30, capture_output=True, text=True,
        )  # fmt: skip
        assert stranger.returncode == 0, stranger.stderr
        own = subprocess.run([sys.executable, "-c", send, receiver.address, "2"], timeout=30)
        assert own.returncode == 0
        deadline = time.monotonic() + 10
        while not delivered and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)
    finally:
        receiver.close()
    assert [data["step"] for data in delivered] == [2]
