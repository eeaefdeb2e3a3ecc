"""Run ``rallypoint`` and ``torchrun`` as a user would: as subprocesses, bounded in time."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

#: The `install_plugin` fixture (tests/conftest.py): install a plugin for one test.
InstallPlugin = Callable[..., Path]

BIN = Path(sys.executable).parent
RALLYPOINT = str(BIN / "rallypoint")
TORCHRUN = str(BIN / "torchrun")
WORKERS = Path(__file__).parent / "workers"


def clean_environment(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment without launcher settings, plus ``extra``."""
    base = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("RALLYPOINT_", "PET_", "TORCHELASTIC_"))
        and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    return {**base, **(extra or {})}


def _run(
    command: str,
    args: tuple[str, ...],
    env: dict[str, str] | None,
    cwd: Path | None,
    timeout: float,
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [command, *args],
        env=clean_environment(env),
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def rallypoint(
    *args: str, env: dict[str, str] | None = None, cwd: Path | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    return _run(RALLYPOINT, args, env, cwd, timeout)


def torchrun(
    *args: str, env: dict[str, str] | None = None, cwd: Path | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    return _run(TORCHRUN, args, env, cwd, timeout)


def worker(name: str) -> str:
    """Path of a worker script in tests/workers/."""
    return str(WORKERS / name)
