"""``rallypoint.metrics`` in a worker: no-ops outside rallypoint, checked everywhere."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from prometheus_fixtures import end_worker, start_worker

from rallypoint import metrics


def run_python(source: str, env: dict[str, str]) -> str:
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(source)],
        env={"PATH": "/usr/bin", **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_outside_rallypoint_every_call_is_a_no_op_without_prometheus_client() -> None:
    out = run_python(
        """
        import sys
        from rallypoint import metrics
        metrics.step(3); metrics.loss(0.1); metrics.samples(8); metrics.samples_per_second(2.0)
        metrics.step_time(0.01)
        metrics.counter("app_batches", labelnames=["split"]).inc(split="train")
        metrics.gauge("app_queue").set(4)
        with metrics.histogram("app_seconds").time():
            pass
        print(metrics.enabled(), "prometheus_client" in sys.modules)
        """,
        {"RANK": "0"},
    )
    assert out.split() == ["False", "False"]


def test_with_the_directory_values_go_to_files_of_the_worker_process(tmp_path: Path) -> None:
    process = start_worker(tmp_path, rank=2)
    try:
        names = sorted(p.name for p in tmp_path.iterdir())
        pid = process.pid
        assert names == [
            f"counter_{pid}.db",
            f"gauge_livemostrecent_{pid}.db",
            f"gauge_livesum_{pid}.db",
            f"histogram_{pid}.db",
        ]
    finally:
        end_worker(process)


def test_names_and_labels_are_checked_outside_rallypoint_too() -> None:
    with pytest.raises(ValueError, match="invalid metric name"):
        metrics.counter("2fast")
    with pytest.raises(ValueError, match="label 'rank' is added by rallypoint"):
        metrics.gauge("app_x", labelnames=["rank"])
    with pytest.raises(ValueError, match="aggregate 'avg'"):
        metrics.gauge("app_avg", aggregate="avg")
    with pytest.raises(ValueError, match="buckets must be increasing"):
        metrics.histogram("app_h", buckets=[1.0, 0.5])
    labelled = metrics.counter("app_labelled", labelnames=["split"])
    with pytest.raises(ValueError, match="labels none given, expected split"):
        labelled.inc()
    with pytest.raises(ValueError, match="labels phase given, expected split"):
        labelled.inc(phase="x")
    with pytest.raises(ValueError, match="negative"):
        labelled.inc(-1, split="train")
    with pytest.raises(ValueError, match="already exists as a counter"):
        metrics.gauge("app_labelled")
    assert metrics.counter("app_labelled", labelnames=["split"]) is labelled
