"""One account of a run, delivered three ways: event log, metrics sinks, lifecycle hooks.

The agent calls ``EventBus.emit`` at every phase. The event is appended to the
``--event-log`` file (JSON lines, wall and monotonic time), handed to every chosen metrics
sink, and announced through the matching ``on_*`` hook. A sink or hook that raises is
reported once and never stops the run.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from rallypoint import events
from rallypoint.events import Event, RoundInfo, RunInfo, WorkerFailure
from rallypoint.extensions import EventSink
from rallypoint.plugins import PluginManager

logger = logging.getLogger(__name__)


def _fields(cls: type[Any], data: Mapping[str, Any]) -> Any:
    """Rebuild a dataclass from the flat event data it was spread into."""
    values = {f.name: data[f.name] for f in dataclasses.fields(cls) if f.name in data}
    if "members" in values:
        values["members"] = tuple(values["members"])
    return cls(**values)


#: The lifecycle hook each event is announced through, with the hook's arguments.
_HOOKS: dict[str, tuple[str, Callable[[Mapping[str, Any]], dict[str, Any]]]] = {
    events.AGENT_STARTED: ("on_agent_started", lambda d: {}),
    events.RENDEZVOUS_COMPLETED: (
        "on_rendezvous_completed",
        lambda d: {"round_info": _fields(RoundInfo, d)},
    ),
    events.WORKERS_STARTED: (
        "on_workers_started",
        lambda d: {"round_info": _fields(RoundInfo, d), "pids": tuple(d["pids"])},
    ),
    events.WORKER_FAILED: ("on_worker_failed", lambda d: {"failure": _fields(WorkerFailure, d)}),
    events.WORKERS_RESTARTED: (
        "on_workers_restarted",
        lambda d: {"restart_count": d["restart_count"], "cause": d["cause"]},
    ),
    events.SCALE_CHANGED: (
        "on_scale_changed",
        lambda d: {"old_nodes": d["old_nodes"], "new_nodes": d["new_nodes"]},
    ),
    events.AGENT_STOPPING: (
        "on_agent_stopping",
        lambda d: {"exit_code": d["exit_code"], "reason": d["reason"]},
    ),
}


#: Events about one worker: torch's ``EventSource.WORKER``; the rest are the agent's.
_ABOUT_A_WORKER = frozenset(
    {events.WORKER_FAILED, events.CHECKPOINT_SAVED, events.CHECKPOINT_LOADED}
)


class TorchConsoleEvents:
    """``--event-log-handler console``: every event on stderr as torchelastic's event
    records (``torch.distributed.elastic.events.Event`` serialised: ``name``, ``source``,
    ``timestamp`` in milliseconds, ``metadata``; ``source`` ``WORKER`` for events about a
    worker, else ``AGENT``), as torchrun's ``console`` handler logs its own. torch's other handlers, ``null`` and ``dynamic_rendezvous``, write nothing."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream

    def emit(self, event: Event) -> None:
        run = event.run
        metadata = {
            "run_id": run.run_id,
            "node_id": run.node_id,
            "hostname": run.hostname,
            "role": run.role,
            **event.data,
        }
        record = {
            "name": f"rallypoint.{event.name}",
            "source": "WORKER" if event.name in _ABOUT_A_WORKER else "AGENT",
            "timestamp": int(event.wall_time * 1000),
            "metadata": metadata,
        }
        stream = self.stream or sys.stderr
        stream.write(json.dumps(record, default=str) + "\n")
        stream.flush()

    def close(self) -> None:
        pass


class EventBus:
    """Delivers the events of one agent."""

    def __init__(
        self,
        run: RunInfo,
        pm: PluginManager,
        sinks: Sequence[EventSink] = (),
        event_log: str | None = None,
    ) -> None:
        self.run = run
        self.pm = pm
        self.sinks = list(sinks)
        self._lock = threading.Lock()
        self._log: TextIO | None = None
        if event_log:
            Path(event_log).parent.mkdir(parents=True, exist_ok=True)
            self._log = open(event_log, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def emit(self, name: str, **data: Any) -> Event:
        """Record one event; ``data`` is flat and JSON-ready (spread dataclasses with asdict)."""
        event = Event(name, self.run, data)
        with self._lock:
            if self._log is not None:
                self._log.write(event.to_json() + "\n")
                self._log.flush()
            for sink in self.sinks:
                try:
                    sink.emit(event)
                except Exception:
                    logger.exception("metrics sink %r failed on %s", type(sink).__name__, name)
        hook = _HOOKS.get(name)
        if hook is not None:
            hook_name, arguments = hook
            # Plugin by plugin: one failing hook must not keep the others from the event.
            for _ in self.pm.call_each(
                hook_name, break_on_error=False, run=self.run, **arguments(event.data)
            ):
                pass
        return event

    def close(self) -> None:
        for sink in self.sinks:
            try:
                sink.close()
            except Exception:
                logger.exception("metrics sink %r failed to close", type(sink).__name__)
        if self._log is not None:
            self._log.close()
            self._log = None
