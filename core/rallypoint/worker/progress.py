"""Progress reports from a worker to its agent: the step reached, and that it is alive.

``rallypoint.heartbeat(step=N)`` says "this worker is making progress, at step N". The
agent uses it twice: its watchdog (``--watchdog-timeout``) is armed for a worker at the
first heartbeat, and a worker silent for longer than the timeout afterwards is killed and
restarted like a worker that failed; and its goodput account (``rallypoint report``, the
metrics) knows from the steps which training time a restart later redid.

The worker API reports the step by itself: a checkpoint ``save``, ``ElasticSampler.advance``
and ``rallypoint.metrics.step`` each call ``heartbeat(step=...)``, so a script that uses
one of them needs no call of its own. Heartbeats travel over the worker channel
(``rallypoint.worker.channel``) as one small datagram, at most one every
``min(0.1 s, timeout / 10)``, unless the step changed: calling ``heartbeat()`` on every
step of a fast loop costs next to nothing. Outside ``rallypoint run`` it does nothing; it
never blocks and never raises.
"""

from __future__ import annotations

import math
import os
import time

from rallypoint.worker import channel as worker_channel
from rallypoint.worker import variables

#: The variable the agent sets from ``--watchdog-timeout`` (unset: no watchdog).
ENV = variables.PROGRESS_TIMEOUT
#: The longest a heartbeat waits behind the previous one (rate limit).
_MIN_GAP = 0.1

_last_sent = float("-inf")
_last_step: int | None = None


def heartbeat(step: int | None = None) -> None:
    """Tell the agent that this worker is making progress, at ``step`` when given.

    Call it once per training step (and in any long phase: evaluation, a slow data
    loader). A no-op outside ``rallypoint run``.
    """
    global _last_sent, _last_step
    if not os.environ.get(worker_channel.ENV):
        return
    try:
        timeout = float(os.environ.get(ENV) or "inf")
    except ValueError:
        timeout = math.inf
    if not timeout > 0:  # zero or nonsense: no watchdog
        timeout = math.inf
    now = time.monotonic()
    # A new step always goes (about 0.1 s of steps at most otherwise); the rest is limited.
    moved = step is not None and step != _last_step
    if not moved and now - _last_sent < min(_MIN_GAP, timeout / 10):
        return
    if moved and now - _last_sent < _MIN_GAP / 10:
        return  # steps faster than 100 a second: every tenth of the gap is enough
    _last_sent = now
    # ``sent``: CLOCK_MONOTONIC is the host's, so the agent compares it with its own clock
    # and ignores heartbeats of an attempt it has already replaced.
    if step is None:
        worker_channel.send(worker_channel.HEARTBEAT, sent=now)
    else:
        _last_step = step
        worker_channel.send(worker_channel.HEARTBEAT, sent=now, step=int(step))
