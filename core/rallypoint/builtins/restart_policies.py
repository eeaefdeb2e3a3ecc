"""Built-in restart policies: ``max-restarts`` (torchrun's), ``backoff`` and ``never``."""

from __future__ import annotations

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
    return _limit_reached(request) or RestartDecision(True, 0.0, "restarting")


def backoff(request: RestartRequest) -> RestartDecision:
    """Like ``max-restarts``, waiting ``initial_delay * factor**n`` seconds, at most ``max_delay``."""
    stop = _limit_reached(request)
    if stop:
        return stop
    options = request.options
    delay = options["initial_delay"] * options["factor"] ** request.restarts_done
    delay = min(float(options["max_delay"]), delay)
    return RestartDecision(True, delay, f"restarting after {delay:g} s")


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
                ConfigOption("initial_delay", float, 1.0, "seconds before the first restart"),
                ConfigOption("factor", float, 2.0, "delay multiplier per restart"),
                ConfigOption("max_delay", float, 60.0, "longest delay in seconds"),
            ),
        ),
        RestartPolicy("never", "fail on the first worker failure", never),
    ]
