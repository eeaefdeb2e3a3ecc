"""The names of the environment variables a worker gets, and one way to read a number.

The agent writes them (``rallypoint.agent.processes.environment``); the worker-side modules read
them. torchrun's are listed in docs/user-guide.md; rallypoint's start with ``RALLYPOINT_``.
No ``RALLYPOINT_<FLAG>`` name of a ``rallypoint run`` flag is used here, so that a flag's
variable in the agent's environment never switches anything on in its workers.
"""

from __future__ import annotations

import os
import signal

# torchrun's.
RANK = "RANK"
LOCAL_RANK = "LOCAL_RANK"
WORLD_SIZE = "WORLD_SIZE"
LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"
GROUP_RANK = "GROUP_RANK"
GROUP_WORLD_SIZE = "GROUP_WORLD_SIZE"
ROLE_RANK = "ROLE_RANK"
ROLE_NAME = "ROLE_NAME"
ROLE_WORLD_SIZE = "ROLE_WORLD_SIZE"
MASTER_ADDR = "MASTER_ADDR"
MASTER_PORT = "MASTER_PORT"
RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"
MAX_RESTARTS = "TORCHELASTIC_MAX_RESTARTS"
TORCH_RUN_ID = "TORCHELASTIC_RUN_ID"
USE_AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"
ERROR_FILE = "TORCHELASTIC_ERROR_FILE"
SIGNALS_TO_HANDLE = "TORCHELASTIC_SIGNALS_TO_HANDLE"
NCCL_ASYNC_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
OMP_NUM_THREADS = "OMP_NUM_THREADS"
CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"

# rallypoint's.
RUN_ID = "RALLYPOINT_RUN_ID"
NODE_ID = "RALLYPOINT_NODE_ID"
RENDEZVOUS_ROUND = "RALLYPOINT_RENDEZVOUS_ROUND"
#: The worker's place on its node, also when --virtual-local-rank makes LOCAL_RANK 0.
NODE_LOCAL_RANK = "RALLYPOINT_LOCAL_RANK"
#: ``--checkpoint-dir``: where ``rallypoint.checkpoint`` saves.
CHECKPOINT_URL = "RALLYPOINT_CHECKPOINT_URL"
#: ``--checkpoint-memory``: the memory tier's directory, the agent's in shared memory
#: (``rallypoint.checkpoint`` saves under its ``arena/``), the bytes it may take, how many
#: copies to keep.
CHECKPOINT_MEMORY_DIR = "RALLYPOINT_MEMORY_TIER_DIR"
CHECKPOINT_MEMORY_BYTES = "RALLYPOINT_MEMORY_TIER_BYTES"
CHECKPOINT_MEMORY_KEEP = "RALLYPOINT_MEMORY_TIER_KEEP"
#: The step every worker of the round resumes from, decided once for the round (the
#: newest memory checkpoint any of its nodes holds); unset when none holds one.
CHECKPOINT_STEP = "RALLYPOINT_CHECKPOINT_STEP"
#: The agent's datagram socket for worker events (``rallypoint.worker.channel``).
EVENTS_SOCKET = "RALLYPOINT_EVENTS_SOCKET"
#: The agent's save-on-notice file (``rallypoint.worker.notice_watch``).
SAVE_NOTICE = "RALLYPOINT_SAVE_NOTICE"
#: The job's secret, which the agent reads and no worker inherits.
JOB_TOKEN = "RALLYPOINT_JOB_TOKEN"
#: Where ``rallypoint.metrics`` records, when a chosen sink exports worker metrics.
METRICS_DIR = "RALLYPOINT_METRICS_DIR"
#: Seconds between two progress reports to the agent (``rallypoint.worker.progress_reporter``);
#: unset: none (a new step is still sent, for the goodput account).
PROGRESS_REPORTS = "RALLYPOINT_PROGRESS_REPORTS"
#: Where the worker's ``faulthandler`` writes every thread's stack on ``STACKS_SIGNAL``.
STACKS_FILE = "RALLYPOINT_STACKS_FILE"
#: The signal the agent sends for those stacks: a real-time one, which neither Python nor
#: torch uses. Its default action ends a process: only a worker that registered it may get it.
STACKS_SIGNAL = signal.SIGRTMIN + 4
#: A cold worker's own ``PYTHONPATH`` while the startup folder stands first on it
#: (``rallypoint.worker.progress_sources.cold_start_environment``): its value exactly, empty
#: included; absent where it had none. The worker's ``sitecustomize`` puts it back.
SAVED_PYTHONPATH = "RALLYPOINT_PYTHONPATH"


def env_int(name: str) -> int | None:
    """The whole number in ``name``, or None when it is unset, empty or not one."""
    value = os.environ.get(name, "").strip()
    return int(value) if value.isascii() and value.isdigit() else None
