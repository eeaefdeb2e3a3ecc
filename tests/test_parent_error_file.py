"""torchrun's parent error file: with ``TORCHELASTIC_ERROR_FILE`` set in the launcher's
environment, the root cause of a job that fails is written there in torch's JSON format, as
tools such as TorchX and job operators expect; measured side by side with torchrun."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from launch import rallypoint, torchrun, worker
from servers import free_port


def parent_file(tmp_path: Path, launcher: str, *args: str) -> dict[str, Any]:
    path = tmp_path / f"{launcher}.json"
    run = {"rallypoint": lambda *a, **k: rallypoint("run", *a, **k), "torchrun": torchrun}
    result = run[launcher](*args, env={"TORCHELASTIC_ERROR_FILE": str(path)})
    assert result.returncode == 1, result.stderr
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def test_the_root_cause_is_copied_as_torchrun_copies_it(tmp_path: Path) -> None:
    args = ("--nproc-per-node", "2", worker("record_raises.py"))
    ours = parent_file(tmp_path, "rallypoint", *args)["message"]
    theirs = parent_file(tmp_path, "torchrun", "--standalone", *args)["message"]
    assert ours.keys() == theirs.keys() == {"message", "extraInfo", "errorCode"}
    assert ours["message"] == theirs["message"] == "ValueError: shard 1 is missing"
    assert ours["errorCode"] == theirs["errorCode"] == 1
    assert ours["extraInfo"].keys() == theirs["extraInfo"].keys()
    assert 'raise ValueError("shard 1 is missing")' in ours["extraInfo"]["py_callstack"]


def test_a_worker_without_an_error_file_is_described(tmp_path: Path) -> None:
    """torchrun writes nothing then; rallypoint writes what it knows, in the same format."""
    script = ("--fault", "sigkill", "--at", "1", "--steps", "3")
    message = parent_file(
        tmp_path, "rallypoint", "--nproc-per-node", "2", worker("faulty.py"), str(tmp_path), *script
    )["message"]
    assert (message["message"], message["errorCode"]) == ("killed by SIGKILL", -9)
    assert message["extraInfo"]["timestamp"].isdigit()


def test_an_agent_failure_is_recorded_as_torchrun_records_its_own(tmp_path: Path) -> None:
    message = parent_file(
        tmp_path, "rallypoint", "--nnodes", "2", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-conf", "join_timeout=1",
        worker("record_raises.py"),
    )["message"]  # fmt: skip
    assert message["message"].startswith("RendezvousTimeout: rendezvous round 0: fewer than 2")
