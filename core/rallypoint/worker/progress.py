"""Progress reports from a worker to its agent's watchdog (``--watchdog-timeout``).

``rallypoint.heartbeat()`` says "this worker is making progress". The agent arms its
watchdog for a worker at the first heartbeat; a worker silent for longer than the timeout
afterwards is killed and restarted like a worker that failed. Heartbeats travel over the
worker channel (``rallypoint.worker.channel``) as one small datagram, at most one every
``min(0.1 s, timeout / 10)``, so calling ``heartbeat()`` on every step of a fast loop costs
next to nothing. Without a watchdog, or outside ``rallypoint run``, it does nothing; it
never blocks and never raises.
"""

from __future__ import annotations

import os
import time

from rallypoint.worker import channel as worker_channel
from rallypoint.worker import env

#: The variable the agent sets from ``--watchdog-timeout`` (unset: no watchdog).
ENV = env.PROGRESS_TIMEOUT
#: The longest a heartbeat waits behind the previous one (rate limit).
_MIN_GAP = 0.1

_last_sent = float("-inf")


def heartbeat() -> None:
    """Tell the agent's watchdog that this worker is making progress.

    Call it once per training step (and in any long phase: evaluation, a slow data
    loader). A no-op unless the agent runs with ``--watchdog-timeout``.
    """
    global _last_sent
    try:
        timeout = float(os.environ.get(ENV) or "nan")
    except ValueError:
        return
    if not timeout > 0:  # unset, zero or nonsense: no watchdog
        return
    now = time.monotonic()
    if now - _last_sent < min(_MIN_GAP, timeout / 10):
        return
    _last_sent = now
    # ``sent``: CLOCK_MONOTONIC is the host's, so the agent compares it with its own clock
    # and ignores heartbeats of an attempt it has already replaced.
    worker_channel.send(worker_channel.HEARTBEAT, sent=now)
