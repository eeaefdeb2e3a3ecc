"""The ``failure-window`` restart policy.

``rallypoint run --restart-policy failure-window --restart-conf max_failures=3,window=600``
restarts failed workers, like ``max-restarts``, until this node's workers have failed
``max_failures`` times within ``window`` seconds: then it gives up, whatever restarts
``--max-restarts`` has left. It never restarts past ``--max-restarts`` either.

The window is measured in running time, from the attempts' uptimes that rallypoint hands
to every policy (``RestartRequest.attempt_uptimes``), so ``decide`` stays a pure function
of its request: the same on every node, testable without a clock. Time spent between two
attempts (the delay, the rendezvous) is not counted, which can only make failures look
closer together than they were: the policy errs on the side of giving up.
"""

from __future__ import annotations

from rallypoint.sdk import ConfigOption, RestartDecision, RestartPolicy, RestartRequest

OPTIONS = (
    ConfigOption("max_failures", int, 3, "failures within the window that end the run"),
    ConfigOption("window", float, 600.0, "seconds of running time the failures are counted in"),
    ConfigOption("delay", float, 0.0, "seconds to wait before each restart"),
)


def failures_in_window(uptimes: tuple[float, ...], window: float) -> int:
    """How many failures, counting the latest, happened within ``window`` seconds of it.

    The attempt before the latest failed ``uptimes[-1]`` seconds before it, the one before
    that ``uptimes[-1] + uptimes[-2]`` seconds before, and so on.
    """
    count = 1
    elapsed = 0.0
    for uptime in reversed(uptimes[1:]):
        elapsed += max(uptime, 0.0)
        if elapsed > window:
            break
        count += 1
    return count


def decide(request: RestartRequest) -> RestartDecision:
    """Give up after ``max_failures`` failures within ``window`` s, or when restarts run out."""
    limit = int(request.options["max_failures"])
    window = float(request.options["window"])
    if request.restarts_done >= request.max_restarts:
        return RestartDecision(
            False, reason=f"all {request.max_restarts} restarts (--max-restarts) used up"
        )
    failures = failures_in_window(request.attempt_uptimes, window)
    if failures >= limit:
        return RestartDecision(
            False,
            reason=(
                f"{failures} failures within {window:g} s on this node "
                f"(failure-window: max_failures={limit}); giving up"
            ),
        )
    delay = max(float(request.options["delay"]), 0.0)
    return RestartDecision(
        True, delay=delay, reason=f"failure {failures} of {limit} within {window:g} s"
    )


POLICY = RestartPolicy(
    name="failure-window",
    description="restart until max_failures failures within window seconds, or --max-restarts",
    decide=decide,
    options=OPTIONS,
)
