"""Hang detection: which of this node's ranks is stuck, from their progress reports.

Each worker reports every half second (``rallypoint.worker.progress_reporter``): how many
progress signals it has counted (optimizer steps, forward passes, batches, collectives
and checkpoint saves that finished), when that count last moved, whether it waits in a
collective (which, since when, from which line) or saves or loads a checkpoint. This
module turns those reports into a verdict; it does no I/O and reads no clock (every call
is given ``now``), so that a test drives it through any timeline.

A rank's **deadline** is learned from its own history, as NVIDIA's launcher calculates
its timeouts: ``FACTOR`` times the longest gap between two progress signals seen so far,
and never under the floor (``--hang-floor``). Start-up and the first step (compilation
included) are not timed: a rank is timed once it is *armed* (its first optimizer step, or
its first ``rallypoint.progress()``); a checkpoint save or load is not timed either.

A rank is killed only on evidence (``HangWatch.verdict``):

* **stuck**: it made no progress past its deadline, outside any collective or checkpoint,
  while another rank has waited in a collective for at least the floor;
* **collective**: every rank of the job waits in a collective past its deadline (a
  collective that never completes, or ranks that called different ones);
* **silent**: it stopped reporting for the ceiling (``--hang-ceiling``): stopped, or
  blocked where not even its reporting thread runs; and any rank waiting in a collective
  for the ceiling, which this node alone cannot explain (its peers are elsewhere).

Across nodes, the evidence is shared through the rendezvous (``rendezvous.waits``): a node
whose ranks waited in a collective for at least the floor says so (``shared``), and a node
that holds a suspect and no evidence of its own reads what the others said (``wanted``),
so that a rank stuck on one node is found from its peers waiting on another, and a
collective that every rank of every node waits in is seen whole. What a peer said is
checked as a worker's report is, and counts only as what it says: ranks that waited at
least so long, when it was written.

When every rank is busy outside collectives with no progress signal (minutes of numpy
between steps), that is work, not a hang: ``verdict`` says so once (``Verdict.kill`` is
empty) and nothing is killed. ``--watchdog-timeout`` is a fixed deadline instead: a rank
with no progress signal for that long is killed, whatever it does.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from rallypoint.agent.monitoring.steps import finite
from rallypoint.worker.progress_reporter import REPORT_INTERVAL

#: A rank's deadline is this many times the longest gap between its progress signals.
FACTOR = 5.0
#: A rank that sent no report for this many report intervals has stopped answering: what
#: it said last (in a collective, say) is no longer taken as true.
UNANSWERED_REPORTS = 4
#: What a node shares of its waits (``HangWatch.shared``), and reads of a peer's, is
#: bounded: so many places (a collective and the line it was called from) ...
SHARED_PLACES = 4
#: ... and so many ranks in all.
SHARED_RANKS = 1024

STUCK = "stuck"
COLLECTIVE = "collective"
SILENT = "silent"
WATCHDOG = "watchdog"
WORK = "work"


@dataclass(frozen=True)
class HangSettings:
    """How hangs are found: ``auto`` learns each rank's deadline, ``off`` finds none;
    ``fixed`` (``--watchdog-timeout``) kills any rank silent that long, in either mode."""

    mode: str = "auto"
    floor: float = 60.0
    ceiling: float = 600.0
    fixed: float | None = None

    @property
    def on(self) -> bool:
        return self.mode != "off" or self.fixed is not None


@dataclass(frozen=True)
class Waiting:
    """A collective a rank waits in: its name, the script's line, since when."""

    op: str
    site: str
    since: float

    def describe(self) -> str:
        return f"{self.op} ({self.site})" if self.site else self.op


@dataclass
class RankState:
    """What this node knows of one local rank in the current attempt."""

    local_rank: int
    rank: int
    heard: float  # when its last report came (monotonic)
    progressed: float | None = None  # when its count of progress signals last moved
    armed: bool = False
    longest_gap: float = 0.0
    waiting: Waiting | None = None
    phase: str | None = None
    phase_since: float | None = None
    thread: int | None = None
    _gap_from: float | None = None  # the progress a timed gap runs from

    def deadline(self, settings: HangSettings) -> float:
        return max(settings.floor, FACTOR * self.longest_gap)

    def answering(self, now: float) -> bool:
        return now - self.heard < UNANSWERED_REPORTS * REPORT_INTERVAL + 1.0

    def idle(self, now: float) -> float:
        """Seconds since its last progress signal (0 before its first)."""
        return 0.0 if self.progressed is None else now - self.progressed


