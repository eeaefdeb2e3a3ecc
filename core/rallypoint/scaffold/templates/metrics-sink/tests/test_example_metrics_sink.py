"""The tests of rallypoint-example-metrics-sink: rallypoint's conformance suite for a
metrics sink, and the registration rallypoint finds."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
from rallypoint.sdk import MetricsSink
from rallypoint.testing.helpers import PluginManager, registered
from rallypoint.testing.metrics_sink_conformance import MetricsSinkConformance

from rallypoint_example_metrics_sink.sink import SINK


class TestConformance(MetricsSinkConformance):
    @pytest.fixture
    def sink(self) -> MetricsSink:
        return SINK

    @pytest.fixture
    def options(self, tmp_path: Path) -> Mapping[str, Any]:
        return {"example_metrics_sink_path": str(tmp_path / "events.txt")}

    @pytest.fixture
    def check_sink(self) -> Callable[[Mapping[str, Any]], None]:
        def check(options: Mapping[str, Any]) -> None:
            lines = Path(options["example_metrics_sink_path"]).read_text().splitlines()
            assert "agent_stopping" in {line.split()[1] for line in lines}

        return check

    @pytest.fixture
    def idempotent_close(self) -> bool:
        return True


def test_rallypoint_runs_this_sink(rallypoint_pm: PluginManager) -> None:
    assert registered(MetricsSink, "example-metrics-sink", rallypoint_pm) is SINK
