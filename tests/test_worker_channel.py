"""The worker channel (rallypoint.worker.channel): the agent's Unix datagram socket lies in a
directory only the job's user may enter, so another user can neither reach it nor fill its
queue; what does reach it from another user is dropped (SO_PASSCRED), and nothing a sender
does, an empty datagram included, stops the agent's receiving thread."""

from __future__ import annotations

import json
import os
import queue
import select
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from launch import RALLYPOINT, clean_environment, rallypoint
from rallypoint.worker import channel
from rallypoint.worker.channel import Receiver

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="sending as another user needs root")
#: The user that plays another user of the host.
NOBODY = 65534

#: Run as NOBODY: send an empty datagram (``empty``) or a well-formed event (``event``) to
#: ``argv[1]``, print what the send did ("sent" or the errno), and end; or (``flood``) go
#: on sending events until killed.
STRANGER = """
import errno, json, socket, sys
address, how = sys.argv[1], sys.argv[2]
target = address if address.startswith("/") else "\\0" + address  # a path, or an abstract name
s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
s.setblocking(False)
fake = json.dumps({"event": "checkpoint_saved", "step": -1}).encode()
message = b"" if how == "empty" else fake
def send():
    try:
        s.sendto(message, target)
        return "sent"
    except BlockingIOError:
        return "full"
    except OSError as error:
        return errno.errorcode.get(error.errno, str(error.errno))
print(send(), flush=True)
if how == "flood":
    while True:
        send()
"""


def stranger(address: str, how: str) -> subprocess.Popen[str]:
    # The system's Python (the test's may sit where nobody may read), from "/".
    python = shutil.which("python3", path="/usr/bin:/bin") or sys.executable
    return subprocess.Popen(
        [python, "-c", STRANGER, address, how],
        user=NOBODY, cwd="/", stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def first_line(process: subprocess.Popen[str], timeout: float = 30) -> str:
    assert process.stdout is not None
    ready, _, _ = select.select([process.stdout], [], [], timeout)
    assert ready, "the stranger said nothing"
    return process.stdout.readline().strip()


def stranger_sends(address: str, how: str) -> str:
    """What a single send of NOBODY's process to ``address`` did: sent, or the errno."""
    process = stranger(address, how)
    try:
        out, err = process.communicate(timeout=30)
    finally:
        process.kill()
    assert process.returncode == 0, err
    return out.strip()


@pytest.fixture
def received(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Receiver, queue.Queue[Any]]]:
    """A receiver, and the events it delivers; this process sends to it as a worker."""
    delivered: queue.Queue[Any] = queue.Queue()
    receiver = Receiver(lambda name, data: delivered.put((name, data)))
    monkeypatch.setenv(channel.ENV, receiver.address)
    yield receiver, delivered
    receiver.close()


def own_send(address: str, message: bytes) -> None:
    target = address if address.startswith("/") else "\0" + address  # as STRANGER's
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.sendto(message, target)


def steps(delivered: queue.Queue[Any], count: int) -> list[int]:
    return [delivered.get(timeout=10)[1]["step"] for _ in range(count)]


def test_an_empty_datagram_of_the_jobs_user_stops_nothing(
    received: tuple[Receiver, queue.Queue[Any]],
) -> None:
    receiver, delivered = received
    own_send(receiver.address, b"")
    channel.send("checkpoint_saved", step=1)
    channel.send("checkpoint_saved", step=2)
    assert steps(delivered, 2) == [1, 2]


@needs_root
def test_what_another_user_sends_is_dropped_and_stops_nothing(
    received: tuple[Receiver, queue.Queue[Any]],
) -> None:
    """The second line of defence: were the socket within another user's reach, what he
    sends, an empty datagram or a well-formed event, is dropped (SO_PASSCRED)."""
    receiver, delivered = received
    # Open it up, as if the first line had failed (an abstract name has no mode to open).
    if receiver.address.startswith("/"):
        os.chmod(os.path.dirname(receiver.address), 0o711)
        os.chmod(receiver.address, 0o777)
    assert stranger_sends(receiver.address, "empty") == "sent"
    assert stranger_sends(receiver.address, "event") == "sent"
    channel.send("checkpoint_saved", step=1)
    channel.send("checkpoint_saved", step=2)
    assert steps(delivered, 2) == [1, 2]
    with pytest.raises(queue.Empty):
        delivered.get(timeout=0.2)  # nothing of the stranger's came after ours either


@needs_root
def test_another_user_cannot_send_at_all(received: tuple[Receiver, queue.Queue[Any]]) -> None:
    receiver, _ = received
    assert stranger_sends(receiver.address, "event") == "EACCES"


