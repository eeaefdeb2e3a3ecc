"""Built-in restart policies: ``max-restarts`` (torchrun's), ``backoff`` and ``never``."""

from __future__ import annotations

import random

from rallypoint import hookimpl
from rallypoint.extensions import ConfigOption, RestartDecision, RestartPolicy, RestartRequest


def _limit_reached(request: RestartRequest) -> RestartDecision | None:
    if request.restarts_done >= request.max_restarts:
        return RestartDecision(
            False, reason=f"all {request.max_restarts} restarts (--max-restarts) used up"
        )
    return None


def max_restarts(request: RestartRequest) -> RestartDecision:
    """Restart at once until ``--max-restarts`` restarts are used up (torchrun's behaviour)."""
    return _limit_reached(request) or RestartDecision(True, 0.0, "restarts left")


def backoff(request: RestartRequest) -> RestartDecision:
    """Like ``max-restarts``, but wait longer after each failure in a row.

    The n-th failure in a row waits ``initial_delay * factor**(n-1)`` seconds, at most
    ``max_delay``, spread by +/- ``jitter`` (a fraction) so that many nodes do not retry in
    lockstep. An attempt that ran for ``reset_after`` seconds or more was healthy: the next
    failure counts as the first in a row again.
    """
    stop = _limit_reached(request)
    if stop:
        return stop
    options = request.options
    in_a_row = 0
    for uptime in reversed(request.attempt_uptimes or (0.0,)):
        in_a_row += 1
        if uptime >= options["reset_after"]:
            break
    delay = min(
        options["max_delay"], options["initial_delay"] * options["factor"] ** (in_a_row - 1)
    )
    jitter = options["jitter"]
    if jitter:
        delay = min(options["max_delay"], delay * random.uniform(1 - jitter, 1 + jitter))
    return RestartDecision(True, delay, f"restarting after {delay:.2f} s")


def never(request: RestartRequest) -> RestartDecision:
    """Never restart: the first failure ends the run, whatever ``--max-restarts`` says."""
    return RestartDecision(False, reason="the restart policy is 'never'")


@hookimpl
def register_restart_policies() -> list[RestartPolicy]:
    return [
        RestartPolicy("max-restarts", "restart at once, up to --max-restarts times", max_restarts),
        RestartPolicy(
            "backoff",
            "restart up to --max-restarts times with exponentially growing, capped delays",
            backoff,
            options=(
                ConfigOption(
                    "initial_delay", float, 1.0, "seconds before the first restart", minimum=0
                ),
                ConfigOption("factor", float, 2.0, "delay multiplier per restart", minimum=1),
                ConfigOption("max_delay", float, 60.0, "longest delay in seconds", minimum=0),
                ConfigOption(
                    "jitter",
                    float,
                    0.1,
                    "random spread of each delay, as a fraction",
                    minimum=0,
                    maximum=1,
                ),
                ConfigOption(
                    "reset_after",
                    float,
                    300.0,
                    "seconds of healthy running that reset the delay",
                    minimum=0,
                ),
            ),
        ),
        RestartPolicy("never", "fail on the first worker failure", never),
    ]
