"""The ``example-restart-policy`` restart policy: restart after each failure, up to
``--max-restarts``."""

from __future__ import annotations

from rallypoint.sdk import ConfigOption, RestartDecision, RestartPolicy, RestartRequest

OPTIONS = (ConfigOption("delay", float, 0.0, "seconds to wait before each restart"),)


def decide(request: RestartRequest) -> RestartDecision:
    """Restart after ``delay`` seconds until ``--max-restarts`` restarts are used up.

    Keep it a pure function of ``request``: every node asks it, tests call it directly.
    """
    if request.restarts_done >= request.max_restarts:
        return RestartDecision(
            False, reason=f"all {request.max_restarts} restarts (--max-restarts) used up"
        )
    return RestartDecision(True, delay=request.options["delay"], reason="restarting")


POLICY = RestartPolicy(
    name="example-restart-policy",
    description="restart after a delay, up to --max-restarts times",
    decide=decide,
    options=OPTIONS,
)
