"""Training metrics from workers: step, loss, throughput and metrics of your own.

    from rallypoint import metrics

    tokens = metrics.counter("train_tokens", "Tokens trained on.")
    step_time = metrics.histogram("train_step_seconds", "Time of one optimiser step.")
    for step, batch in enumerate(loader):
        with step_time.time():
            loss = train_step(batch)
        tokens.inc(batch.numel())
        metrics.step(step)
        metrics.loss(loss.item())

Under ``rallypoint run`` with a sink that exports worker metrics (``--metrics prometheus``),
the agent names a directory in ``RALLYPOINT_METRICS_DIR`` and every value is written there
in prometheus_client's multiprocess format (one memory-mapped file per process and metric
type); the node's agent serves them on its ``/metrics`` endpoint, labelled with ``rank``
(added here) and ``run_id``, ``node`` and ``role`` (added by the agent).

Everywhere else (plain ``python``, ``torchrun``, a run without such a sink) every call is a
cheap no-op and prometheus_client is never imported: a script records its metrics
unconditionally and runs unchanged under any launcher. Names and labels are checked in
both cases, so a mistake shows up outside rallypoint too.

Counters keep counting across restarts (the counts of dead workers stay in the sum, as a
Prometheus counter must never go down); gauges disappear with the process that set them,
so a restarted worker's gauges are never added to its predecessor's.

Importing this module costs nothing: it imports neither the agent nor prometheus_client.
Once the first metric is created with the directory set, prometheus_client in this process
is switched to multiprocess mode, so metrics created with prometheus_client directly from
then on reach the agent as well.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from rallypoint.worker import variables
from rallypoint.worker.progress import progress

__all__ = [
    "ENV",
    "Counter",
    "Gauge",
    "Histogram",
    "counter",
    "enabled",
    "gauge",
    "histogram",
    "loss",
    "samples",
    "samples_per_second",
    "step",
    "step_time",
]

#: The variable the agent sets in the worker environment: the node's metrics directory.
ENV = variables.METRICS_DIR

#: prometheus_client's default histogram buckets, in seconds.
DEFAULT_BUCKETS: tuple[float, ...] = (
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
)  # fmt: skip

#: How gauge values of several live processes with the same labels combine; the values of
#: dead processes never count.
GAUGE_AGGREGATIONS: Mapping[str, str] = {
    "last": "livemostrecent",
    "sum": "livesum",
    "max": "livemax",
    "min": "livemin",
}

#: Labels rallypoint adds itself; a metric may not declare them.
RESERVED_LABELS = frozenset({"rank", "run_id", "node", "role"})

_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
_LABEL = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")

logger = logging.getLogger(__name__)


def enabled() -> bool:
    """Whether metrics recorded here reach an agent (``RALLYPOINT_METRICS_DIR`` is set)."""
    return _backend() is not None


# --- the backend: prometheus_client in multiprocess mode, or nothing ----------------------


class _Backend:
    """Creates prometheus_client metrics whose values go to the agent's directory."""

    def __init__(self, directory: str) -> None:
        import prometheus_client
        from prometheus_client import values

        # prometheus_client picks its value class once, at import, from this variable; a
        # process that imported it before (another library) is switched over here.
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = directory
        if not getattr(values.ValueClass, "_multiprocess", False):
            values.ValueClass = values.get_value_class()  # type: ignore[no-untyped-call]
        self.client = prometheus_client
        self.rank = os.environ.get(variables.RANK, "0")


_state: dict[str, _Backend | None] = {}
_backend_lock = threading.Lock()


def _backend() -> _Backend | None:
    try:
        return _state["backend"]
    except KeyError:
        pass
    with _backend_lock:
        if "backend" not in _state:
            directory = os.environ.get(ENV, "")
            backend = None
            if directory:
                try:
                    backend = _Backend(directory)
                except ImportError:
                    logger.warning(
                        "%s is set but prometheus_client is not installed in this "
                        "environment: worker metrics are not recorded",
                        ENV,
                    )
            _state["backend"] = backend
    return _state["backend"]


