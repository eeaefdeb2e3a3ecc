"""rallypoint-prometheus: the ``prometheus`` metrics sink.

The agent serves its own metrics and its workers' (``rallypoint.metrics``) on an HTTP
``/metrics`` endpoint, and optionally pushes them to a Pushgateway. ``prometheus_client``
is imported only when a run chooses the sink, so an installed plugin costs the CLI nothing.
"""

from __future__ import annotations

from rallypoint.sdk import ConfigOption, EventSink, MetricsSink, SinkContext, hookimpl

__version__ = "0.1.0"

OPTIONS: tuple[ConfigOption, ...] = (
    ConfigOption(
        "port",
        int,
        0,
        "port of the /metrics endpoint; 0 picks a free one and logs it",
        minimum=0,
        maximum=65535,
    ),
    ConfigOption("addr", str, "0.0.0.0", "address the /metrics endpoint binds to"),
    ConfigOption(
        "pushgateway", str, "", "also push to this Pushgateway (host:port or URL); off if empty"
    ),
    ConfigOption(
        "push_interval",
        float,
        15.0,
        "seconds between pushes (and one at the end)",
        minimum=0,
        exclusive_minimum=True,
    ),
    ConfigOption("push_job", str, "rallypoint", "the job label of pushed metrics"),
)


def _create(context: SinkContext) -> EventSink:
    from rallypoint_prometheus.sink import PrometheusSink

    return PrometheusSink(context)


@hookimpl
def register_metrics_sinks() -> list[MetricsSink]:
    return [
        MetricsSink(
            "prometheus",
            "agent and worker metrics on an HTTP /metrics endpoint, optionally pushed to a "
            "Pushgateway",
            _create,
            options=OPTIONS,
            worker_metrics=True,
        )
    ]
