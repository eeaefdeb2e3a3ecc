"""Goodput metrics: this node's goodput account (``rallypoint.sdk.goodput_account``, the one
``rallypoint report`` prints), computed on every scrape from the events the sink received.

The account is recomputed over the whole run, and a new step can give time it called
training to another phase (a restart, a load, steps redone): each counter goes up to the
account's value when it grows and stays put otherwise, so that no counter ever goes down.

The sink keeps only the events the account reads, and of the many progress and
checkpoint events of a long attempt only those that decide a phase: see ``Records``.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any, TypeGuard

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics_core import Metric

from rallypoint import sdk
from rallypoint.sdk import Event

logger = logging.getLogger(__name__)

#: Noticing a failure: milliseconds for a worker's exit, up to the liveness TTL for a lost
#: node and the watchdog's timeout for a hang.
DETECT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 15, 30, 60, 120, 300, 600)
#: From a failure to the next step: under a second with warm workers and a memory
#: checkpoint, up to an hour when nodes must be replaced.
RECOVERY_BUCKETS = (0.5, 1, 2.5, 5, 10, 15, 30, 60, 120, 300, 600, 1200, 1800, 3600)

#: The events ``goodput_account`` reads; the sink keeps no others.
_ACCOUNTED = frozenset(
    {
        sdk.AGENT_STARTED,
        sdk.RENDEZVOUS_STARTED,
        sdk.RENDEZVOUS_COMPLETED,
        sdk.WORKERS_STARTED,
        sdk.PROGRESS,
        sdk.CHECKPOINT_SAVED,
        sdk.CHECKPOINT_LOADED,
        sdk.WORKER_FAILED,
        sdk.WORKERS_RESTARTED,
        sdk.AGENT_STOPPING,
        sdk.STRAGGLER,
    }
)
_MARKS = (sdk.PROGRESS, sdk.CHECKPOINT_SAVED)


class Records:
    """This node's events for the account, as event-log records, few however long it runs.

    A progress or checkpoint event marks a step. The account needs each mark up to the
    step the job had reached before the attempt (where redone training ends) and the first
    past it; then only the newest, and the time the saves held training up. So past that
    step, one record per kind stands for the rest of the attempt (see ``_Group``).
    """

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []
        self._reached: float | None = None  # the highest step marked so far
        self._before: float | None = None  # ... before the current attempt
        self._groups: dict[str, _Group] = {}  # by kind of mark

    def add(self, record: dict[str, Any]) -> None:
        name, step = record["event"], record.get("step")
        if name in _MARKS and _number(step):
            self._mark(name, step, record)
            return
        self._groups.clear()  # a group never spans another event
        if name == sdk.WORKERS_STARTED:
            self._before = self._reached
        self.records.append(record)

    def _mark(self, name: str, step: float, record: dict[str, Any]) -> None:
        self._reached = step if self._reached is None else max(self._reached, step)
        if self._before is not None and step <= self._before:
            self.records.append(record)  # redone training: each mark counts
        elif name not in self._groups:
            self._groups[name] = _Group(record)  # the first mark past it stays as it is
            self.records.append(record)
        elif self._groups[name].absorb(record):
            self.records.append(record)


class _Group:
    """The marks of one kind after a first one, as a single record: the newest mark, with
    the union of their stalls (``blocked_seconds`` from ``wall_time - seconds``) placed to
    end where the latest of them ends. Those stalls lie in training, where only their sum
    counts; a stall that began before the first mark may lie in redone training, and stays
    in a record of its own."""

    def __init__(self, first: Mapping[str, Any]) -> None:
        stall = sdk.goodput_stall(first)
        self.since = float(first["wall_time"])
        self.end = stall[1] if stall is not None else -math.inf  # of the stalls so far
        self.length = 0.0  # of the union of the stalls folded in
        self.record: dict[str, Any] | None = None

    def absorb(self, record: dict[str, Any]) -> bool:
        """Fold ``record`` in; return whether it is to be kept (the group's record, or a
        record of its own)."""
        stall = sdk.goodput_stall(record)
        if stall is not None:
            if stall[0] < self.since:
                self.end = max(self.end, stall[1])
                return True
            self.length += max(0.0, stall[1] - max(stall[0], self.end))  # overlaps once
            self.end = max(self.end, stall[1])
        new = self.record is None
        if self.record is None:
            self.record = record
        else:
            self.record.clear()
            self.record.update(record)
        if self.length > 0:
            self.record["seconds"] = float(record["wall_time"]) - (self.end - self.length)
            self.record["blocked_seconds"] = self.length
        else:
            self.record.pop("blocked_seconds", None)
        return new


def _number(value: object) -> TypeGuard[float]:
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(float(value))
    )


class GoodputMetrics:
    """A collector of this node's goodput, time per phase, failures, recoveries and
    stragglers. Its metrics live in a registry of its own, brought up to date from the
    account at each collection."""

    def __init__(self, labels: Mapping[str, str], labelnames: tuple[str, ...]) -> None:
        self.labels = dict(labels)
        self._lock = threading.Lock()
        self._records = Records()
        self._served: dict[tuple[str, str], float] = {}  # counter totals served so far
        self._observed: set[tuple[str, int]] = set()  # (histogram, round) observed once
        self._failed = False
        registry = self.registry = CollectorRegistry()

        def counter(name: str, help_text: str, *extra: str) -> Counter:
            return Counter(name, help_text, (*labelnames, *extra), registry=registry)

        def histogram(name: str, help_text: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, help_text, labelnames, buckets=buckets, registry=registry)

        self.ratio = Gauge(
            "rallypoint_goodput_ratio",
            "Share of this node's time in productive training since the agent started.",
            labelnames,
            registry=registry,
        )
        self.phase_seconds = counter(
            "rallypoint_phase_seconds", "Seconds of this node's time, by phase.", "phase"
        )
        self.detect = histogram(
            "rallypoint_failure_detect_seconds",
            "Time from a failure to the agent noticing it.",
            DETECT_BUCKETS,
        )
        self.recovery = histogram(
            "rallypoint_recovery_seconds",
            "Time from a failure to the workers' first step after it.",
            RECOVERY_BUCKETS,
        )
        self.steps_redone = counter(
            "rallypoint_steps_redone", "Steps trained again after restarts (lost to failures)."
        )
        self.failures = counter(
            "rallypoint_failures", "Rounds this node left for a failure, by root cause.", "cause"
        )
        self.stragglers = counter(
            "rallypoint_stragglers", "Rounds in which this node was found a straggler."
        )
        self.straggler_ratio = Gauge(
            "rallypoint_straggler_ratio",
            "This node's pace over the other nodes' median, while it is a straggler.",
            labelnames,
            registry=registry,
        )
        # Series that exist from the start, so that rate() and increase() see their first
        # change (a recovery observed before the first scrape would be missed otherwise).
        for phase in sdk.goodput_account(()).phases:  # an empty account names every phase
            self.phase_seconds.labels(**labels, phase=phase)
        for metric in (self.detect, self.recovery, self.steps_redone, self.stragglers):
            metric.labels(**labels)

    def emit(self, event: Event) -> None:
        if event.name not in _ACCOUNTED:
            return
        with self._lock:
            self._records.add(json.loads(event.to_json()))  # as the event log holds it
        # The agent names a straggler once per round: the gauge is the current round's.
        ratio = event.data.get("ratio")
        if event.name == sdk.STRAGGLER and _number(ratio):
            self.straggler_ratio.labels(**self.labels).set(ratio)
        elif event.name == sdk.WORKERS_STARTED:
            self.straggler_ratio.clear()

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            try:
                self._update(time.time())
            except Exception:  # the other metrics are served all the same
                if not self._failed:
                    logger.exception("the goodput account failed; its metrics stand still")
                self._failed = True
        yield from self.registry.collect()

    def _update(self, now: float) -> None:
        account = sdk.goodput_account(self._records.records, now=now)
        labels = self.labels
        if account.goodput is not None:
            self.ratio.labels(**labels).set(account.goodput)
        for phase, seconds in account.phases.items():
            self._raise(self.phase_seconds.labels(**labels, phase=phase), ("phase", phase), seconds)
        for cause, count in account.causes().items():
            self._raise(self.failures.labels(**labels, cause=cause), ("cause", cause), count)
        self._raise(self.steps_redone.labels(**labels), ("steps", ""), account.steps_redone)
        self._raise(self.stragglers.labels(**labels), ("stragglers", ""), len(account.stragglers))
        for incident in account.incidents:
            for name, metric, value in (
                ("detect", self.detect, incident.detect_seconds),
                ("recovery", self.recovery, incident.recover_seconds),
            ):
                if value is not None and (name, incident.round) not in self._observed:
                    self._observed.add((name, incident.round))
                    metric.labels(**labels).observe(value)

    def _raise(self, counter: Counter, key: tuple[str, str], total: float) -> None:
        """Bring ``counter`` up to ``total`` when that is more than it served so far."""
        served = self._served.get(key, 0.0)
        if total > served:
            counter.inc(total - served)
            self._served[key] = total
