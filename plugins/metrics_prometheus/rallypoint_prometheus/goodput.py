"""Goodput metrics: this node's goodput account, the one ``rallypoint report`` prints, kept
event by event by a ``rallypoint.sdk.GoodputAccountant``; a scrape reads its sums.

A new event can tell what time already counted was (the first step after a restart ends
the restart, a load says how long it took), and give time the account called training to
another phase: each counter goes up to the account's value when that grows and stays put
otherwise, so that no counter ever goes down.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Iterator, Mapping
from typing import TypeGuard

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics_core import Metric

from rallypoint import sdk
from rallypoint.sdk import Event

logger = logging.getLogger(__name__)

#: Noticing a failure: milliseconds for a worker's exit, up to the liveness TTL for a lost
#: node and a hang's deadline (a minute by default, up to the ceiling's ten).
DETECT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 15, 30, 60, 120, 300, 600)
#: From a failure to the next step: under a second with warm workers and a memory
#: checkpoint, up to an hour when nodes must be replaced.
RECOVERY_BUCKETS = (0.5, 1, 2.5, 5, 10, 15, 30, 60, 120, 300, 600, 1200, 1800, 3600)


class GoodputMetrics:
    """A collector of this node's goodput, time per phase, failures, recoveries and
    stragglers. Its metrics live in a registry of its own, brought up to date from the
    account at each collection."""

    def __init__(self, labels: Mapping[str, str], labelnames: tuple[str, ...]) -> None:
        self.labels = dict(labels)
        self._lock = threading.Lock()
        self._accountant = sdk.GoodputAccountant(timelines=False)  # it serves sums alone
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
        for phase in self._accountant.snapshot().phases:  # every phase is named
            self.phase_seconds.labels(**labels, phase=phase)
        for metric in (self.detect, self.recovery, self.steps_redone, self.stragglers):
            metric.labels(**labels)

    def emit(self, event: Event) -> None:
        with self._lock:
            self._accountant.add(event)
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
        snapshot = self._accountant.snapshot(now)
        labels = self.labels
        if snapshot.goodput is not None:
            self.ratio.labels(**labels).set(snapshot.goodput)
        for phase, seconds in snapshot.phases.items():
            self._raise(self.phase_seconds.labels(**labels, phase=phase), ("phase", phase), seconds)
        for cause, count in snapshot.causes().items():
            self._raise(self.failures.labels(**labels, cause=cause), ("cause", cause), count)
        self._raise(self.steps_redone.labels(**labels), ("steps", ""), snapshot.steps_redone)
        self._raise(self.stragglers.labels(**labels), ("stragglers", ""), snapshot.stragglers)
        for incident in snapshot.incidents:
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


def _number(value: object) -> TypeGuard[float]:
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(float(value))
    )
