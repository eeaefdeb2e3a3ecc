"""The environment of a worker process: exactly torchrun's, plus ``RALLYPOINT_*``.

A script written for torchrun reads the same variables with the same values. The one
deliberate difference is ``TORCHELASTIC_USE_AGENT_STORE=False``: the agent holds no
TCPStore (it does not import torch), so rank 0 hosts the store on a master port that is
new for every attempt, and restarted workers never see keys of an earlier attempt.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from rallypoint.config import LaunchConfig
from rallypoint.rendezvous.handler import Assignment


@dataclass(frozen=True)
class WorkerSpec:
    """Where one worker stands in the job."""

    local_rank: int
    rank: int
    error_file: str


def worker_environment(
    config: LaunchConfig,
    assignment: Assignment,
    worker: WorkerSpec,
    *,
    run_id: str,
    node_id: str,
    restart_count: int,
    events_socket: str | None = None,
    metrics_dir: str | None = None,
    base: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The full environment of ``worker`` for this round and attempt."""
    env = dict(os.environ if base is None else base)
    info = assignment.info
    env.update(
        {
            "RANK": str(worker.rank),
            "LOCAL_RANK": str(worker.local_rank),
            "WORLD_SIZE": str(info.world_size),
            "LOCAL_WORLD_SIZE": str(config.nproc_per_node),
            "GROUP_RANK": str(info.group_rank),
            "GROUP_WORLD_SIZE": str(info.group_world_size),
            "ROLE_RANK": str(worker.rank),
            "ROLE_NAME": config.role,
            "ROLE_WORLD_SIZE": str(info.world_size),
            "MASTER_ADDR": info.master_addr,
            "MASTER_PORT": str(info.master_port),
            "TORCHELASTIC_RESTART_COUNT": str(restart_count),
            "TORCHELASTIC_MAX_RESTARTS": str(config.max_restarts),
            "TORCHELASTIC_RUN_ID": run_id,
            "TORCHELASTIC_USE_AGENT_STORE": "False",
            "TORCHELASTIC_ERROR_FILE": worker.error_file,
            "TORCHELASTIC_SIGNALS_TO_HANDLE": ",".join(config.signals_to_handle),
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
            "RALLYPOINT_RUN_ID": run_id,
            "RALLYPOINT_NODE_ID": node_id,
            "RALLYPOINT_RENDEZVOUS_ROUND": str(info.round),
            # The worker's place on the node, also when --virtual-local-rank makes
            # LOCAL_RANK 0 everywhere: the agent's watchdog and events tell workers by it.
            "RALLYPOINT_LOCAL_RANK": str(worker.local_rank),
        }
    )
    if config.virtual_local_rank:
        # torchrun's: each worker sees only its device, as device 0.
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        devices = [d.strip() for d in visible.split(",")] if visible is not None else None
        env["LOCAL_RANK"] = "0"
        env["CUDA_VISIBLE_DEVICES"] = (
            devices[worker.local_rank] if devices is not None else str(worker.local_rank)
        )
    if config.nproc_per_node > 1 and "OMP_NUM_THREADS" not in env:
        # torchrun's choice: many workers each using every core oversubscribe the host.
        env["OMP_NUM_THREADS"] = "1"
    if config.checkpoint_dir:
        env["RALLYPOINT_CHECKPOINT_URL"] = config.checkpoint_dir
    if events_socket:
        env["RALLYPOINT_EVENTS_SOCKET"] = events_socket  # see rallypoint.worker_channel
    if metrics_dir:
        env["RALLYPOINT_METRICS_DIR"] = metrics_dir  # see rallypoint.metrics
    # rallypoint.progress sends heartbeats only when this is set (the agent's own
    # RALLYPOINT_WATCHDOG_TIMEOUT, the flag's variable, must not reach them otherwise).
    env.pop("RALLYPOINT_WATCHDOG_TIMEOUT", None)
    if config.watchdog_timeout:
        env["RALLYPOINT_WATCHDOG_TIMEOUT"] = f"{config.watchdog_timeout:g}"
    return env


def worker_command(config: LaunchConfig) -> list[str]:
    """The command line every worker runs, as torchrun builds it."""
    import sys

    script, args = config.training_script, list(config.training_script_args)
    if config.run_path:
        runner = (
            "import runpy, sys; sys.argv = sys.argv[1:]; "
            "runpy.run_path(sys.argv[0], run_name='__main__')"
        )
        return [sys.executable, "-u", "-c", runner, script, *args]
    if config.no_python:
        return [script, *args]
    if config.module:
        return [sys.executable, "-u", "-m", script, *args]
    return [sys.executable, "-u", script, *args]
