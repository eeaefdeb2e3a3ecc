"""What a failure of the workers leads to: a restart, or the end of the job.

A failure of a one-node round is put to the restart policy (``--restart-policy``) at once;
one of a round of several nodes once the next round tells whether a node was lost (then
it is a membership change, which uses up no restart; ``rallypoint.agent.statemachine.restarts``). A
failure not restarted is reported (``failure.json``, torchrun's parent error file), the
job's other nodes are made to stop too, and the agent exits with EXIT_WORKER_FAILURE.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

from rallypoint import events
from rallypoint.agent.monitoring.eventbus import EventBus
from rallypoint.agent.monitoring.failures import FailureReport, describe_failure
from rallypoint.agent.statemachine.restarts import (
    FAILURE,
    MEMBERSHIP,
    Failure,
    Restarts,
    lost_nodes,
)
from rallypoint.agent.statemachine.signals import SignalWatch
from rallypoint.config import LaunchConfig
from rallypoint.events import RoundInfo
from rallypoint.extensions import RestartDecision, RestartRequest
from rallypoint.interfaces import RendezvousFailed, RendezvousHandler, RendezvousTimeout
from rallypoint.registry import RESTART_POLICIES, describe, plugin_failure

logger = logging.getLogger("rallypoint.agent")

#: Exit codes of ``rallypoint run``: usage errors are 2; a signal N gives 128 + N.
EXIT_SUCCESS = 0
EXIT_WORKER_FAILURE = 1

#: The agent's exit code and reason, when a judgement ends the job; None: it goes on.
Stop = tuple[int, str] | None


class RestartJudge:
    """Puts failures to the restart policy and reports those it does not restart.

    ``parent_error_file``: torchrun's (``TORCHELASTIC_ERROR_FILE``), which gets the root
    cause of a job that fails too."""

    def __init__(
        self,
        config: LaunchConfig,
        handler: RendezvousHandler,
        bus: EventBus,
        signals: SignalWatch,
        run_dir: Path,
        parent_error_file: str | None,
    ) -> None:
        self.config = config
        self.handler = handler
        self.bus = bus
        self.signals = signals
        self.run_dir = run_dir
        self.parent_error_file = parent_error_file

    def judge(self, restarts: Restarts, info: RoundInfo, stragglers: tuple[str, ...]) -> Stop:
        """What the last failure was, now that this round tells who is still there: a
        membership change if a node of its round is gone, else a failure the policy is
        asked about (unless it was already). The agent's exit when the policy refuses."""
        failure = restarts.pending
        if failure is None:
            return None
        restarts.pending = None
        lost = [] if failure.decided else lost_nodes(failure, info)
        if lost:
            logger.info(
                "the failure followed the loss of node %s: a membership change, which does "
                "not use up a restart",
                ", ".join(lost),
            )
        elif not failure.decided:
            stop = self._ask_policy(failure, restarts, stragglers)
            if stop is not None:
                return stop
            restarts.count += 1
        self.restarted(restarts, MEMBERSHIP if lost else FAILURE)
        return None

    def failed(
        self,
        report: FailureReport,
        restarts: Restarts,
        info: RoundInfo,
        uptime: float,
        stragglers: tuple[str, ...],
    ) -> Stop:
        """Workers of ``info``'s round failed after ``uptime`` s: put it to the policy now
        (one node) or after the next round (several). The agent's exit when it ends here."""
        failure = restarts.failed(report, info.members, uptime)
        if info.group_world_size > 1:
            # A peer's death fails our workers too (gloo's "Connection closed by peer"):
            # whether it did is known from the next round.
            logger.info(
                "%s; the next round tells whether a node of this round was lost "
                "before a restart is counted",
                _root(report),
            )
            return None
        stop = self._ask_policy(failure, restarts, stragglers)
        if stop is None:
            restarts.allowed()  # counted now: the next round's events carry it
        return stop

    def no_round(self, pending: Failure, error: RendezvousTimeout | RendezvousFailed) -> None:
        """The round after ``pending`` could not form: report the failure, and why. Too few
        nodes in time means nodes of its round were lost, before the gloo error they caused;
        else another node failed the job, or its assigner did."""
        if isinstance(error, RendezvousTimeout):
            lost = tuple(self.handler.gone(pending.members))
            report = replace(pending.report, lost_nodes=lost)
            self._report(report, f"the next round could not form: {error}")
        else:
            self._report(pending.report, str(error))

    def restarted(self, restarts: Restarts, cause: str) -> None:
        """The ``workers_restarted`` event; its ``reason`` is the restart policy's after a
        failure, else that the job's nodes changed."""
        reason = restarts.reason if cause == FAILURE else "the job's nodes changed"
        self.bus.emit(
            events.WORKERS_RESTARTED, restart_count=restarts.count, cause=cause, reason=reason
        )

    def _ask_policy(
        self, failure: Failure, restarts: Restarts, stragglers: tuple[str, ...]
    ) -> Stop:
        """Ask the restart policy about a failure with no node lost; sleep the delay it
        asks for. The agent's exit code and reason when it refuses (or a signal comes
        during the delay), else None: restart."""
        config = self.config
        policy = config.restart.item
        who = describe(RESTART_POLICIES, policy)
        try:
            decision = policy.decide(
                RestartRequest(
                    restarts_done=restarts.count,
                    max_restarts=config.max_restarts,
                    failure=failure.report.root,
                    options=config.restart_conf,
                    attempt_uptimes=tuple(restarts.uptimes),
                    stragglers=stragglers,
                )
            )
        except Exception as error:  # a plugin's: the job ends, cleanly, on every node
            return self._give_up(failure, plugin_failure(who, "decide", error, "the job stops"))
        if not isinstance(decision, RestartDecision):
            wrong = type(decision).__name__
            return self._give_up(
                failure, f"{who} returned {wrong} from decide, not a RestartDecision; the job stops"
            )
        if not decision.restart:
            return self._give_up(failure, decision.reason)
        said = f": {decision.reason}" if decision.reason else ""
        restarts.reason = f"restart policy {policy.name!r}{said}"
        logger.info(
            "%s; restart %d of %d%s (%s)",
            _root(failure.report),
            restarts.count + 1,
            config.max_restarts,
            f" in {decision.delay:.1f} s" if decision.delay else "",
            restarts.reason,
        )
        if self.signals.sleep(decision.delay):
            return self.signals.exit()
        return None

    def _give_up(self, failure: Failure, reason: str) -> tuple[int, str]:
        """The workers failed and are not restarted, for ``reason``: report it, make the
        job's other nodes stop too, and return the agent's exit code and reason."""
        root = _root(failure.report)
        self._report(failure.report, reason)
        if self.config.max_nodes > 1:
            self.handler.fail(f"{root}; {reason}")  # the other nodes stop too
        return EXIT_WORKER_FAILURE, f"{root}; {reason}"

    def _report(self, report: FailureReport, reason: str) -> None:
        path = self.run_dir / "failure.json"
        report.write(path)
        if self.parent_error_file:
            report.write_parent_error_file(self.parent_error_file)
        logger.error(
            "%s\n  not restarted: %s\n  failure report: %s", report.summary(), reason, path
        )


def _root(report: FailureReport) -> str:
    return f"rank {report.root.rank} {describe_failure(report.root)}"
