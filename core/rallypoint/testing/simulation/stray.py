"""The adversary: a client that reaches the job's store without the job's token.

It knows the key layout (``rendezvous.keys``: it is documented) and what it read there. It
writes unsealed records, replays sealed values it read (at another key, or at the same
key after they changed), bumps the counters, forges the liveness of nodes (keeps their
heartbeat keys alive, writes their marks), and, when drawn, deletes keys. Drawn only for
a job with a token: without one, the store trusts whoever reaches it (docs/security.md).

What must still hold: no job failure and no round held past its timeouts because of it;
where it deletes keys (which no seal can stop), no split job, and a sentence for any
failure.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable

from rallypoint.interfaces import StoreError
from rallypoint.rendezvous.keys import Keys
from rallypoint.testing.simulation.stage import RUN_ID, Round, Stage
from rallypoint.testing.simulation.store import Connection
from rallypoint.testing.simulation.world import NodeWorld

#: A round's keys that hold values (records, marks) and those that are counters.
_VALUES = ("closed", "open", "expected", "node/1", "node/2", "done/0", "done/1", "left/0", "left/1")
_COUNTERS = ("joined", "done", "left")


class Stray:
    def __init__(self, stage: Stage, moves: tuple[str, ...], job: Callable[[], Round]) -> None:
        self.stage = stage
        self.moves = moves
        self.job = job  # the round the job is in, as the stray can read it
        self.world = NodeWorld(stage.hub, stage.ports, "stray-host", 1.0)
        self.conn = Connection(stage.server, self.world, -1, "stray")
        self.rng = random.Random(f"stray moves {stage.schedule.seed}")
        self.keys = Keys(stage.schedule.settings.prefix, RUN_ID)
        self.seen: dict[str, bytes] = {}  # sealed values it read, to replay
        self.stopped = False

    def start(self) -> None:
        self.world.start(self._run, "stray")

    def stop(self) -> None:
        self.stopped = True

    def _run(self) -> None:
        while not self.stopped:
            self.world.sleep(self.rng.uniform(0.2, 2.0))
            move = self.rng.choice(self.moves)
            with contextlib.suppress(StoreError):  # as for anyone: it tries again
                getattr(self, "_" + move)()

    # --- what it writes where ---------------------------------------------------------------

    def _key(self, counter: bool = False) -> str:
        """A key of the job's, around the round it is in: one that holds a value, or a
        counter (a value written there would stop the job's adds: that is a deletion's
        kind of harm, drawn with ``deletes``)."""
        _, generation, round_ = self.job()
        keys = self.keys.at(generation)
        round_ = max(0, round_ + self.rng.choice((0, 1, 1, 2)))
        choice = self.rng.random()
        if counter:
            if choice < 0.2:
                return keys.heartbeat(self._node())  # a counter on TCPStore
            return keys.of_round(round_, self.rng.choice(_COUNTERS))
        if choice < 0.15:
            return keys.state()
        if choice < 0.25:
            return self.keys.generation_key
        part = self.rng.choice(_VALUES)
        return keys.of_round(round_, *part.split("/"))

    def _node(self) -> str:
        agents = self.stage.agents
        return self.rng.choice(agents).node_id if agents else "n0"

    def _unsealed(self) -> None:
        """An unsealed value where the job has none yet (a key it will write: a later
        round's). Over a record the job wrote, a write destroys it: that is ``deletes``."""
        value = self.rng.choice((b"1", b"0", b"{}", b'{"round": 99}', b"garbage"))
        self.conn.compare_set(self._key(), None, value)  # only where there is nothing

    def _replayed(self) -> None:
        """A sealed value it read, written again where the job has none now: at another
        key, or at its own after the job deleted it."""
        key = self._key()
        raw = self.conn.get(key)
        if raw is not None:
            self.seen[key] = raw
        if not self.seen:
            return
        source = self.rng.choice(sorted(self.seen))
        target = source if self.rng.random() < 0.5 else key
        self.conn.compare_set(target, None, self.seen[source])

    def _counters(self) -> None:
        key = self._key(counter=True)
        self.conn.add(key, self.rng.choice((1, 2, 1000)))

    def _heartbeats(self) -> None:
        key = self.keys.at(self.job()[1]).heartbeat(self._node())
        if self.stage.schedule.backend == "c10d":
            self.conn.add(key, 1)  # a counter that moves: the owner looks alive
        else:
            self.conn.keep_alive(key, self.stage.schedule.settings.heartbeat_timeout)
        mark = self.rng.choice((b"99999999999999999", b"1 gone", b"5"))
        self.conn.set(key + "/mark", mark)

    def _deletes(self) -> None:
        """What no seal can stop: a key deleted, a record overwritten, a counter taken
        back or made no number."""
        move = self.rng.random()
        if move < 0.15:
            self.conn.set(self._key(counter=True), b"not a number")
        elif move < 0.3:
            self.conn.add(self._key(counter=True), -1000)
        elif move < 0.5:
            self.conn.set(self._key(), b"garbage")
        else:
            self.conn.delete_prefix(self._key(counter=self.rng.random() < 0.3))
