"""Tying a child process's life to its parent's (Linux ``PR_SET_PDEATHSIG``).

Used for workers (they die with their agent) and for the process that writes an
asynchronous checkpoint (it dies with its worker): no failure leaves a stray process.
"""

from __future__ import annotations

import ctypes
import os
import signal
from typing import Any

_PR_SET_PDEATHSIG = 1

_prctl: Any
try:
    _prctl = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # not Linux: children are still stopped by their parent
    _prctl = None


def die_with_parent(parent_pid: int) -> None:
    """Call in a child right after fork: SIGKILL it when ``parent_pid`` dies."""
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)
