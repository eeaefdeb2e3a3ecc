"""``--nnodes auto``: the job's shape from the variables Slurm sets in a job step.

Slurm writes the job's hosts as a host list (``SLURM_JOB_NODELIST="gpu[07-09,12]"``).
Slurm's own ``scontrol show hostnames`` expands it wherever it can run (it needs a Slurm
configuration, which every node of a Slurm cluster has, but no running ``slurmctld``);
elsewhere, and for a list that scontrol cannot read, the python-hostlist package does.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Mapping
from typing import Any

import hostlist  # type: ignore[import-untyped]  # python-hostlist ships no type hints

from rallypoint.errors import UsageError

#: ``--nnodes auto`` puts the c10d store on the job's first host, at this port plus the job
#: id modulo 1000: every node of a job computes the same port, and jobs that share their
#: first host rarely collide.
SLURM_RDZV_PORT = 29400

#: Expanding a host list takes scontrol milliseconds, but it reads the Slurm configuration
#: first and retries for a minute when ``SLURM_CONF`` names a missing file.
SCONTROL_TIMEOUT = 5.0


def apply_slurm(values: dict[str, Any], environ: Mapping[str, str]) -> str:
    """Fill in ``values`` from the Slurm job this agent runs in; return the ``--nnodes`` text.

    ``SLURM_JOB_NUM_NODES`` nodes (fixed, not elastic); the default ``static`` backend
    becomes ``c10d`` with its store on the first host of ``SLURM_JOB_NODELIST``;
    ``--rdzv-id`` defaults to ``SLURM_JOB_ID`` and ``--node-rank`` to ``SLURM_NODEID``.
    Flags the user gave explicitly are kept.
    """
    names = ("SLURM_JOB_NUM_NODES", "SLURM_NODEID", "SLURM_JOB_ID", "SLURM_JOB_NODELIST")
    missing = [name for name in names if not environ.get(name, "").strip()]
    if missing:
        verb = "is" if len(missing) == 1 else "are"
        raise UsageError(
            f"--nnodes auto reads the Slurm job's shape, but {', '.join(missing)} {verb} "
            "not set: run it under srun (or sbatch), or give --nnodes N."
        )
    count, node_id = environ["SLURM_JOB_NUM_NODES"].strip(), environ["SLURM_NODEID"].strip()
    job_id = environ["SLURM_JOB_ID"].strip()
    # ASCII digits only: str.isdigit is true for "²", which int refuses.
    if not all(text.isascii() and text.isdigit() for text in (count, node_id, job_id)):
        raise UsageError(
            f"--nnodes auto: SLURM_JOB_NUM_NODES={count!r}, SLURM_NODEID={node_id!r} and "
            f"SLURM_JOB_ID={job_id!r} must be whole numbers."
        )
    if values.get("rdzv_backend", "static") == "static":
        values["rdzv_backend"] = "c10d"
    if values["rdzv_backend"] == "c10d" and not values.get("rdzv_endpoint"):
        first = expand_hostlist(environ["SLURM_JOB_NODELIST"])[0]
        values["rdzv_endpoint"] = f"{first}:{SLURM_RDZV_PORT + int(job_id) % 1000}"
    if values.get("rdzv_id", "none") == "none":
        values["rdzv_id"] = job_id
    if not values.get("node_rank"):
        values["node_rank"] = int(node_id)
    return count


def expand_hostlist(text: str) -> list[str]:
    """Slurm's hostlist syntax: ``"node[01-03,07],login"`` -> ``["node01", ..., "login"]``.

    Asks ``scontrol show hostnames`` first, then python-hostlist, which also reads a
    suffix after the last bracket (``n[1-2].cluster.org``) that scontrol 22.05 refuses.

    Raises:
        UsageError: naming ``SLURM_JOB_NODELIST``, when ``text`` is not a host list.
    """
    stripped = text.strip()
    if stripped:
        hosts = _scontrol_hostnames(stripped)
        if hosts is None:
            hosts = _python_hostlist(stripped, text)
        if hosts:
            return hosts
    raise UsageError(f"SLURM_JOB_NODELIST {text!r}: no host names in it.")


def _scontrol_hostnames(text: str) -> list[str] | None:
    """scontrol's expansion, or None where it is not installed, fails or refuses ``text``."""
    scontrol = shutil.which("scontrol")
    if scontrol is None or text.startswith("-"):  # an option, not a host list
        return None
    try:
        result = subprocess.run(
            [scontrol, "show", "hostnames", text],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=SCONTROL_TIMEOUT,
            check=False,
        )
    except (OSError, ValueError, subprocess.TimeoutExpired):  # ValueError: a NUL in text
        return None
    hosts = result.stdout.splitlines()
    # scontrol exits 0 on a list it refuses (nothing on stdout, "Invalid hostlist" on
    # stderr), and echoes some malformed ones back half-expanded ("node[1-" -> "node]").
    if result.returncode != 0 or not hosts or not all(map(_plain_name, hosts)):
        return None
    return hosts


def _plain_name(host: str) -> bool:
    return bool(host) and not any(char.isspace() or char in "[]," for char in host)


def _python_hostlist(text: str, original: str) -> list[str]:
    try:
        hosts: list[str] = hostlist.expand_hostlist(text, allow_duplicates=True)
    except hostlist.BadHostlist as error:
        raise UsageError(
            f"SLURM_JOB_NODELIST {original!r} is not a Slurm host list such as "
            f"node[01-04,07]: {error}."
        ) from None
    return [host.strip() for host in hosts if host.strip()]
