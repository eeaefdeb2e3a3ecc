"""rallypoint-example-metrics-sink: the ``example-metrics-sink`` metrics sink.

Chosen with ``rallypoint run --metrics example-metrics-sink``.
"""

from __future__ import annotations

from rallypoint.sdk import MetricsSink, hookimpl

from rallypoint_example_metrics_sink.sink import SINK


@hookimpl
def register_metrics_sinks() -> list[MetricsSink]:
    return [SINK]
