"""The environment of a worker process: exactly torchrun's, plus ``RALLYPOINT_*``.

A script written for torchrun reads the same variables with the same values. The one
deliberate difference is ``TORCHELASTIC_USE_AGENT_STORE=False``: the agent holds no
TCPStore (it does not import torch), so rank 0 hosts the store on a master port that is
new for every attempt, and restarted workers never see keys of an earlier attempt.
"""

from __future__ import annotations

import os
import sys
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass

from rallypoint.config import LaunchConfig
from rallypoint.interfaces import Assignment
from rallypoint.worker import variables
from rallypoint.worker.progress_reporter import REPORT_INTERVAL

#: ``--checkpoint-memory``'s variables: set per worker, and never inherited from the agent.
MEMORY_TIER_VARIABLES = (
    variables.CHECKPOINT_MEMORY_DIR,
    variables.CHECKPOINT_MEMORY_BYTES,
    variables.CHECKPOINT_MEMORY_KEEP,
    variables.CHECKPOINT_STEP,
)
#: What ``worker_environment`` sets for each worker on top of ``job_environment``: read
#: when a script runs (by ``init_process_group``, rallypoint's worker modules, CUDA's
#: initialisation), never by an import, so a preloaded interpreter need not have them.
PER_WORKER = frozenset(
    {
        variables.RANK,
        variables.LOCAL_RANK,
        variables.WORLD_SIZE,
        variables.LOCAL_WORLD_SIZE,
        variables.GROUP_RANK,
        variables.GROUP_WORLD_SIZE,
        variables.ROLE_RANK,
        variables.ROLE_NAME,
        variables.ROLE_WORLD_SIZE,
        variables.MASTER_ADDR,
        variables.MASTER_PORT,
        variables.RESTART_COUNT,
        variables.MAX_RESTARTS,
        variables.TORCH_RUN_ID,
        variables.USE_AGENT_STORE,
        variables.ERROR_FILE,
        variables.SIGNALS_TO_HANDLE,
        variables.RUN_ID,
        variables.NODE_ID,
        variables.RENDEZVOUS_ROUND,
        variables.NODE_LOCAL_RANK,
        variables.CUDA_VISIBLE_DEVICES,  # --virtual-local-rank
        variables.CHECKPOINT_URL,
        *MEMORY_TIER_VARIABLES,
        variables.EVENTS_SOCKET,
        variables.METRICS_DIR,
        variables.PROGRESS_REPORTS,
        variables.STACKS_FILE,
        variables.SAVE_NOTICE,
    }
)


