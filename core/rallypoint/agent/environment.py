"""The environment of a worker process: exactly torchrun's, plus ``RALLYPOINT_*``.

A script written for torchrun reads the same variables with the same values. The one
deliberate difference is ``TORCHELASTIC_USE_AGENT_STORE=False``: the agent holds no
TCPStore (it does not import torch), so rank 0 hosts the store on a master port that is
new for every attempt, and restarted workers never see keys of an earlier attempt.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from rallypoint.config import LaunchConfig
from rallypoint.interfaces import Assignment
from rallypoint.worker import env


def worker_environment(
    config: LaunchConfig,
    assignment: Assignment,
    local_rank: int,
    error_file: str,
    *,
    node_id: str,
    restart_count: int,
    events_socket: str | None = None,
    metrics_dir: str | None = None,
    base: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The full environment of the worker ``local_rank`` for this round and attempt."""
    environ = dict(os.environ if base is None else base)
    info = assignment.info
    rank = assignment.rank_offset + local_rank
    environ.update(
        {
            env.RANK: str(rank),
            env.LOCAL_RANK: str(local_rank),
            env.WORLD_SIZE: str(info.world_size),
            env.LOCAL_WORLD_SIZE: str(config.nproc_per_node),
            env.GROUP_RANK: str(info.group_rank),
            env.GROUP_WORLD_SIZE: str(info.group_world_size),
            env.ROLE_RANK: str(rank),
            env.ROLE_NAME: config.role,
            env.ROLE_WORLD_SIZE: str(info.world_size),
            env.MASTER_ADDR: info.master_addr,
            env.MASTER_PORT: str(info.master_port),
            env.RESTART_COUNT: str(restart_count),
            env.MAX_RESTARTS: str(config.max_restarts),
            env.TORCH_RUN_ID: config.rdzv_id,
            env.USE_AGENT_STORE: "False",
            env.ERROR_FILE: error_file,
            env.SIGNALS_TO_HANDLE: ",".join(config.signals_to_handle),
            env.NCCL_ASYNC_ERROR_HANDLING: environ.get(env.NCCL_ASYNC_ERROR_HANDLING, "1"),
            env.RUN_ID: config.rdzv_id,
            env.NODE_ID: node_id,
            env.RENDEZVOUS_ROUND: str(info.round),
            env.NODE_LOCAL_RANK: str(local_rank),
        }
    )
    if config.virtual_local_rank:
        environ.update(_own_device(local_rank))
    if config.nproc_per_node > 1 and env.OMP_NUM_THREADS not in environ:
        # torchrun's choice: many workers each using every core oversubscribe the host.
        environ[env.OMP_NUM_THREADS] = "1"
    optional = {
        env.CHECKPOINT_URL: config.checkpoint_dir,
        env.EVENTS_SOCKET: events_socket,
        env.METRICS_DIR: metrics_dir,
        env.PROGRESS_TIMEOUT: f"{config.watchdog_timeout:g}" if config.watchdog_timeout else None,
    }
    environ.pop(env.PROGRESS_TIMEOUT, None)  # inherited: not this agent's watchdog
    environ.update({name: value for name, value in optional.items() if value})
    return environ


def _own_device(local_rank: int) -> dict[str, str]:
    """torchrun's ``--virtual-local-rank``: each worker sees only its device, as device 0."""
    visible = os.environ.get(env.CUDA_VISIBLE_DEVICES)
    devices = [d.strip() for d in visible.split(",")] if visible is not None else None
    device = devices[local_rank] if devices is not None else str(local_rank)
    return {env.LOCAL_RANK: "0", env.CUDA_VISIBLE_DEVICES: device}


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
