"""The goodput account, kept up to date one event at a time.

An ``Accountant`` takes a job's events as they come (a metrics sink's, typed) or as an
event log holds them (records), and answers at any moment:

- ``snapshot(now)``: the sums (seconds per phase, goodput, failures), in time that grows
  with the nodes and the phases, not with the events: each node keeps the seconds of its
  phases so far and of its attempts that are over, and only the running attempt's split is
  worked out again;
- ``account(now)``: the whole account with every node's timeline, for the report.

Both give the same figures. ``now`` ends a live account: the phase each node is in lasts
until then; without it each node ends at its last event. A new event may tell what time
already counted was (the first step after a restart ends the restart, a load says how long
it took): the account of the past changes then, as it should, and a reader that serves
totals which must never go down keeps the most it served (the Prometheus sink does).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable, Mapping
from typing import Any

from rallypoint import events as ev
from rallypoint.events import Event
from rallypoint.goodput.account import Account, Incident, Node, Segment, Snapshot
from rallypoint.goodput.attempts import Run, Steps
from rallypoint.goodput.fields import is_event
from rallypoint.goodput.incidents import incidents
from rallypoint.goodput.painting import merged, painted, split
from rallypoint.goodput.phases import PHASES, TRAINING
from rallypoint.goodput.stalls import Stalls, stall_at
from rallypoint.goodput.timeline import NodeTimeline


@dataclasses.dataclass
class _Settled:
    """The seconds of a node's attempts that are over (all but its newest)."""

    seconds: dict[str, float] = dataclasses.field(
        default_factory=lambda: dict.fromkeys(PHASES, 0.0)
    )
    runs: int = 0  # how many of its attempts are in ``seconds``


