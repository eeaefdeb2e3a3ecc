"""Checks of this machine against a ``LaunchConfig``, before the agent starts anything.

``LaunchConfig.from_flags`` decides what ``rallypoint run`` was asked to do; ``preflight``
looks whether this node can do it: the ``--logs-specs`` entry point is installed, the
devices ``--virtual-local-rank`` hands out are visible, the shared memory holds what
``--checkpoint-memory`` keeps there (``shared_memory_uses``), the script is there and the
files the agent will write can be written.
Each refusal is a ``UsageError`` of one sentence.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import metadata

from rallypoint.config import LOGS_SPECS_GROUP, SHARED_MEMORY, LaunchConfig
from rallypoint.errors import UsageError
from rallypoint.flags import format_size


def preflight(config: LaunchConfig, environ: Mapping[str, str] = os.environ) -> None:
    """Refuse what this machine cannot do of ``config``; ``environ`` is the agent's
    environment (its workers inherit it).

    Raises:
        UsageError: one sentence naming the flag and what is missing.
    """
    if config.logs_specs:
        check_logs_specs(config.logs_specs)
    if config.virtual_local_rank:
        _check_visible_devices(config.nproc_per_node, environ.get("CUDA_VISIBLE_DEVICES"))
    if config.checkpoint_memory:
        _check_shared_memory(config)
    _check_script(config)
    _check_outputs(config)


def check_logs_specs(name: str) -> None:
    """Refuse a ``--logs-specs`` name no installed distribution registers."""
    names = sorted(ep.name for ep in metadata.entry_points(group=LOGS_SPECS_GROUP))
    if name not in names:
        valid = ", ".join(names) if names else "none is installed"
        raise UsageError(
            f"--logs-specs {name!r}: no {LOGS_SPECS_GROUP} entry point of that name ({valid})."
        )


def _check_visible_devices(workers: int, visible: str | None) -> None:
    """``--virtual-local-rank`` gives each worker the device of its local rank."""
    devices = [device for device in (visible or "").split(",") if device.strip()]
    if visible is not None and len(devices) < workers:
        raise UsageError(
            f"--virtual-local-rank: {workers} workers but CUDA_VISIBLE_DEVICES={visible!r} "
            f"names {len(devices)} devices; each worker sees the device of its local rank."
        )


@dataclass(frozen=True)
class SharedMemoryUse:
    """One thing the agent keeps in ``SHARED_MEMORY``: what it is, and the most bytes it
    may take."""

    what: str
    size: int


def shared_memory_uses(config: LaunchConfig) -> tuple[SharedMemoryUse, ...]:
    """What the agent keeps in ``SHARED_MEMORY`` for ``config``, each at its budget: its
    workers' arenas share ``--checkpoint-memory``, and the peer tier has its own
    (``LaunchConfig.peer_memory``, as the agent gives it)."""
    if not config.checkpoint_memory:
        return ()
    uses = [SharedMemoryUse("this node's memory checkpoints", config.checkpoint_memory)]
    if config.peer_memory:
        uses.append(SharedMemoryUse("the copies a peer node sends it", config.peer_memory))
    return tuple(uses)


def shared_memory_refusal(
    config: LaunchConfig, free: int, total: int, path: str = SHARED_MEMORY
) -> str | None:
    """Why ``path``, with ``free`` of its ``total`` bytes free, cannot hold what the
    agent keeps there for ``config``; None when it can."""
    uses = shared_memory_uses(config)
    needed = sum(use.size for use in uses)
    if needed <= free:
        return None
    parts = ""
    if len(uses) > 1:
        parts = " (" + ", ".join(f"{use.size / 1e9:.1f} GB for {use.what}" for use in uses) + ")"
    return (
        f"--checkpoint-memory {format_size(config.checkpoint_memory)}: needs "
        f"{needed / 1e9:.1f} GB of shared memory{parts}, and {path} has {free / 1e9:.1f} GB "
        f"free of {total / 1e9:.1f} GB; give less, or a larger /dev/shm (docker run "
        "--shm-size, a Kubernetes emptyDir of medium Memory)."
    )


def _check_shared_memory(config: LaunchConfig, path: str = SHARED_MEMORY) -> None:
    """What ``--checkpoint-memory`` keeps in this node's shared memory must fit in it now."""
    try:
        stats = os.statvfs(path)
    except OSError as error:
        raise UsageError(
            f"--checkpoint-memory needs shared memory at {path}, which this node "
            f"lacks ({error.strerror})."
        ) from None
    free, total = stats.f_bavail * stats.f_frsize, stats.f_blocks * stats.f_frsize
    refusal = shared_memory_refusal(config, free, total, path)
    if refusal is not None:
        raise UsageError(refusal)


def _check_script(config: LaunchConfig) -> None:
    """The script (or program) is there; ``rallypoint.flags`` checked what the command
    line alone says about it."""
    script = config.training_script
    if config.module:
        return  # resolved by the worker's interpreter, as with `python -m`
    if config.no_python and not config.run_path:
        if os.path.isfile(script) or shutil.which(script):
            return
        raise UsageError(f"training program {script!r} does not exist and is not on PATH.")
    if os.path.isdir(script):
        # python runs a directory (or a zip file) by its __main__.py, and so does torchrun.
        if os.path.isfile(os.path.join(script, "__main__.py")):
            return
        raise UsageError(
            f"training script {script!r} is a directory without a __main__.py; name the "
            "script in it."
        )
    if not os.path.isfile(script):
        raise UsageError(f"training script {script!r} does not exist.")


def _check_outputs(config: LaunchConfig) -> None:
    """The files the agent will write: refused now, before it joins anything, when they
    cannot be (a directory where the event log should go, a file where a directory)."""
    for flag, path, want_dir in (
        ("--event-log", config.event_log, False),
        ("--log-dir", config.log_dir, True),
    ):
        if not path:
            continue
        if not want_dir and os.path.isdir(path):
            raise UsageError(f"{flag} {path!r}: is a directory; name a file in it.")
        if want_dir and os.path.exists(path) and not os.path.isdir(path):
            raise UsageError(f"{flag} {path!r}: is a file; name a directory.")
        parent = os.path.dirname(os.path.abspath(path))
        while parent and not os.path.exists(parent):
            parent = os.path.dirname(parent)
        if parent and not os.path.isdir(parent):
            raise UsageError(f"{flag} {path!r}: {parent!r} is a file, not a directory.")