def job_environment(config: LaunchConfig, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """What every worker of this node shares: the agent's environment (or ``base``) with
    torchrun's defaults. The preloaded interpreter imports with exactly this."""
    environ = dict(os.environ if base is None else base)
    environ.setdefault(variables.NCCL_ASYNC_ERROR_HANDLING, "1")
    if config.nproc_per_node > 1:
        # torchrun's choice: many workers each using every core oversubscribe the host.
        environ.setdefault(variables.OMP_NUM_THREADS, "1")
    # Inherited (an agent run by a worker): not this agent's watchdog, nor its memory.
    # The job's secret is the agents': no worker gets it.
    for name in (
        variables.PROGRESS_REPORTS,
        variables.STACKS_FILE,
        variables.SAVE_NOTICE,
        variables.JOB_TOKEN,
        *MEMORY_TIER_VARIABLES,
    ):
        environ.pop(name, None)
    return environ


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
    memory_tier_dir: str | None = None,
    checkpoint_step: int | None = None,
    save_notice: str | None = None,
    stacks_file: str | None = None,
    base: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The full environment of the worker ``local_rank`` for this round and attempt."""
    environ = job_environment(config, base)
    info, rank = assignment.info, assignment.rank_offset + local_rank
    environ.update(
        {
            variables.RANK: str(rank),
            variables.LOCAL_RANK: str(local_rank),
            variables.WORLD_SIZE: str(info.world_size),
            variables.LOCAL_WORLD_SIZE: str(config.nproc_per_node),
            variables.GROUP_RANK: str(info.group_rank),
            variables.GROUP_WORLD_SIZE: str(info.group_world_size),
            variables.ROLE_RANK: str(rank),
            variables.ROLE_NAME: config.role,
            variables.ROLE_WORLD_SIZE: str(info.world_size),
            variables.MASTER_ADDR: info.master_addr,
            variables.MASTER_PORT: str(info.master_port),
            variables.RESTART_COUNT: str(restart_count),
            variables.MAX_RESTARTS: str(config.max_restarts),
            variables.TORCH_RUN_ID: config.rdzv_id,
            variables.USE_AGENT_STORE: "False",
            variables.ERROR_FILE: error_file,
            variables.SIGNALS_TO_HANDLE: ",".join(config.signals_to_handle),
            variables.RUN_ID: config.rdzv_id,
            variables.NODE_ID: node_id,
            variables.RENDEZVOUS_ROUND: str(info.round),
            variables.NODE_LOCAL_RANK: str(local_rank),
        }
    )
    if config.virtual_local_rank:
        environ.update(_own_device(local_rank))
    optional = {
        variables.CHECKPOINT_URL: config.checkpoint_dir,
        variables.CHECKPOINT_MEMORY_DIR: memory_tier_dir,
        variables.CHECKPOINT_STEP: None if checkpoint_step is None else str(checkpoint_step),
        variables.EVENTS_SOCKET: events_socket,
        variables.METRICS_DIR: metrics_dir,
        variables.SAVE_NOTICE: save_notice,
        **(_progress_reports(stacks_file) if config.progress_reports else {}),
        **(_memory_tier(config) if memory_tier_dir else {}),
    }
    environ.update({name: value for name, value in optional.items() if value})
    return environ


def _progress_reports(stacks_file: str | None) -> dict[str, str | None]:
    """A worker's progress reports, for hang detection (``rallypoint.worker.progress_sources``)."""
    return {variables.PROGRESS_REPORTS: f"{REPORT_INTERVAL:g}", variables.STACKS_FILE: stacks_file}


def _memory_tier(config: LaunchConfig) -> dict[str, str | None]:
    return {
        variables.CHECKPOINT_MEMORY_BYTES: str(config.checkpoint_memory),
        variables.CHECKPOINT_MEMORY_KEEP: str(config.checkpoint_memory_keep),
    }


def _own_device(local_rank: int) -> dict[str, str]:
    """torchrun's ``--virtual-local-rank``: each worker sees only its device, as device 0."""
    visible = os.environ.get(variables.CUDA_VISIBLE_DEVICES)
    devices = [d.strip() for d in visible.split(",")] if visible is not None else None
    device = devices[local_rank] if devices is not None else str(local_rank)
    return {variables.LOCAL_RANK: "0", variables.CUDA_VISIBLE_DEVICES: device}


#: What ``--run-path`` runs: torchrun's ``runpy.run_path`` of the script, under ``-c``.
_RUN_PATH = (
    "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
)


@dataclass(frozen=True)
class WorkerCommand:
    """What every worker runs: a Python ``script``, a ``module`` (``-m``), a script run by
    ``runpy`` (``run_path``: ``--run-path``) or a ``program`` (``--no-python``)."""

    kind: str
    target: str
    args: tuple[str, ...] = ()

    @classmethod
    def of(cls, config: LaunchConfig) -> WorkerCommand:
        kind = "script"
        if config.run_path:
            kind = "run_path"
        elif config.no_python:
            kind = "program"
        elif config.module:
            kind = "module"
        return cls(kind, config.training_script, tuple(config.training_script_args))

    def argv(self) -> list[str]:
        """The command line of a worker started cold, as torchrun builds it."""
        args = [self.target, *self.args]
        python = [sys.executable, "-u"]
        if self.kind == "run_path":
            return [*python, "-c", _RUN_PATH, *args]
        if self.kind == "program":
            return args
        if self.kind == "module":
            return [*python, "-m", *args]
        return [*python, *args]

    def path0(self) -> str:
        """``sys.path[0]`` in that interpreter: the script's folder (symbolic links
        resolved), or the script itself when it is a folder or zip file; the working
        directory for ``-m``; empty (the working directory) for ``-c``."""
        if self.kind == "module":
            return os.getcwd()
        if self.kind != "script":
            return ""
        if os.path.isdir(self.target) or zipfile.is_zipfile(self.target):
            return os.path.abspath(self.target)
        return os.path.dirname(os.path.realpath(self.target))
