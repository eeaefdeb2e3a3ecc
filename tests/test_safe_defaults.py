"""Safe defaults: an agent that was to host the c10d store joins only a store of its own
job when it finds the port taken; a job of several nodes that serves memory checkpoints
without a job token says so; the run's directory under --log-dir is private."""

from __future__ import annotations

import select
import stat
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from launch import exit_codes, rallypoint, start_agent, worker
from servers import free_port

pytestmark = pytest.mark.usefixtures("agent_tmpdir")

Squat = Callable[..., None]

TOKEN = "0123456789abcdef0123456789abcdef"
#: Another program on the store's port: a TCPStore of its own (``tcpstore``), holding the
#: key argv[3] = argv[4] if given, or a plain socket that never answers (``plain``).
SQUATTER = """
import datetime, socket, sys, time
kind, port = sys.argv[1], int(sys.argv[2])
if kind == "tcpstore":
    import torch.distributed as dist
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                          use_libuv=True, timeout=datetime.timedelta(seconds=30))
    if len(sys.argv) > 3:
        store.set(sys.argv[3], sys.argv[4])
else:
    listener = socket.create_server(("127.0.0.1", port))
print("up", flush=True)
time.sleep(300)
"""


@pytest.fixture
def squat() -> Iterator[Squat]:
    """``squat(kind, port, *key_value)``: a squatter on ``port`` until the test ends."""
    started: list[subprocess.Popen[str]] = []

    def start(kind: str, port: int, *key_value: str) -> None:
        process = subprocess.Popen(
            [sys.executable, "-c", SQUATTER, kind, str(port), *key_value],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        started.append(process)
        assert process.stdout is not None
        ready, _, _ = select.select([process.stdout], [], [], 60)
        assert ready and process.stdout.readline().strip() == "up", "the squatter did not start"

    yield start
    for process in started:
        process.kill()
        process.communicate(timeout=30)


def refused(port: int) -> str:
    return (
        f"rallypoint: error: port {port} on this host is taken by a process that is not an "
        f"agent of this job"
    )


def c10d(port: int, *conf: str) -> subprocess.CompletedProcess[str]:
    """A would-be host: an agent of a job of 2 nodes whose endpoint is this host's ``port``."""
    return rallypoint(
        "run", "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "job",
        "--rdzv-conf", ",".join(["join_timeout=60", *conf]), worker("steps.py"), "1",
        timeout=60,
    )  # fmt: skip


@pytest.mark.parametrize("kind", ["tcpstore", "plain"])
def test_a_would_be_host_refuses_another_programs_port(squat: Squat, kind: str) -> None:
    port = free_port()
    squat(kind, port)
    result = c10d(port)
    assert result.returncode == 1, result.stderr
    [line] = [line for line in result.stderr.splitlines() if "rallypoint: error:" in line]
    assert line.startswith(refused(port))
    assert line.endswith("free the port, or choose another port with --rdzv-endpoint")
    assert "Traceback" not in result.stderr


def test_with_a_token_an_unsealed_mark_is_refused(squat: Squat, tmp_path: Path) -> None:
    """A squatter that writes the mark, unsealed, is no agent of a job with a token."""
    token = tmp_path / "token"
    token.write_text(TOKEN)
    token.chmod(0o600)
    port = free_port()
    squat("tcpstore", port, "/rallypoint/job~host", "a node")
    result = c10d(port, f"token_file={token}")
    assert result.returncode == 1, result.stderr
    assert refused(port) in result.stderr and "a mark it cannot prove" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_static_node_0_refuses_another_programs_port(squat: Squat) -> None:
    port = free_port()
    squat("tcpstore", port)
    result = rallypoint(
        "run", "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", "0",
        "--master-addr", "127.0.0.1", "--master-port", str(port),
        worker("steps.py"), "1", timeout=60,
    )  # fmt: skip
    assert result.returncode == 1, result.stderr
    assert refused(port) in result.stderr
    assert "choose another port with --master-port" in result.stderr
    assert "Traceback" not in result.stderr


# --- a peer port without a token, and agents of one host that share the store ----------------

WARNING = "without a job token: any process that reaches this port can fetch or push a checkpoint"


@pytest.mark.parametrize("with_token", [False, True])
def test_a_job_of_two_nodes_without_a_token_says_its_peer_port_is_open(
    tmp_path: Path, with_token: bool
) -> None:
    """Two agents of one host: the second finds the store's port taken and joins the first
    (its mark, sealed when there is a token); each serves memory checkpoints, and says so
    without a token."""
    conf = "last_call_timeout=1"
    if with_token:
        token = tmp_path / "token"
        token.write_text(TOKEN)
        token.chmod(0o600)
        conf += f",token_file={token}"
    port = free_port()
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    flags = ("--checkpoint-memory", "16MB", worker("steps.py"), "1")
    endpoint = f"127.0.0.1:{port}"
    agents = [
        start_agent("c10d", endpoint, "job", "2", *flags, conf=conf, log=log, nproc=1)
        for log in logs
    ]
    codes = exit_codes(agents, timeout=120)
    texts = [log.read_text() for log in logs]
    assert codes == [0, 0], texts
    for text in texts:
        assert text.count(WARNING) == (0 if with_token else 1), text
        assert "done rank=" in text
    if not with_token:
        [line] = [line for line in texts[0].splitlines() if WARNING in line]
        assert "--rdzv-conf token_file=PATH or RALLYPOINT_JOB_TOKEN" in line
    joined = "another agent of this host (node "
    assert sum(text.count(joined) for text in texts) == 1  # the one that did not host


# --- the run's directory -----------------------------------------------------------------------


def test_the_runs_directory_under_a_shared_log_dir_is_private(tmp_path: Path) -> None:
    shared = tmp_path / "logs"
    shared.mkdir()
    shared.chmod(0o755)
    result = rallypoint(
        "run", "--standalone", "--nproc-per-node", "1", "--log-dir", str(shared),
        "--redirects", "3", worker("steps.py"), "0",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    [run] = shared.iterdir()
    assert stat.S_IMODE(run.stat().st_mode) == 0o700
    assert stat.S_IMODE(shared.stat().st_mode) == 0o755  # --log-dir itself is left as it was
    assert (run / "attempt_0" / "0" / "stdout.log").exists()


def test_a_new_log_dir_is_made_and_only_the_runs_directory_is_private(tmp_path: Path) -> None:
    logs = tmp_path / "new" / "logs"
    result = rallypoint(
        "run", "--standalone", "--nproc-per-node", "1", "--log-dir", str(logs),
        worker("steps.py"), "0",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    [run] = logs.iterdir()
    assert stat.S_IMODE(run.stat().st_mode) == 0o700
    assert stat.S_IMODE(logs.stat().st_mode) != 0o700
