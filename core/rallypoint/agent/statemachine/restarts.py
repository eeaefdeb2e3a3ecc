"""Restart accounting: what a run has restarted, and the failure that waits for its verdict.

A failure of a one-node round is put to the restart policy at once. A failure of a round of
several nodes may be the loss of a node (its workers' death fails ours), so it waits for the
next round: a node of the failed round missing from it makes the failure a membership change,
which never uses up a restart, whatever the policy says.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rallypoint.agent.monitoring.failures import FailureReport
from rallypoint.events import RoundInfo

#: ``workers_restarted``'s causes.
FAILURE = "failure"
MEMBERSHIP = "membership"


@dataclass
class Failure:
    """Workers that failed, and the members of their round.

    ``decided``: the restart policy already allowed the restart (a one-node round, where
    no peer can have been lost)."""

    report: FailureReport
    members: tuple[str, ...]
    decided: bool = False


@dataclass
class Restarts:
    """One run's restarts.

    Attributes:
        count: restarts after failures (membership changes do not count); the workers'
            ``TORCHELASTIC_RESTART_COUNT`` and every event's ``restart_count``.
        attempts: every start of the workers, whatever the cause (``attempt_<n>`` directories).
        uptimes: how long each failed attempt ran, oldest first, for the restart policy.
        pending: the last failure, until the round after it says what it was.
        reason: the restart policy's name and reason for the last restart it allowed.
    """

    count: int = 0
    attempts: int = 0
    uptimes: list[float] = field(default_factory=list)
    pending: Failure | None = None
    reason: str = ""

    def failed(self, report: FailureReport, members: tuple[str, ...], uptime: float) -> Failure:
        """Record a failure of the workers of a round of ``members``, after ``uptime`` s."""
        self.uptimes.append(uptime)
        self.pending = Failure(report, members)
        return self.pending

    def allowed(self) -> None:
        """The policy allowed the restart of the pending failure: it counts from now."""
        assert self.pending is not None
        self.pending.decided = True
        self.count += 1


def lost_nodes(failure: Failure, info: RoundInfo) -> list[str]:
    """The nodes of ``failure``'s round that are not in ``info``'s round."""
    present = set(info.members)  # a thousand members: a set, not a scan per node
    return [node for node in failure.members if node not in present]
