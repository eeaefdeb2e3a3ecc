"""``preflight`` counts everything ``--checkpoint-memory`` keeps in node shared memory: the
workers' arenas, and in a job of several nodes the peer tier, which has a budget of its own.

The decision and its sentence are ``shared_memory_refusal``'s, driven here with numbers;
``_check_shared_memory`` and ``preflight`` read a real ``statvfs``. The sizes counted are
the agent's own: a real ``NodeMemory`` and a real worker environment say the same."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest

from rallypoint.config import SHARED_MEMORY, LaunchConfig
from rallypoint.errors import UsageError
from rallypoint.plugins import get_plugin_manager
from rallypoint.preflight import (
    _check_shared_memory,
    preflight,
    shared_memory_refusal,
    shared_memory_uses,
)

SHM_HINT = "give less, or a larger /dev/shm (docker run --shm-size, a Kubernetes emptyDir of medium Memory)."


@pytest.fixture
def script(tmp_path: Path) -> str:
    path = tmp_path / "train.py"
    path.write_text("")
    return str(path)


def launch(script: str, **flags: Any) -> LaunchConfig:
    return LaunchConfig.from_flags(get_plugin_manager().registry, training_script=script, **flags)


def several(script: str, size: str) -> LaunchConfig:
    """A node of a job of one to two nodes, ``--checkpoint-memory size``."""
    return launch(
        script, nnodes="1:2", rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0",
        checkpoint_memory=size,
    )  # fmt: skip


def test_a_job_of_several_nodes_needs_room_for_a_peer_s_copies_too(script: str) -> None:
    """4 GB for the arenas and 4 GB for the peer tier: 7 GB free is not enough, and the
    sentence names each and its size."""
    config = several(script, "4GB")
    assert shared_memory_refusal(config, free=8 * 10**9, total=16 * 10**9) is None
    assert shared_memory_refusal(config, free=7 * 10**9, total=16 * 10**9) == (
        "--checkpoint-memory 4GB: needs 8.0 GB of shared memory (4.0 GB for this node's "
        "memory checkpoints, 4.0 GB for the copies a peer node sends it), and /dev/shm has "
        f"7.0 GB free of 16.0 GB; {SHM_HINT}"
    )


def test_a_job_of_one_node_keeps_no_peer_s_copies(script: str) -> None:
    """No other node can send it anything: the arenas alone, in the sentence of before."""
    config = launch(script, checkpoint_memory="4GB")
    assert [use.size for use in shared_memory_uses(config)] == [4 * 10**9]
    assert shared_memory_refusal(config, free=4 * 10**9, total=8 * 10**9) is None
    assert shared_memory_refusal(config, free=4 * 10**9 - 1, total=8 * 10**9, path="/shm") == (
        f"--checkpoint-memory 4GB: needs 4.0 GB of shared memory, and /shm has 4.0 GB free "
        f"of 8.0 GB; {SHM_HINT}"
    )
    assert shared_memory_uses(launch(script)) == ()


@pytest.mark.skipif(not os.path.isdir(SHARED_MEMORY), reason=f"no {SHARED_MEMORY} here")
def test_preflight_counts_the_peer_tier_against_the_real_shared_memory(script: str) -> None:
    """Two thirds of what /dev/shm has free fits for one node, and not twice over."""
    stats = os.statvfs(SHARED_MEMORY)
    free = stats.f_bavail * stats.f_frsize
    if free < 3 << 20:
        pytest.skip(f"{SHARED_MEMORY} has almost nothing free")
    size = str(free * 2 // 3)
    preflight(launch(script, checkpoint_memory=size))
    with pytest.raises(
        UsageError, match=r"^--checkpoint-memory \S+: needs .* for the copies a peer"
    ):
        preflight(several(script, size))


def test_the_check_reads_the_directory_it_is_given(script: str, tmp_path: Path) -> None:
    """A real statvfs: of a directory that is there (three fifths of what it has free
    fits once, not twice), and of one that is not."""
    stats = os.statvfs(tmp_path)
    size = str(stats.f_bavail * stats.f_frsize * 3 // 5)
    _check_shared_memory(launch(script, checkpoint_memory=size), str(tmp_path))
    with pytest.raises(
        UsageError, match=rf"^--checkpoint-memory \S+: needs .*, and {re.escape(str(tmp_path))} has"
    ):
        _check_shared_memory(several(script, size), str(tmp_path))
    with pytest.raises(
        UsageError, match=r"needs shared memory at .*nowhere, which this node lacks"
    ):
        _check_shared_memory(several(script, "1MB"), str(tmp_path / "nowhere"))


@pytest.mark.parametrize("nnodes", ["1", "1:2"])
def test_what_is_counted_is_what_the_agent_gives(script: str, nnodes: str) -> None:
    """The arenas' budget is the workers' RALLYPOINT_MEMORY_TIER_BYTES, the peer tier's the
    one ``NodeMemory`` gives it, and there is a peer tier to count only where the agent
    serves its peers."""
    from rallypoint.agent.checkpoints.node_memory import NodeMemory
    from rallypoint.agent.processes.environment import worker_environment
    from rallypoint.events import RoundInfo
    from rallypoint.interfaces import Assignment
    from rallypoint.worker import variables

    config = launch(
        script, nnodes=nnodes, rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0",
        checkpoint_memory="16MB",
    )  # fmt: skip
    arenas, *peer = shared_memory_uses(config)
    assignment = Assignment(RoundInfo(0, 0, 1, 1, "127.0.0.1", 1, ("a",)), (1,))
    environ = worker_environment(
        config, assignment, 0, "error.json", node_id="a", restart_count=0,
        memory_tier_dir="/dev/shm/x", base={},
    )  # fmt: skip
    assert int(environ[variables.CHECKPOINT_MEMORY_BYTES]) == arenas.size
    memory = NodeMemory(config, "127.0.0.1", lambda *args, **kwargs: None)
    try:
        assert [memory.peer.budget] * (memory.server is not None) == [use.size for use in peer]
    finally:
        memory.close("test over")
