"""The ``prometheus`` sink against rallypoint's metrics sink conformance suite: created as
the agent creates it (with a worker metrics directory, since it exports worker metrics),
its endpoint on a free loopback port."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest

from rallypoint.sdk import MetricsSink
from rallypoint.testing.helpers import build_plugin_manager, registered
from rallypoint.testing.metrics_sink_conformance import MetricsSinkConformance


class TestPrometheusSink(MetricsSinkConformance):
    @pytest.fixture
    def sink(self) -> MetricsSink:
        registration = registered(MetricsSink, "prometheus", build_plugin_manager({}))
        assert registration.worker_metrics
        return registration

    @pytest.fixture
    def options(self) -> Mapping[str, Any]:
        return {"addr": "127.0.0.1", "port": 0}

    @pytest.fixture
    def idempotent_close(self) -> bool:
        return True  # without a Pushgateway: its last push is made once
