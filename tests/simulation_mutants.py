"""Real defects of the rendezvous protocol, put back one at a time: each is caught by the
deterministic simulation (``rallypoint.testing.simulation``), at the seed given. Most are
races the simulation found in the protocol as it was, and that were fixed (the seed that
found each then is in its note; the schedules have changed since).

A mutant is a text edit of one protocol module: the edited module is executed apart, and
its functions (module-level, and the methods of its classes) replace the real ones for
the length of a test.

    python tests/simulation_mutants.py 3000   # the first seed that catches each (make soak)
"""

from __future__ import annotations

import importlib
import inspect
import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import FunctionType, ModuleType


@dataclass(frozen=True)
class Mutant:
    name: str
    module: str
    edits: tuple[tuple[str, str], ...]  # (text, replacement), each found once
    defect: str
    caught_at: int  # the first seed, counting from 0, whose schedule catches it


MUTANTS = (
    Mutant(
        "generation-never-reread",
        "rallypoint.rendezvous.rounds",
        (
            (
                "    if not stalled and view.round is not None:\n        return None",
                "    if True:\n        return None",
            ),
        ),
        "a node trusts its generation without re-reading it: left in a run that was "
        "started afresh, it waits there for good",
        21,
    ),
    Mutant(
        "frozen-node-alive",
        "rallypoint.rendezvous.liveness",
        (("        return self.clock() < self._grace_until", "        return True"),),
        "a node that stopped renewing its liveness (frozen, killed) still counts as alive",
        13,
    ),
    Mutant(
        "waiting-round-leader-ends-the-job-s-round",
        "rallypoint.rendezvous.joining",
        (("            if round_ > (yield from job_round(keys)):", "            if False:"),),
        "the leader of a round the job has yet to reach dies; a node waiting there ends "
        "it as though the job were in it (seed 241: a second job beside the running one)",
        176,
    ),
    Mutant(
        "min-counted-by-join-number",
        "rallypoint.rendezvous.leading",
        (("            if recorded or count >= target or short:", "            if recorded:"),),
        "the leader waits for join number MIN's record, which a join retried after a lost "
        "reply never writes (seed 325): the round waits until join_timeout",
        3,
    ),
    Mutant(
        "leaderless-round-waited-for",
        "rallypoint.rendezvous.joining",
        (
            (
                "                if node.clock() - waiting_since < s.close_timeout:",
                "                if True:",
            ),
        ),
        "join number 1 is never recorded (a lost reply, seed 95): the others wait for a "
        "leader that does not exist",
        21,
    ),
    Mutant(
        "heartbeat-failure-ignored-while-joining",
        "rallypoint.rendezvous.rounds",
        (
            (
                "        if self.node.heartbeat_failed is not None:\n"
                "            raise self.node.heartbeat_failed",
                "        pass",
            ),
        ),
        "the heartbeat gave up on the store while the node joined: it joins on, no longer "
        "kept alive, into a run the others started afresh (seed 1221)",
        1026,
    ),
    Mutant(
        "last-call-left-out",
        "rallypoint.rendezvous.leading",
        (
            (
                '            yield from calls.wait([keys.of_round(round_, "node", s.max_nodes)], '
                "s.last_call_timeout)",
                "            pass",
            ),
        ),
        "a new job's round closes as soon as MIN are in, without its last call",
        8,
    ),
    Mutant(
        "exit-barrier-passed-on-the-count",
        "rallypoint.rendezvous.exits",
        (
            (
                "            if looks and all(v is not None for v in (yield from "
                "calls.get_many(marks))):",
                "            if looks:",
            ),
        ),
        "a member passes the exit barrier when the count says all are in: a count applied "
        "twice (its reply lost, the add retried) lets it pass before another finished",
        0,
    ),
    Mutant(
        "run-deleted-before-every-mark",
        "rallypoint.rendezvous.protocol",
        (
            (
                "        if cleaner and (yield from calls.wait(marks, LEAVE_GRACE)):",
                "        if cleaner:",
            ),
        ),
        "group rank 0 deletes the run as soon as it leaves: a mark written after the "
        "deletion is left behind",
        3,
    ),
    Mutant(
        "retried-mark-left-behind",
        "rallypoint.rendezvous.protocol",
        (
            (
                "        if hosting is None and (yield from calls.get(keys.of_round(round_, "
                '"closed"))) is None:',
                "        if False:",
            ),
        ),
        "a member's mark whose reply was lost is written again after the run was deleted, "
        "and stays",
        202,
    ),
    Mutant(
        "master-port-let-go",
        "rallypoint.rendezvous.joining",
        (
            (
                "            if previous is not None:\n                previous.release()",
                "            if self.port is not None:\n                self.port.release()",
            ),
        ),
        "the round's master port is let go as soon as it is taken: another process on the "
        "host may take it before the workers bind it",
        0,
    ),
    Mutant(
        "store-outage-given-up-at-once",
        "rallypoint.rendezvous.retrying",
        (
            (
                "        if now - self.began >= self.retry_timeout - 0.001:",
                "        if True:",
            ),
        ),
        "an unreachable store is not retried: a blip of an outage ends the job",
        3,
    ),
    Mutant(
        "neighbour-never-checked",
        "rallypoint.rendezvous.heartbeat",
        (("        yield from self._check_neighbour(view)\n", "        pass\n"),),
        "no member watches the next one: a member killed is counted in the round for good",
        13,
    ),
    Mutant(
        "round-end-unnoticed",
        "rallypoint.rendezvous.heartbeat",
        (
            (
                "                if (yield from calls.wait([key], min(until_beat, WAKE_SLICE))):\n"
                "                    node.ended = max(node.ended, (view.keys.generation, round_))",
                "                if (yield from calls.wait([key], min(until_beat, WAKE_SLICE))):\n"
                "                    pass",
            ),
        ),
        "the heartbeat sees the next round open and does not say so: the node's workers "
        "train on in a round the job has left",
        3,
    ),
    Mutant(
        "stall-forgotten",
        "rallypoint.rendezvous.liveness",
        (("        return self.clock() - self._stalled_at <= seconds", "        return False"),),
        "a node back from a stall does not look whether the run was started afresh "
        "without it meanwhile (STALL_WATCH): it waits in the old run",
        21,
    ),
    Mutant(
        "beats-too-rare",
        "rallypoint.rendezvous.heartbeat",
        (
            (
                "                next_beat = now + ttl / 3",
                "                next_beat = now + ttl * 1.2",
            ),
        ),
        "a node renews its liveness less often than it lapses: the others take a live "
        "node for gone",
        13,
    ),
    Mutant(
        "unsealed-record-believed",
        "rallypoint.rendezvous.signing",
        (
            (
                "        value = None if seal is None else seal.open(key, raw)",
                "        value = raw if seal is None else (seal.open(key, raw) or raw)",
            ),
        ),
        "a sealed job reads a value that no node of it sealed: a stray's record counts",
        7,
    ),
    Mutant(
        "liveness-mark-standing-still",
        "rallypoint.rendezvous.signing",
        (
            (
                "            number = max(self.shared.sequence + 1, self.world.time_ns() // 1000)",
                "            number = 1",
            ),
        ),
        "a sealed node's liveness mark does not rise with its renewals: the others take "
        "it for gone",
        5,
    ),
    Mutant(
        "liveness-mark-from-the-wall-clock",
        "rallypoint.rendezvous.signing",
        (
            (
                "            number = max(self.shared.sequence + 1, self.world.time_ns() // 1000)",
                "            number = self.world.time_ns() // 1000",
            ),
        ),
        "a liveness mark is the wall clock alone: when the clock steps back, the mark "
        "falls, and the node looks gone",
        45,
    ),
    Mutant(
        "claim-never-checked",
        "rallypoint.rendezvous.signing",
        (
            (
                "        if key is None or seal is None:\n            return\n        now =",
                "        if True:\n            return\n        now =",
            ),
        ),
        "a sealed node does not see the run claimed anew after the store lost its data: "
        "it goes on in its old attempt beside the new one",
        731,
    ),
    Mutant(
        "lost-store-unnoticed",
        "rallypoint.rendezvous.heartbeat",
        (
            (
                "            raise store_lost(round_)  # the record every member read is gone",
                "            pass",
            ),
        ),
        "a member does not see its round's record gone with the store's data: it trains "
        "on beside the job a newcomer starts in the empty store",
        137,
    ),
    Mutant(
        "join-number-past-the-cap",
        "rallypoint.rendezvous.joining",
        (("        if index > self.settings.most_joins:", "        if False:"),),
        "a joiner keeps a number past the cap that a stray's adds gave it: no leader "
        "reads its record, and the round never forms",
        36,
    ),
    Mutant(
        "leave-given-up-at-a-lost-reply",
        "rallypoint.rendezvous.protocol",
        (
            (
                "            store = RetryingStore(self.store.store, LEAVE_GRACE, self.world)",
                "            store = self.store.store",
            ),
        ),
        "leaving is not retried: one lost reply while the run is deleted leaves its keys",
        3,
    ),
)