def _check(name: str, labelnames: Sequence[str]) -> tuple[str, ...]:
    if not _NAME.match(name):
        raise ValueError(f"invalid metric name {name!r}: use letters, digits, '_' and ':'")
    for label in labelnames:
        if not _LABEL.match(label) or label.startswith("__"):
            raise ValueError(f"metric {name!r}: invalid label name {label!r}")
        if label in RESERVED_LABELS:
            raise ValueError(f"metric {name!r}: label {label!r} is added by rallypoint")
    if len(set(labelnames)) != len(labelnames):
        raise ValueError(f"metric {name!r}: a label name is repeated")
    return tuple(labelnames)


# --- the metric types ---------------------------------------------------------------------


class _Metric:
    """A metric of this worker: a prometheus_client metric labelled with the rank, or
    nothing when no agent reads worker metrics."""

    kind = ""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str]) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = _check(name, labelnames)
        self._labelset = frozenset(self.labelnames)
        self._metric: Any = None
        self._child: Any = None  # the child for this rank, when there are no other labels
        backend = _backend()
        if backend is not None:
            self._rank = backend.rank
            self._metric = self._create(backend.client, ("rank", *self.labelnames))
            if not self.labelnames:
                self._child = self._metric.labels(self._rank)

    def _create(self, client: Any, labelnames: tuple[str, ...]) -> Any:
        raise NotImplementedError

    def _labelled(self, labels: Mapping[str, str]) -> Any:
        if labels.keys() != self._labelset:
            expected = ", ".join(self.labelnames) or "none"
            raise ValueError(
                f"metric {self.name!r}: labels {', '.join(sorted(labels)) or 'none'} given, "
                f"expected {expected}"
            )
        if self._metric is None:
            return None
        return self._metric.labels(rank=self._rank, **{k: str(v) for k, v in labels.items()})

    def _same(self, kind: str, labelnames: Sequence[str]) -> bool:
        return kind == self.kind and tuple(labelnames) == self.labelnames


class Counter(_Metric):
    """A count that only goes up: samples, tokens, skipped batches. Exported with the
    suffix ``_total``; the counts of workers that died stay in the total."""

    kind = "counter"

    def _create(self, client: Any, labelnames: tuple[str, ...]) -> Any:
        return client.Counter(self.name, self.documentation, labelnames, registry=None)

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        """Add ``amount`` (not negative); give a value for each declared label."""
        if amount < 0:
            raise ValueError(f"counter {self.name!r}: cannot add a negative amount")
        child = self._labelled(labels) if labels or self.labelnames else self._child
        if child is not None:
            child.inc(amount)


class Gauge(_Metric):
    """A value that goes up and down: loss, learning rate, queue length. It disappears
    when the worker that set it ends, so restarted workers never add up with dead ones."""

    kind = "gauge"

    def __init__(
        self, name: str, documentation: str, labelnames: Sequence[str], aggregate: str = "last"
    ) -> None:
        if aggregate not in GAUGE_AGGREGATIONS:
            raise ValueError(
                f"gauge {name!r}: aggregate {aggregate!r}, expected one of "
                f"{', '.join(GAUGE_AGGREGATIONS)}"
            )
        self.aggregate = aggregate
        super().__init__(name, documentation, labelnames)

    def _create(self, client: Any, labelnames: tuple[str, ...]) -> Any:
        return client.Gauge(
            self.name,
            self.documentation,
            labelnames,
            registry=None,
            multiprocess_mode=GAUGE_AGGREGATIONS[self.aggregate],
        )

    def set(self, value: float, **labels: str) -> None:
        """Set the gauge to ``value``."""
        child = self._labelled(labels) if labels or self.labelnames else self._child
        if child is not None:
            child.set(value)

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        """Add ``amount`` (may be negative)."""
        child = self._labelled(labels) if labels or self.labelnames else self._child
        if child is not None:
            child.inc(amount)

    def dec(self, amount: float = 1.0, **labels: str) -> None:
        """Subtract ``amount``."""
        self.inc(-amount, **labels)