@dataclass(frozen=True)
class Verdict:
    """What ``verdict`` found: its kind, the local ranks to kill (none for ``work``), the
    ranks it is about, and since when the culprits made no progress (monotonic)."""

    kind: str
    kill: tuple[int, ...]
    suspects: tuple[RankState, ...]
    waiters: tuple[RankState, ...] = ()
    since: Mapping[int, float] = field(default_factory=dict)
    deadline: float = 0.0

    def sentence(self, now: float, places: Mapping[int, str] | None = None) -> str:
        """One line: who made no progress for how long, where the others waited, and where
        each culprit was (``places``: local rank -> "data.py:120 in read()")."""
        places = places or {}
        parts = [self._what(now)]
        for rank in self.suspects:
            place = places.get(rank.local_rank)
            if place:
                parts.append(f"rank {rank.rank} was at {place}")
        return "; ".join(parts)

    def _what(self, now: float) -> str:
        suspects = _ranks(r.rank for r in self.suspects)
        # Rounded as the failure's stalled_seconds is, so that the two always read alike.
        idle = max(
            (round(now - self.since.get(r.local_rank, now), 3) for r in self.suspects),
            default=0.0,
        )
        if self.kind == STUCK:
            waits = _waits(self.waiters)
            return f"{suspects} made no progress for {idle:.0f} s while {waits}"
        if self.kind == COLLECTIVE:  # the waiters: the other nodes' ranks, all late too
            everyone = (*self.suspects, *self.waiters)
            ops = {r.waiting.describe() for r in everyone if r.waiting is not None}
            how = "the same collective" if len(ops) == 1 else "different collectives"
            return f"every rank waited in {how} for {idle:.0f} s: {_waits(everyone)}"
        if self.kind == SILENT:
            return f"{suspects} stopped answering or waited alone for {idle:.0f} s"
        if self.kind == WATCHDOG:
            return f"{suspects} made no progress for {idle:.1f} s (watchdog)"
        return (
            f"{suspects} made no progress for {idle:.0f} s, outside any collective: taken as work"
        )


