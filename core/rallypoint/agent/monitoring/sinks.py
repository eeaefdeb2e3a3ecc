"""The event sinks of a run: torch's console handler when asked for, then each chosen
metrics sink (``--metrics``), given the run's metrics directory when it reads worker
metrics. A sink that cannot be created is left out: the job goes on without it."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from rallypoint.agent.monitoring.eventbus import NamedSink, TorchConsoleEvents
from rallypoint.config import LaunchConfig
from rallypoint.events import RunInfo
from rallypoint.extensions import SinkContext
from rallypoint.registry import METRICS_SINKS, describe, plugin_failure

logger = logging.getLogger("rallypoint.agent")


def create_sinks(
    config: LaunchConfig, run: RunInfo, run_dir: Path
) -> tuple[list[NamedSink], Path | None]:
    """The run's sinks, and the metrics directory the workers record into (None: no sink
    reads worker metrics, and workers record none)."""
    sinks: list[NamedSink] = []
    metrics_dir: Path | None = None
    if config.event_log_handler == "console":
        sinks.append(NamedSink(TorchConsoleEvents(), "the --event-log-handler console"))
    for chosen in config.sinks:
        sink, options = chosen.item, chosen.options
        directory = None
        if sink.worker_metrics:
            # One directory for every sink that reads worker metrics.
            if metrics_dir is None:
                metrics_dir = run_dir / "metrics"
                shutil.rmtree(metrics_dir, ignore_errors=True)
                metrics_dir.mkdir(parents=True)
            directory = str(metrics_dir)
        who = describe(METRICS_SINKS, sink)
        try:
            created = sink.create(SinkContext(run, options, directory))
        except Exception as error:  # a plugin's: the job goes on without the sink
            outcome = "the job goes on without it"
            logger.warning("%s", plugin_failure(who, "create", error, outcome))
            continue
        sinks.append(NamedSink(created, who))
    return sinks, metrics_dir