class Histogram(_Metric):
    """A distribution of observations, e.g. step or data-loading time in seconds."""

    kind = "histogram"

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        buckets: Sequence[float] = DEFAULT_BUCKETS,
    ) -> None:
        self.buckets = tuple(float(b) for b in buckets)
        if not self.buckets or list(self.buckets) != sorted(set(self.buckets)):
            raise ValueError(f"histogram {name!r}: buckets must be increasing")
        super().__init__(name, documentation, labelnames)

    def _create(self, client: Any, labelnames: tuple[str, ...]) -> Any:
        return client.Histogram(
            self.name, self.documentation, labelnames, registry=None, buckets=self.buckets
        )

    def observe(self, value: float, **labels: str) -> None:
        """Record one observation."""
        child = self._labelled(labels) if labels or self.labelnames else self._child
        if child is not None:
            child.observe(value)

    @contextmanager
    def time(self, **labels: str) -> Iterator[None]:
        """Observe the seconds the ``with`` block takes."""
        began = time.perf_counter()
        try:
            yield
        finally:
            self.observe(time.perf_counter() - began, **labels)


_metrics: dict[str, _Metric] = {}
_lock = threading.Lock()


def _get(kind: type[_Metric], name: str, labelnames: Sequence[str], make: Any) -> Any:
    existing = _metrics.get(name)  # the common case, every step: no lock
    if existing is None:
        with _lock:
            existing = _metrics.get(name)
            if existing is None:
                existing = _metrics[name] = make()
    if not existing._same(kind.kind, labelnames):
        raise ValueError(
            f"metric {name!r} already exists as a {existing.kind} with labels "
            f"({', '.join(existing.labelnames)})"
        )
    return existing


def counter(name: str, documentation: str = "", labelnames: Sequence[str] = ()) -> Counter:
    """The counter ``name`` of this worker, created on first use (``_total`` is added)."""
    result: Counter = _get(
        Counter, name, labelnames, lambda: Counter(name, documentation or name, labelnames)
    )
    return result


def gauge(
    name: str, documentation: str = "", labelnames: Sequence[str] = (), aggregate: str = "last"
) -> Gauge:
    """The gauge ``name`` of this worker, created on first use.

    ``aggregate`` says how values set by several processes of one rank with the same labels
    (a worker and its data-loader processes) combine: ``last`` (the most recent value),
    ``sum``, ``max`` or ``min``; only live processes count.
    """
    result: Gauge = _get(
        Gauge,
        name,
        labelnames,
        lambda: Gauge(name, documentation or name, labelnames, aggregate),
    )
    return result


def histogram(
    name: str,
    documentation: str = "",
    labelnames: Sequence[str] = (),
    buckets: Sequence[float] = DEFAULT_BUCKETS,
) -> Histogram:
    """The histogram ``name`` of this worker, created on first use."""
    result: Histogram = _get(
        Histogram,
        name,
        labelnames,
        lambda: Histogram(name, documentation or name, labelnames, buckets),
    )
    return result


# --- training metrics with fixed names, for dashboards and alerts -------------------------


def step(value: int) -> None:
    """The training step this worker has reached (``rallypoint_training_step``); the
    agent learns it too (``rallypoint.progress(step=...)``)."""
    progress(step=value)
    gauge("rallypoint_training_step", "Training step the worker has reached.").set(value)


def loss(value: float) -> None:
    """The latest training loss (``rallypoint_training_loss``)."""
    gauge("rallypoint_training_loss", "Latest training loss of the worker.").set(value)


def samples(count: int) -> None:
    """Count ``count`` more samples trained on (``rallypoint_training_samples_total``);
    Prometheus derives throughput from it with ``rate()``."""
    counter("rallypoint_training_samples", "Samples the worker has trained on.").inc(count)


def samples_per_second(value: float) -> None:
    """The worker's own measure of its throughput
    (``rallypoint_training_samples_per_second``)."""
    gauge("rallypoint_training_samples_per_second", "Samples per second the worker reports.").set(
        value
    )


#: Buckets of ``rallypoint_training_step_seconds``: 1 ms to 5 minutes.
STEP_BUCKETS: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    60.0, 300.0,
)  # fmt: skip


def step_time(seconds: float) -> None:
    """How long one training step took (``rallypoint_training_step_seconds``)."""
    histogram(
        "rallypoint_training_step_seconds", "Duration of one training step.", (), STEP_BUCKETS
    ).observe(seconds)
