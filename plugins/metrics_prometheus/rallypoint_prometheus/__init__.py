"""rallypoint-prometheus: the ``prometheus`` metrics sink.

The sink serves ``/metrics`` over HTTP from the agent. ``prometheus_client`` is imported
only when a run chooses the sink, so an installed plugin costs the CLI nothing.
"""

from __future__ import annotations

from rallypoint import hookimpl
from rallypoint.extensions import ConfigOption, EventSink, MetricsSink, SinkContext

__version__ = "0.1.0"

OPTIONS: tuple[ConfigOption, ...] = (
    ConfigOption("port", int, 0, "port of the /metrics endpoint; 0 picks a free one and logs it"),
    ConfigOption("addr", str, "0.0.0.0", "address the /metrics endpoint binds to"),
)


def _create(context: SinkContext) -> EventSink:
    from rallypoint_prometheus.sink import PrometheusSink

    return PrometheusSink(context)


@hookimpl
def register_metrics_sinks() -> list[MetricsSink]:
    return [
        MetricsSink(
            "prometheus",
            "rendezvous, restart, failure and world-size metrics on an HTTP /metrics endpoint",
            _create,
            options=OPTIONS,
        )
    ]
