"""The ``example-metrics-sink`` metrics sink: one line per event, appended to a file."""

from __future__ import annotations

import json
import threading
from typing import TextIO

from rallypoint.sdk import ConfigOption, Event, MetricsSink, SinkContext

OPTIONS = (
    # Keys of all chosen sinks share --metrics-conf: prefix yours with the sink's name.
    ConfigOption(
        "example_metrics_sink_path",
        str,
        "example-metrics-sink-events.txt",
        "the file to append events to",
    ),
)


class Sink:
    """Receives every event of the run; must neither block the agent for long nor raise."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._file: TextIO | None = None

    def emit(self, event: Event) -> None:
        line = f"{event.wall_time:.3f} {event.name} {json.dumps(dict(event.data), default=str)}"
        with self._lock:
            if self._file is None:
                self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115
            self._file.write(line + "\n")
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def create(context: SinkContext) -> Sink:
    return Sink(str(context.options["example_metrics_sink_path"]))


SINK = MetricsSink(
    name="example-metrics-sink",
    description="every event as a line in a file",
    create=create,
    options=OPTIONS,
)