@contextmanager
def applied(mutant: Mutant) -> Iterator[None]:
    """The protocol with ``mutant``'s edit, until the block ends."""
    module = importlib.import_module(mutant.module)
    source = inspect.getsource(module)
    for old, new in mutant.edits:
        if source.count(old) != 1:
            raise AssertionError(f"mutant {mutant.name}: {old!r} is not once in {mutant.module}")
        source = source.replace(old, new)
    edited = ModuleType(module.__name__)
    edited.__file__ = module.__file__
    exec(compile(source, module.__file__ or "", "exec"), edited.__dict__)
    undo: list[tuple[object, str, object]] = []
    for name, value in vars(module).items():
        new = getattr(edited, name, None)
        if isinstance(value, FunctionType) and isinstance(new, FunctionType):
            undo.append((module, name, value))
            setattr(module, name, new)
        elif (
            isinstance(value, type)
            and isinstance(new, type)
            and value.__module__ == module.__name__
        ):
            for attr, member in vars(value).items():
                if isinstance(member, (FunctionType, property)) and attr in vars(new):
                    undo.append((value, attr, member))
                    setattr(value, attr, vars(new)[attr])
    try:
        yield
    finally:
        for owner, name, value in reversed(undo):
            setattr(owner, name, value)


def first_caught(mutant: Mutant, seeds: range) -> int | None:
    """The first of ``seeds`` whose schedule breaks an invariant with ``mutant`` applied."""
    from rallypoint.testing.simulation import run_seed

    with applied(mutant):
        for seed in seeds:
            if run_seed(seed).error is not None:
                return seed
    return None


def main(seeds: int) -> int:
    logging.disable(logging.CRITICAL)  # a mutant's warnings are what it is for
    missed = 0
    for mutant in MUTANTS:
        seed = first_caught(mutant, range(seeds))
        missed += seed is None
        print(
            f"{mutant.name}: first caught at seed {seed} (of {seeds}; recorded: {mutant.caught_at})"
        )
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 3000))
