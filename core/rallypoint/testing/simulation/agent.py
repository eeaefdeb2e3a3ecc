"""A simulated agent process: the handler that ships (``protocol.StoreRendezvous``, over
``RetryingStore``, ``SignedStore`` with a token, and its backend's liveness) in a world
of its own, driven as ``rallypoint.agent`` drives it: join a round, start the workers,
look at the round every monitor interval, ask for a new round when the workers fail,
give notice and close on SIGTERM, pass the exit barrier and close when they finish."""

from __future__ import annotations

import contextlib
from typing import Any

from rallypoint.errors import RallypointError
from rallypoint.extensions import NodeSpec
from rallypoint.rendezvous.protocol import StoreRendezvous
from rallypoint.testing.simulation.hub import Killed
from rallypoint.testing.simulation.stage import RUN_ID, TOKEN, Round, Stage, Violation
from rallypoint.testing.simulation.store import connect
from rallypoint.testing.simulation.world import NodeWorld, SimThread

#: How often the agent looks at its round while its workers train (--monitor-interval).
MONITOR = 0.5


class Stopped(BaseException):
    """SIGTERM, raised where the agent blocks (``agent.statemachine.signals.Interrupted``
    is a ``BaseException`` for the same reason: no ``except Exception`` may keep it)."""


class SimAgent:
    """One agent process and what it did."""

    def __init__(self, stage: Stage, index: int, node_id: str) -> None:
        self.stage = stage
        self.index = index
        self.node_id = node_id
        schedule = stage.schedule
        self.world = NodeWorld(stage.hub, stage.ports, f"h{index}", schedule.skews.get(index, 1.0))
        self.born = stage.hub.now
        self.alive = True  # False once crashed, stopped or finished
        self.gave_up: str | None = None
        self.training: Round | None = None  # the round its workers run in
        self.fail_due: list[float] = []
        self.finish_at: float | None = None  # when its workers finish (the job's end)
        self.finish_timeout = 0.0
        self.finished = False  # passed the exit barrier and closed
        self.handler: StoreRendezvous | None = None
        self.main: SimThread | None = None

    @property
    def host(self) -> str:
        return self.world.host

    # --- the process ------------------------------------------------------------------------

    def start(self) -> None:
        self.main = self.world.start(self._main, f"{self.node_id} agent")

    def _main(self) -> None:
        stage = self.stage
        schedule = stage.schedule
        server = stage.server
        if schedule.backend == "c10d" and self.index == 0:
            server.hosted_by(self.world)  # node 0's agent hosts the store (its endpoint)
        ready_in = schedule.ready.get(self.index, 0.0)
        born = self.born
        self.handler = StoreRendezvous(
            connect(server, self.world, self.index, self.node_id),
            RUN_ID,
            NodeSpec(self.node_id, host=self.host),
            1,
            stage.assigner,
            schedule.settings,
            # A node that comes to a running job gets ready beside it first (its agent's
            # preloaded interpreter, a checkpoint fetched): for ``ready_in`` seconds.
            ready=lambda _offers: "importing" if stage.hub.now < born + ready_in else None,
            token=TOKEN if schedule.token else None,
            host=(self.index == 0) if schedule.backend == "c10d" else None,
            world=self.world,
        )
        try:
            self._serve(self.handler)
        except Stopped:
            self._stop(self.handler)
        except (Killed, Violation):
            raise
        except Exception as error:
            self._ended(error)
        finally:
            self.trains_in(None)

    def _serve(self, handler: StoreRendezvous) -> None:
        stage = self.stage
        while True:
            assignment = handler.next_round()
            stage.observe().assigned(self, assignment)
            view = handler.state.view
            self.trains_in((stage.server.epoch, view.keys.generation, assignment.info.round))
            while True:
                if self.finish_at is not None and stage.hub.now >= self.finish_at:
                    self._finish(handler)
                    return
                self.world.sleep(MONITOR)
                if handler.nodes_waiting():  # raises the heartbeat's failure
                    break
                stage.observe().trains(self)
                if self.fail_due and self.fail_due[0] <= stage.hub.now:
                    self.fail_due.pop(0)
                    handler.request_new_round()
                    break
            self.trains_in(None)

    def _finish(self, handler: StoreRendezvous) -> None:
        """Its workers finished: the exit barrier (still beating), then it closes."""
        self.trains_in(None)
        handler.exit_barrier(self.finish_timeout)
        self.stage.observe().passed(self)
        self.finished = True
        self._exit(handler)

    def _stop(self, handler: StoreRendezvous) -> None:
        """SIGTERM: notice to the round (its workers save at one step), then it closes."""
        self.trains_in(None)
        with contextlib.suppress(RallypointError):  # out of reach: it leaves all the same
            handler.give_notice(0)
        self._exit(handler)

    def _exit(self, handler: StoreRendezvous) -> None:
        handler.close()
        self.alive = False
        if self.stage.schedule.backend == "c10d" and self.index == 0:
            self.stage.server.host_died()  # the store was in this process

    def _ended(self, error: BaseException) -> None:
        if isinstance(error, RallypointError) and str(error).strip():
            self.gave_up = f"{type(error).__name__}: {error}"
            self.stage.log(f"{self.node_id} gives up: {self.gave_up}")
            return
        raise Violation(f"{self.node_id} failed without a sentence: {error!r}") from error

    # --- what happens to it -------------------------------------------------------------------

    def trains_in(self, training: Round | None) -> None:
        """Its workers now run in ``training`` (None: none run), counted by the simulation
        so that its checks after each event look at each round once, not at each node."""
        if training == self.training:
            return
        counts = self.stage.training
        if self.training is not None:
            counts[self.training] -= 1
            if not counts[self.training]:
                del counts[self.training]
        if training is not None:
            counts[training] += 1
        self.training = training
        self.stage.server.dirty = True

    def crash(self) -> None:
        """SIGKILL: nothing more runs, nothing is closed; its liveness lapses, the ports
        it held are free, and a store it hosted is gone."""
        self.alive = False
        self.trains_in(None)
        self.world.kill()
        if self.stage.schedule.backend == "c10d" and self.index == 0:
            self.stage.server.host_died()

    def stop(self) -> None:
        """SIGTERM, delivered where its agent blocks (once its process runs again)."""
        main = self.main
        if main is not None and not main.done:
            self.world.interrupt(main, Stopped())

    def freeze(self, length: float) -> None:
        self.world.frozen_until = max(self.world.frozen_until, self.stage.hub.now + length)

    def finish(self, at: float, timeout: float) -> None:
        self.finish_at, self.finish_timeout = at, timeout

    @property
    def state(self) -> Any:
        assert self.handler is not None
        return self.handler.state