class HangWatch:
    """The current attempt's ranks, fed by their reports, and the verdict on them.

    ``report`` is called on the worker channel's receiver thread, the rest on the
    monitor's: one lock keeps the two apart."""

    def __init__(self, settings: HangSettings, world_size: int = 0) -> None:
        self.settings = settings
        self.world_size = world_size  # the job's ranks: all local means a whole view
        self._lock = threading.Lock()
        self._since = math.inf  # no attempt yet: every report is stale
        self._ranks: dict[int, RankState] = {}
        self._work_said = False  # the current stretch of work was logged already

    def watch(self, started: float, world_size: int) -> None:
        """A new attempt's workers start at ``started`` (monotonic); forget the last one's."""
        with self._lock:
            self._since = started
            self.world_size = world_size
            self._ranks.clear()
            self._work_said = False

    def report(self, data: Mapping[str, Any], now: float) -> None:
        """One progress report from the worker channel; malformed or stale ones are dropped
        (the socket is the job user's, but a report is still checked before it counts)."""
        parsed = _parse(data)
        if parsed is None:
            return
        local_rank, rank, sent = parsed["local_rank"], parsed["rank"], parsed["sent"]
        with self._lock:
            if sent < self._since:
                return  # an attempt already replaced
            state = self._ranks.get(local_rank)
            if state is None:
                state = self._ranks[local_rank] = RankState(local_rank, rank, heard=now)
            _update(state, parsed, now)
            if state.progressed is not None and now - state.progressed < REPORT_INTERVAL * 2:
                self._work_said = False

    def ranks(self) -> list[RankState]:
        with self._lock:
            return list(self._ranks.values())

    def verdict(
        self, running: Iterable[int], now: float, peers: Mapping[str, object] | None = None
    ) -> Verdict | None:
        """The evidence of a hang among the ``running`` local ranks, if any (see module);
        ``peers``: what the round's other nodes shared (node id -> ``shared``'s value, as
        read from the store: unchecked)."""
        running = set(running)
        with self._lock:
            ranks = [r for r in self._ranks.values() if r.local_rank in running]
            if not ranks:
                return None
            others = _peer_waits(peers or {}, self.world_size, self.settings.floor, now)
            found = self._fixed(ranks, now) or self._evidence(ranks, running, now, others)
            if found is not None and found.kind == WORK:
                if self._work_said:
                    return None
                self._work_said = True
            return found

    def shared(self, now: float) -> dict[str, Any] | None:
        """What this node tells the round's other nodes (``rendezvous.waits``): where its
        ranks that waited in a collective for at least the floor wait (``waits``: op,
        script line, ranks, seconds waited) and which of them waited past their own
        deadlines (``late``). None when there is nothing to tell, or nobody to tell it to
        (the whole job is on this node)."""
        with self._lock:
            if self.settings.mode == "off" or len(self._ranks) >= self.world_size:
                return None
            waiters = _waiters(self._ranks.values(), self.settings, now)
            if not waiters:
                return None
            places: dict[tuple[str, str], list[RankState]] = {}
            for rank in waiters:
                assert rank.waiting is not None
                places.setdefault((rank.waiting.op, rank.waiting.site), []).append(rank)
            waits = [
                {
                    "op": op,
                    "site": site,
                    "ranks": sorted(r.rank for r in group),
                    "waited": round(min(now - _waited(r) for r in group), 3),
                }
                for (op, site), group in list(places.items())[:SHARED_PLACES]
            ]
            late = [r.rank for r in waiters if now - _waited(r) >= r.deadline(self.settings)]
            return {"waits": waits, "late": sorted(late)}

    def wanted(self, now: float) -> bool:
        """Whether this node needs what the others shared: it holds a rank stuck with no
        local rank waiting for it, or all its ranks waited in a collective past their
        deadlines where the job has ranks on other nodes."""
        with self._lock:
            ranks, settings = list(self._ranks.values()), self.settings
            if settings.mode == "off" or not ranks or len(ranks) >= self.world_size:
                return False
            waiters = _waiters(ranks, settings, now)
            if not waiters:
                return any(_stuck(r, settings, now) for r in ranks)
            return all(r in waiters and now - _waited(r) >= r.deadline(settings) for r in ranks)

    def seconds_left(self) -> float:
        """How soon the monitor should look again: every second while hangs are watched
        (reports come every half second; no verdict needs finer timing)."""
        return 1.0 if self.settings.on else math.inf

    def _fixed(self, ranks: list[RankState], now: float) -> Verdict | None:
        timeout = self.settings.fixed
        if timeout is None:
            return None
        overdue = [r for r in ranks if r.progressed is not None and now - r.progressed >= timeout]
        if not overdue:
            return None
        # Blame as the evidence does: a rank that waits in a collective waits for another.
        # Progress times are sampled (a report's), so the culprit may be overdue a report or
        # two after the ranks waiting for it: they wait that long for it to be.
        culprits = [r for r in overdue if not _in_collective(r, now)]
        if not culprits:
            outside = [r for r in ranks if r not in overdue and not _in_collective(r, now)]
            since = min(r.progressed or now for r in overdue)
            if outside and now - since < timeout + UNANSWERED_REPORTS * REPORT_INTERVAL:
                return None
            culprits = overdue
        overdue = culprits
        return Verdict(
            WATCHDOG,
            kill=tuple(r.local_rank for r in overdue),
            suspects=tuple(overdue),
            since={r.local_rank: r.progressed or now for r in overdue},
            deadline=timeout,
        )

    def _evidence(
        self, ranks: list[RankState], running: set[int], now: float, others: PeerWaits
    ) -> Verdict | None:
        settings = self.settings
        if settings.mode == "off":
            return None
        silent = [r for r in ranks if now - r.heard >= settings.ceiling]
        alone = [
            r
            for r in ranks
            if r.answering(now) and r.waiting and now - r.waiting.since >= settings.ceiling
        ]
        if silent or alone:
            culprits = silent + alone
            return Verdict(
                SILENT,
                kill=tuple(r.local_rank for r in culprits),
                suspects=tuple(culprits),
                since={r.local_rank: _last(r) for r in culprits},
                deadline=settings.ceiling,
            )
        local = _waiters(ranks, settings, now)
        waiters = [*local, *others.waiters]
        stuck = [r for r in ranks if _stuck(r, settings, now)]
        if stuck and waiters:
            return Verdict(
                STUCK,
                kill=tuple(r.local_rank for r in stuck),
                suspects=tuple(stuck),
                waiters=tuple(waiters),
                since={r.local_rank: _last(r) for r in stuck},
                deadline=max(r.deadline(settings) for r in stuck),
            )
        late = [r for r in local if now - _waited(r) >= r.deadline(settings)]
        # The whole job: every local rank reports and waits late, and the other nodes'
        # late ranks make up the rest (none where the job is all on this node).
        ranks_late = {r.rank for r in late} | others.late
        whole = len(running) == len(ranks) == len(late) and len(ranks_late) >= self.world_size > 0
        if whole:
            return Verdict(
                COLLECTIVE,
                kill=tuple(r.local_rank for r in late),
                suspects=tuple(late),
                waiters=tuple(r for r in others.waiters if r.rank in others.late),
                since={r.local_rank: _waited(r) for r in late},
                deadline=max(r.deadline(settings) for r in late),
            )
        if stuck and len(stuck) == len(ranks) and self._all_busy(stuck, now):
            return Verdict(
                WORK,
                kill=(),
                suspects=tuple(stuck),
                since={r.local_rank: _last(r) for r in stuck},
                deadline=max(r.deadline(settings) for r in stuck),
            )
        return None

    def _all_busy(self, stuck: list[RankState], now: float) -> bool:
        """Whether ranks all stuck are the whole job busy: where the job has ranks on other
        nodes, not before half a floor past the deadline, while their waits (shared once
        they reach the floor, a heartbeat or two late) may still be on their way."""
        if len(stuck) >= self.world_size:
            return True
        grace = self.settings.floor / 2
        return all(now - _last(r) >= r.deadline(self.settings) + grace for r in stuck)


