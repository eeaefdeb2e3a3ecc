"""Built-in metrics sinks: ``log`` (Python logging) and ``jsonl`` (one JSON object per line)."""

from __future__ import annotations

import logging
import os
import threading
from typing import TextIO

from rallypoint import hookimpl
from rallypoint.events import Event
from rallypoint.extensions import ConfigOption, MetricsSink, SinkContext

logger = logging.getLogger("rallypoint.metrics")


class LogSink:
    """Writes each event as one ``logging`` record on the ``rallypoint.metrics`` logger."""

    def __init__(self, level: int) -> None:
        self.level = level

    def emit(self, event: Event) -> None:
        details = " ".join(f"{key}={value}" for key, value in sorted(event.data.items()))
        logger.log(self.level, "%s %s", event.name, details)

    def close(self) -> None:
        pass


class JsonLinesSink:
    """Appends each event to a file as one JSON object per line, flushed at once.

    Appending keeps the records of earlier runs, so one file can hold a whole job's history.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._file: TextIO | None = None

    def emit(self, event: Event) -> None:
        with self._lock:
            if self._file is None:
                directory = os.path.dirname(self.path)
                if directory:
                    os.makedirs(directory, exist_ok=True)
                self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
            self._file.write(event.to_json() + "\n")
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def _log_sink(context: SinkContext) -> LogSink:
    level = logging.getLevelName(str(context.options["log_level"]))
    return LogSink(level if isinstance(level, int) else logging.INFO)


def _jsonl_sink(context: SinkContext) -> JsonLinesSink:
    return JsonLinesSink(str(context.options["path"]))


@hookimpl
def register_metrics_sinks() -> list[MetricsSink]:
    return [
        MetricsSink(
            "log",
            "events as log lines on the rallypoint.metrics logger",
            _log_sink,
            options=(
                ConfigOption(
                    "log_level",
                    str,
                    "INFO",
                    "logging level of the records",
                    choices=("DEBUG", "INFO", "WARNING", "ERROR"),
                ),
            ),
        ),
        MetricsSink(
            "jsonl",
            "events appended to a JSON-lines file",
            _jsonl_sink,
            options=(
                ConfigOption("path", str, "rallypoint-metrics.jsonl", "the file to append to"),
            ),
        ),
    ]