class Accountant:
    """A job's goodput account, kept one event at a time: ``add`` takes an agent's events
    (a metrics sink's), ``add_record`` an event log's, in time order; ``snapshot(now)``
    gives the sums in time that does not grow with the events, ``account(now)`` the whole
    account with every node's timeline.

    ``timelines=False``: keep the sums alone, not the segments, saves and loads of each
    node that ``account`` shows (a metrics sink's: it serves snapshots). What is kept then
    grows with the attempts and the saves that held training up, not with the events.
    """

    def __init__(self, *, timelines: bool = True) -> None:
        self.timelines = timelines
        self._nodes: dict[str, NodeTimeline] = {}
        self._settled: dict[str, _Settled] = {}
        self._steps = Steps()
        self._stalls = Stalls()
        self._stragglers: list[dict[str, Any]] = []  # in the order they came
        self._incidents: list[Incident] | None = []  # None: to work out again
        # Attempts over that trained after this time are split again at the next snapshot:
        # a late stall, or the job's first step (attempts with none then only got ready).
        self._stale = math.inf

    def add(self, event: Event) -> None:
        """Take one of the agent's events (as a metrics sink gets them)."""
        record = json.loads(event.to_json()) if event.name == ev.STRAGGLER else None
        run = event.run
        self._take(
            event.name, float(event.wall_time), run.node_id, run.hostname, event.data, record
        )

    def add_record(self, record: Mapping[str, Any]) -> None:
        """Take one record of an event log; one that is not a rallypoint event is ignored."""
        if is_event(record):
            self._take_record(record)

    def add_records(self, records: Iterable[Mapping[str, Any]]) -> Accountant:
        """Take the records of event logs, any nodes in any order: in time order."""
        events = sorted((r for r in records if is_event(r)), key=lambda r: float(r["wall_time"]))
        for record in events:
            self._take_record(record)
        return self

    def _take_record(self, record: Mapping[str, Any]) -> None:
        name, node, host = record["event"], record["node"], str(record.get("host") or "")
        straggler = dict(record) if name == ev.STRAGGLER else None
        self._take(name, float(record["wall_time"]), node, host, record, straggler)

    def _take(
        self,
        name: str,
        at: float,
        node: str,
        host: str,
        data: Mapping[str, Any],
        straggler: dict[str, Any] | None,
    ) -> None:
        timeline = self._nodes.get(node)
        if timeline is None:
            timeline = self._nodes[node] = NodeTimeline(node, host, at, self.timelines)
            self._settled[node] = _Settled()
        if name == ev.CHECKPOINT_SAVED and (held := stall_at(at, data)) is not None:
            self._stalls.add(*held)
            self._stale = min(self._stale, held[0])
        if straggler is not None:
            self._stragglers.append(straggler)
        known = self._steps.known
        if timeline.add(name, at, data, self._steps):
            self._incidents = None
        if self._steps.known and not known:
            self._stale = -math.inf

    # --- answers --------------------------------------------------------------------------

    def snapshot(self, now: float | None = None) -> Snapshot:
        """The account's sums at ``now`` (see the module's docstring)."""
        known = self._steps.known
        phases = dict.fromkeys(PHASES, 0.0)
        total = 0.0
        for timeline in self._nodes.values():
            end = timeline.end(now)
            total += end - timeline.first
            parts = [self._settle(timeline).seconds, timeline.spent]
            if timeline.run is not None:  # the newest attempt, worked out afresh
                parts.append(split(timeline.run, known, end, self._stalls))
            for part in parts:
                for phase, seconds in part.items():
                    phases[phase] += seconds
            if timeline.state != TRAINING:  # the phase it is in
                phases[timeline.state] += max(0.0, end - timeline.since)
        self._stale = math.inf
        incidents = tuple(self._failures())
        return Snapshot(phases, total, incidents, len(self._stragglers), known)

    def _settle(self, timeline: NodeTimeline) -> _Settled:
        """``timeline``'s attempts that are over, in its settled seconds."""
        settled = self._settled[timeline.node]
        runs = timeline.runs
        # Those settled already that a late stall, or the job's first step, may change.
        index = settled.runs - 1
        while index >= 0 and self._trained_to(runs[index]) > self._stale:
            self._split_again(settled, runs[index])
            index -= 1
        for run in runs[settled.runs : len(runs) - 1]:
            self._split_again(settled, run)
        settled.runs = max(len(runs) - 1, 0)
        return settled

    def _split_again(self, settled: _Settled, run: Run) -> None:
        """Split ``run``, an attempt that is over, in place of its split so far."""
        for phase, seconds in (run.split or {}).items():
            settled.seconds[phase] -= seconds
        run.split = split(run, self._steps.known, self._trained_to(run), self._stalls)
        for phase, seconds in run.split.items():
            settled.seconds[phase] += seconds

    @staticmethod
    def _trained_to(run: Run) -> float:
        assert run.trained_to is not None  # an attempt followed by another
        return run.trained_to

    def _failures(self) -> list[Incident]:
        if self._incidents is None:
            self._incidents = incidents(self._ordered())
        return self._incidents

    def _ordered(self) -> list[NodeTimeline]:
        """The nodes in the order of the account: by start, then name."""
        return sorted(self._nodes.values(), key=lambda n: (n.first, n.node))

    def account(self, now: float | None = None) -> Account:
        """The whole account at ``now``, every node's timeline in it (its own copy).

        Raises:
            RuntimeError: the accountant keeps no timelines.
        """
        if not self.timelines:
            raise RuntimeError("an Accountant(timelines=False) gives snapshots only")
        nodes = [self._node(timeline, now) for timeline in self._ordered()]
        stragglers = [dict(s) for s in self._stragglers]
        return Account(nodes, list(self._failures()), stragglers, self._steps.known)

    def _node(self, timeline: NodeTimeline, now: float | None) -> Node:
        end, known, stalls = timeline.end(now), self._steps.known, self._stalls
        trainings = {run.segment: run for run in timeline.runs if run.segment is not None}
        segments: list[Segment] = []
        for index, segment in enumerate(timeline.segments):
            run = trainings.get(index)
            segments += [segment] if run is None else painted(run, known, end, stalls)
        if end > timeline.since:  # the phase it is in, until the end
            if timeline.state == TRAINING and timeline.run is not None:
                segments += painted(timeline.run, known, end, stalls)
            else:
                segments.append(Segment(timeline.since, end, timeline.state))
        attempts = [dataclasses.replace(run.attempt) for run in timeline.runs]
        return Node(
            timeline.node, timeline.host, merged(segments), attempts, list(timeline.saves),
            list(timeline.loads), timeline.first, end,
        )  # fmt: skip


def account(records: Iterable[Mapping[str, Any]], now: float | None = None) -> Account:
    """The account of the events ``records`` (any nodes, any order). ``now``: the wall time
    a live account ends at (the open phase of each node lasts until then); else each node
    ends at its last event."""
    return Accountant().add_records(records).account(now)
