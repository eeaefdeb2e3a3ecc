"""A run id used again: the generations of a run; and where a run stands (its round).

A scheduler that restarts a job (a Kubernetes Job, a Slurm requeue, a user running the
command again) starts new agents under the same run id. If no agent of the run's current
generation is alive (no live lease, key or heartbeat), its records are of a run that
failed or was killed: counting them would make the new agents wait for dead nodes. The
run id then starts afresh in the next generation (one compare-and-set on the generation's
``born`` marker, so that every new agent lands in the same one), and the dead generation's
keys are deleted.

The run's generation and the job's round are each a hint (``~generation``, ``state``)
followed by write-once markers (``~born/<g>``, ``<round>/open``): a stray that writes an
older hint back (a sealed value it read earlier: the seal binds key and value, not time)
cannot take a node back to a dead generation or round, since the markers after the hint
are read in the same look (``ahead``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

from rallypoint.errors import UsageError
from rallypoint.interfaces import CoordinationStore, StoreError
from rallypoint.rendezvous import calls, records
from rallypoint.rendezvous.calls import Steps
from rallypoint.rendezvous.keys import Keys
from rallypoint.rendezvous.signing import SignedStore, sealed

logger = logging.getLogger("rallypoint.rendezvous")

#: How many of a dead run's join records a node reads, at most, to be sure none of them
#: lives, where the job's size does not say (``rallypoint rendezvous status``).
MOST_CHECKED = 10_000
#: How many rounds back a new node looks for the run's newest closed round.
CLOSED_LOOKBACK = 16
#: How many markers one read looks at past a hint.
AHEAD = 8

#: Whether a heartbeat key is kept (``CoordinationStore.alive`` with the run's ttl, or a
#: node's view of it that allows for its own stalls).
Alive = Callable[[str], Steps[bool]]


def ahead(marker: Callable[[int], str], hint: int) -> Steps[int]:
    """The last ``n >= hint`` such that the markers of ``hint + 1 .. n`` all exist: where a
    run really is when its hint says ``hint`` (markers are written once, in order: a gap
    ends them)."""
    n = hint
    while True:
        found = yield from calls.get_many([marker(n + i) for i in range(1, AHEAD + 1)])
        for value in found:
            if value is None:
                return n
            n += 1


def current(keys: Keys) -> Steps[Keys]:
    """The run's keys in its current generation: the hint and the first marker after it
    in one read (almost every run stays in generation 0), then any markers after those."""
    raw, born = yield from calls.get_many([keys.generation_key, keys.born(1)])
    hint = records.decode_int(keys.generation_key, raw) if raw else 0
    if hint == 0 and born is None:
        return keys
    return keys.at((yield from ahead(keys.born, hint)))


def settle(
    keys: Keys,
    alive: Alive,
    nnodes: str = "",
    node_id: str = "",
    *,
    confirm: float = 0.0,
    most: int = MOST_CHECKED,
) -> Steps[Keys]:
    """The keys a node joining the run for the first time uses: the current generation's,
    or the next one's if no agent of the current one is alive (this node then starts it).

    A run with a live agent is joined as before, unless its agents were started with
    another ``--nnodes`` (``nnodes``, "MIN:MAX"): that is a job started by mistake under a
    live run's id, refused in one sentence.

    ``confirm``: seconds to look again before taking a run for abandoned (a sealed run: a
    stray that revoked its agents' leases, or deleted their keys, fools a first look, and
    starting afresh would delete the live run's keys); ``most``: the most join records
    read (``inspect``).
    """
    while True:
        now = yield from current(keys)
        gone, theirs = yield from inspect(now, alive, most)
        if gone is not None and confirm > 0:
            yield from calls.pause(confirm)  # a live agent renews its mark meanwhile
            gone, theirs = yield from inspect(now, alive, most)
        if gone is None:
            if (yield from current(keys)).generation != now.generation:
                continue  # another node started the next generation while this one read it
            if nnodes and theirs and theirs != nnodes:
                raise UsageError(
                    f"--rdzv-id {keys.run_id!r} is the id of a running job of --nnodes "
                    f"{theirs}, and this agent has --nnodes {nnodes}: give this job its own "
                    "--rdzv-id, or stop that one first."
                )
            return now
        following = now.generation + 1
        mine = (node_id or "?").encode()
        if (yield from calls.compare_set(keys.born(following), None, mine)) == mine:
            yield from calls.set_(keys.generation_key, records.encode_int(following))
            logger.info(
                "run %s: no agent of its last attempt is alive (%s): starting it afresh",
                keys.run_id,
                gone,
            )
            yield from calls.delete_prefix(now.root)


def job_round(keys: Keys) -> Steps[int]:
    """The job's round: the state key's (0 while it is absent: a new job writes nothing
    there until its first round ends, so that when a thousand nodes start at once none of
    them has to create it), or later where the rounds after it have opened (``ahead``)."""
    raw = yield from calls.get(keys.state())
    if raw is None:
        # A stray can write back an older state, never an absent one (that takes deleting
        # it, which breaks a run anyway): round 0, without a read more.
        return 0
    state = records.decode_state(keys.state(), raw)
    return (yield from ahead(lambda r: keys.of_round(r, "open"), state))


def newest_closed(keys: Keys, round_: int) -> Steps[records.RoundRecord | None]:
    """The record of the newest closed round up to ``round_``, in one read: rounds that
    failed to form (a leader died) leave none, so this looks back CLOSED_LOOKBACK rounds.
    None when there is none, or the newest cannot be read."""
    back = list(range(round_, max(-1, round_ - CLOSED_LOOKBACK), -1))
    closed = [keys.of_round(r, "closed") for r in back]
    for key, raw in zip(closed, (yield from calls.get_many(closed)), strict=True):
        if raw:
            with contextlib.suppress(StoreError):
                return records.decode_round(key, raw)
            return None
    return None


def inspect(keys: Keys, alive: Alive, most: int = MOST_CHECKED) -> Steps[tuple[str | None, str]]:
    """Whether the run at ``keys`` was abandoned: how it was left when none of its agents
    (the members of its newest closed round, the joiners of the round it is in) is alive,
    else None (no records, or an agent of it lives, or may: a join number still without
    its record is a node writing it); and its ``--nnodes`` where a record says. A live run
    answers in a few reads: its first joiner is usually alive. ``most``: the most join
    numbers read (a counter anyone can add to sizes no read)."""
    round_ = yield from job_round(keys)
    first = keys.of_round(round_, "node", 1)
    leader = node_or_none(first, (yield from calls.get(first)))
    nnodes = leader.nnodes if leader else ""
    if leader is None and round_ == 0:
        return None, nnodes  # a new run, or one whose first joiner is writing its record
    if leader is not None and (yield from alive(keys.heartbeat(leader.node_id))):
        return None, nnodes
    candidates = [leader.node_id] if leader else []
    record = yield from newest_closed(keys, round_)  # the newest closed round's members
    if record is not None:
        candidates += record.node_ids
    joined = min((yield from calls.add(keys.of_round(round_, "joined"), 0)), most)
    numbers = [keys.of_round(round_, "node", i) for i in range(1, joined + 1)]
    for key, raw in zip(numbers, (yield from calls.get_many(numbers)), strict=True):
        if raw is None:
            return None, nnodes  # taken, not yet recorded: a node is joining right now
        node = node_or_none(key, raw)
        if node is not None:
            candidates.append(node.node_id)
            nnodes = nnodes or node.nnodes
    for node_id in dict.fromkeys(candidates):
        if (yield from alive(keys.heartbeat(node_id))):
            return None, nnodes
    return f"round {round_}, {len(set(candidates))} nodes, none with a heartbeat", nnodes


def node_or_none(key: str, raw: bytes | None) -> records.NodeRecord | None:
    """A joiner's record, or None for an absent, void (empty) or unreadable one."""
    if not raw:
        return None
    try:
        return records.decode_node(key, raw)
    except StoreError:
        return None


# --- for callers outside the protocol (status, the CLI): one store, this thread ---------


def current_generation(store: CoordinationStore, keys: Keys) -> Keys:
    """``current``, read from ``store``."""
    return calls.drive(current(keys), store)


def has_records(store: CoordinationStore, keys: Keys) -> bool:
    """Whether ``store`` holds records of the run at ``keys`` (its current generation's):
    a sealed store read with the job's token, once it found the run's token claim
    (``SignedStore.view``); else its state, its token key (a sealed run, read without the
    token: reading it will say so), or a join of round 0 (a new job writes nothing else
    before its first round ends)."""
    if isinstance(store, SignedStore):
        return store.attempt is not None
    return (
        store.get(keys.state()) is not None
        or store.get(keys.token_key) is not None
        or store.get(keys.of_round(0, "joined")) is not None
    )


def job_behind(store: CoordinationStore, keys: Keys, sealed_only: bool = False) -> bool:
    """Whether ``store``, read as it is (no seal checked), holds records of a job under the
    run's keys besides its token claim: a generation, the round counter, round 0's joins
    or record. ``sealed_only``: only records that look sealed count (for a node without a
    token, whose own job's records are not)."""
    names = [
        keys.generation_key,
        keys.born(1),
        keys.state(),
        keys.of_round(0, "node", 1),
        keys.of_round(0, "closed"),
    ]
    found = [raw for raw in store.get_many(names) if raw]
    if sealed_only:
        return any(sealed(raw) for raw in found)
    return bool(found) or store.get(keys.of_round(0, "joined")) is not None


def inspect_run(store: CoordinationStore, keys: Keys, ttl: float) -> tuple[str | None, str]:
    """``inspect``, read from ``store``, a node alive when it renewed within ``ttl``."""
    return calls.drive(inspect(keys, lambda key: calls.alive(key, ttl)), store)