@dataclass(frozen=True)
class PeerWaits:
    """What the round's other nodes said of their ranks' waits: those that waited at least
    the floor (as ranks that never run here: ``local_rank`` -1), and those past their own
    deadlines."""

    waiters: tuple[RankState, ...] = ()
    late: frozenset[int] = frozenset()


class SharedWaits:
    """A ``HangWatch`` as the rendezvous's ``WaitSource`` (``RendezvousRequest.waits``),
    on the agent's clock: the heartbeat thread asks it."""

    def __init__(self, hangs: HangWatch, clock: Callable[[], float]) -> None:
        self.hangs = hangs
        self.clock = clock

    def shared(self) -> dict[str, Any] | None:
        return self.hangs.shared(self.clock())

    def wanted(self) -> bool:
        return self.hangs.wanted(self.clock())


def _peer_waits(
    peers: Mapping[str, object], world_size: int, floor: float, now: float
) -> PeerWaits:
    """The peers' shared waits, checked: a node's whole summary is dropped when any of
    it is malformed, a rank outside the job or one this node already named counts once."""
    waiters: dict[int, RankState] = {}
    late: set[int] = set()
    for summary in peers.values():
        parsed = _peer_summary(summary, world_size)
        if parsed is None:
            continue
        waits, said_late = parsed
        for op, site, ranks, waited in waits:
            if waited < floor:
                continue
            for rank in ranks:
                if rank not in waiters and len(waiters) < SHARED_RANKS:
                    waiting = Waiting(op, site, now - waited)
                    waiters[rank] = RankState(-1, rank, heard=now, waiting=waiting)
        late |= {r for r in said_late if r in waiters}
    return PeerWaits(tuple(waiters.values()), frozenset(late))


def _peer_summary(
    value: object, world_size: int
) -> tuple[list[tuple[str, str, list[int], float]], list[int]] | None:
    if not isinstance(value, Mapping):
        return None
    waits, late = value.get("waits"), value.get("late")
    if not (_rank_list(late, world_size) and isinstance(waits, list)):
        return None
    if not 0 < len(waits) <= SHARED_PLACES:
        return None
    parsed = []
    for wait in waits:
        if not isinstance(wait, Mapping):
            return None
        op, site, ranks, waited = (wait.get(k) for k in ("op", "site", "ranks", "waited"))
        if not (isinstance(op, str) and isinstance(site, str) and finite(waited)):
            return None
        if not _rank_list(ranks, world_size) or not ranks or float(waited) < 0:  # type: ignore[arg-type]
            return None
        parsed.append((op[:64], site[:200], list(ranks), float(waited)))  # type: ignore[arg-type]
    return parsed, list(late)  # type: ignore[arg-type]


def _rank_list(value: object, world_size: int) -> bool:
    """A list of at most SHARED_RANKS ranks of the job."""
    return (
        isinstance(value, list)
        and len(value) <= SHARED_RANKS
        and all(_whole(r) and r < world_size for r in value)
    )