@needs_root
def test_another_users_flood_loses_none_of_the_jobs_events(
    received: tuple[Receiver, queue.Queue[Any]],
) -> None:
    """Four processes of another user send as fast as they can while a worker sends 200
    events, one after the other: all 200 arrive (the kernel's queue of a datagram socket
    is short, net.unix.max_dgram_qlen, and a worker's send does not wait)."""
    receiver, delivered = received
    flood = [stranger(receiver.address, "flood") for _ in range(4)]
    try:
        for process in flood:
            first_line(process)
        for step in range(200):
            channel.send("checkpoint_saved", step=step)
            name, data = delivered.get(timeout=5)
            assert (name, data["step"]) == ("checkpoint_saved", step)
        assert all(process.poll() is None for process in flood)  # it flooded all along
    finally:
        for process in flood:
            process.kill()
            process.communicate(timeout=30)


# --- where the socket lies ---------------------------------------------------------------


def test_the_socket_lies_in_a_directory_of_the_users_alone_removed_on_close() -> None:
    receiver = Receiver(lambda name, data: None)
    try:
        directory = os.stat(receiver.directory)
        assert stat.S_IMODE(directory.st_mode) == 0o700 and directory.st_uid == os.getuid()
        assert stat.S_ISSOCK(os.stat(receiver.address).st_mode)
        assert os.path.dirname(receiver.address) == receiver.directory
    finally:
        receiver.close()
    assert not os.path.exists(receiver.directory)
    receiver.close()  # twice is harmless


def test_a_deep_tmpdir_puts_the_socket_in_tmp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A socket's path is at most 107 bytes (sun_path)."""
    deep = tmp_path / ("d" * 100)
    deep.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    delivered: queue.Queue[Any] = queue.Queue()
    receiver = Receiver(lambda name, data: delivered.put(data))
    try:
        assert receiver.address.startswith(channel.FALLBACK_DIR + "/rp-")
        assert len(receiver.address) <= channel.MAX_PATH
        assert list(deep.iterdir()) == []  # the directory tried first is gone
        monkeypatch.setenv(channel.ENV, receiver.address)
        channel.send("checkpoint_saved", step=3)
        assert delivered.get(timeout=10)["step"] == 3
    finally:
        receiver.close()


def test_what_was_sent_before_close_is_still_delivered() -> None:
    delivered: list[int] = []
    receiver = Receiver(lambda name, data: delivered.append(data["step"]))
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        for step in range(5):  # under the kernel's queue length (10 by default)
            sock.sendto(json.dumps({"event": "checkpoint_saved", "step": step}).encode(),
                        receiver.address)  # fmt: skip
    receiver.close()
    assert delivered == [0, 1, 2, 3, 4]


# --- real agents: cold and warm workers, and an agent killed -----------------------------

#: A worker that reports a save through the channel, says where the channel is, and ends
#: (or sleeps, given "sleep").
REPORTER = """
import os, sys, time
from rallypoint.worker import channel
channel.send("checkpoint_saved", step=7, seconds=0.5)
print("socket:" + os.environ[channel.ENV], flush=True)
if "sleep" in sys.argv[1:]:
    time.sleep(600)
"""


@pytest.mark.usefixtures("agent_tmpdir")
@pytest.mark.parametrize("warm", ["on", "off"])
def test_cold_and_warm_workers_reach_their_agent(warm: str, tmp_path: Path) -> None:
    script = tmp_path / "reporter.py"
    script.write_text(REPORTER)
    log = tmp_path / "events.jsonl"
    result = rallypoint(
        "run", "--standalone", "--nproc-per-node", "2", "--warm-start", warm,
        "--event-log", str(log), str(script),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in log.read_text().splitlines()]
    saved = [r for r in records if r["event"] == "checkpoint_saved"]
    assert sorted(r["local_rank"] for r in saved) == [0, 1] and saved[0]["step"] == 7
    sockets = {line.split(":", 1)[1] for line in result.stdout.splitlines() if "socket:" in line}
    assert len(sockets) == 1
    assert not os.path.exists(os.path.dirname(sockets.pop()))  # removed by the agent


def test_an_agent_killed_leaves_no_socket_behind(agent_tmpdir: Path, tmp_path: Path) -> None:
    """The agent's keeper removes the socket's directory when the agent is SIGKILLed."""
    script = tmp_path / "reporter.py"
    script.write_text(REPORTER)
    out = tmp_path / "out"
    with out.open("w") as handle:
        agent = subprocess.Popen(
            [RALLYPOINT, "run", "--standalone", "--nproc-per-node", "1", str(script), "sleep"],
            env=clean_environment({"TMPDIR": str(agent_tmpdir)}), stdout=handle,
            stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while "socket:" not in out.read_text():  # its output: no event to await
            assert agent.poll() is None and time.monotonic() < deadline, out.read_text()
            time.sleep(0.05)
        address = out.read_text().split("socket:", 1)[1].split()[0]
        assert os.path.exists(address)
    finally:
        agent.send_signal(signal.SIGKILL)
        agent.wait(30)
    deadline = time.monotonic() + 30
    while os.path.exists(os.path.dirname(address)):
        assert time.monotonic() < deadline, "the socket's directory outlived its agent"
        time.sleep(0.05)