def _waiters(ranks: Iterable[RankState], settings: HangSettings, now: float) -> list[RankState]:
    """Those that answer and waited in a collective for at least the floor."""
    return [
        r
        for r in ranks
        if r.answering(now) and r.waiting is not None and now - r.waiting.since >= settings.floor
    ]


def _stuck(rank: RankState, settings: HangSettings, now: float) -> bool:
    """Armed, outside any collective and checkpoint (or no longer answering), and with no
    progress past its deadline."""
    if not rank.armed or rank.progressed is None:
        return False
    if rank.answering(now) and (rank.waiting is not None or rank.phase is not None):
        return False
    return now - rank.progressed >= rank.deadline(settings)


def _in_collective(rank: RankState, now: float) -> bool:
    """Whether it waits in a collective, as far as its reports still say."""
    return rank.waiting is not None and rank.answering(now)


def _last(rank: RankState) -> float:
    return rank.progressed if rank.progressed is not None else rank.heard


def _waited(rank: RankState) -> float:
    assert rank.waiting is not None
    return rank.waiting.since


def _update(state: RankState, report: Mapping[str, Any], now: float) -> None:
    """Fold one report into the rank's state, and learn from the gap it closed."""
    state.heard = now
    state.rank = report["rank"]
    state.thread = report["thread"]
    progressed = report["progressed"]
    phase = report["phase"]
    if phase is not None or state.phase is not None:
        state._gap_from = None  # a checkpoint is not timed: the gap over it is not learned
    if progressed is not None and (state.progressed is None or progressed > state.progressed):
        if state.armed and state._gap_from is not None:
            state.longest_gap = max(state.longest_gap, progressed - state._gap_from)
        state.progressed = progressed
        state._gap_from = progressed if report["armed"] else None
    state.armed = state.armed or report["armed"]
    state.waiting = report["collective"]
    state.phase, state.phase_since = phase if phase is not None else (None, None)


def _parse(data: Mapping[str, Any]) -> dict[str, Any] | None:
    """A report's fields, typed, or None when one is missing or of the wrong type."""
    local_rank, rank = data.get("local_rank"), data.get("rank")
    sent, progressed = data.get("sent"), data.get("progressed")
    if not (_whole(local_rank) and _whole(rank) and finite(sent)):
        return None
    if progressed is not None and not finite(progressed):
        return None
    thread = data.get("thread")
    return {
        "local_rank": local_rank,
        "rank": rank,
        "sent": float(sent),  # type: ignore[arg-type]
        "progressed": None if progressed is None else min(float(progressed), float(sent)),  # type: ignore[arg-type]
        "armed": data.get("armed") is True,
        "collective": _collective(data.get("collective")),
        "phase": _phase(data.get("phase")),
        "thread": thread if _whole(thread) else None,
    }


def _collective(value: object) -> Waiting | None:
    if not isinstance(value, Mapping):
        return None
    op, site, since = value.get("op"), value.get("site"), value.get("since")
    if not isinstance(op, str) or not finite(since):
        return None
    return Waiting(op[:64], site[:200] if isinstance(site, str) else "", float(since))  # type: ignore[arg-type]


def _phase(value: object) -> tuple[str, float] | None:
    if not isinstance(value, Mapping):
        return None
    name, since = value.get("name"), value.get("since")
    if not isinstance(name, str) or not finite(since):
        return None
    return name[:64], float(since)  # type: ignore[arg-type]


def _whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _ranks(ranks: Iterable[int]) -> str:
    """``rank 3``, ``ranks 0-2``, ``ranks 0, 2, 5-7``."""
    numbers = sorted(set(ranks))
    runs: list[str] = []
    start = prev = None
    for n in [*numbers, None]:
        if n is not None and prev is not None and n == prev + 1:
            prev = n
            continue
        if start is not None:
            runs.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = n
    word = "rank" if len(numbers) == 1 else "ranks"
    return f"{word} {', '.join(runs)}"


def _waits(ranks: Iterable[RankState]) -> str:
    """``ranks 0-2 waited in all_reduce (train.py:88)``, grouped by where they wait."""
    by_place: dict[str, list[int]] = {}
    for rank in ranks:
        if rank.waiting is not None:
            by_place.setdefault(rank.waiting.describe(), []).append(rank.rank)
    places = sorted(by_place.items(), key=lambda item: min(item[1]))  # as every node says it
    return ", ".join(f"{_ranks(numbers)} waited in {place}" for place, numbers in places)
