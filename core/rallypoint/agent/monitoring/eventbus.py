"""One account of a run, delivered three ways: event log, metrics sinks, lifecycle hooks.

The agent calls ``EventBus.emit`` at every phase. The event is appended to the
``--event-log`` file (JSON lines, wall and monotonic time), handed to every chosen metrics
sink, and announced through the matching ``on_*`` hook. A sink or hook that raises is
reported in one line and never stops the run: a sink is disabled after its first failure.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TextIO

from rallypoint import events
from rallypoint.builtins.metrics_sinks import JsonLinesSink
from rallypoint.events import Event, RoundInfo, RunInfo, WorkerFailure
from rallypoint.extensions import EventSink
from rallypoint.plugins import PluginManager
from rallypoint.registry import plugin_failure

logger = logging.getLogger(__name__)


#: The lifecycle hook each event is announced through, with the hook's arguments.
_HOOKS: dict[str, tuple[str, Callable[[Event], dict[str, Any]]]] = {
    events.AGENT_STARTED: ("on_agent_started", lambda e: {}),
    events.RENDEZVOUS_COMPLETED: ("on_rendezvous_completed", lambda e: {"round_info": e.subject}),
    events.WORKERS_STARTED: (
        "on_workers_started",
        lambda e: {"round_info": e.subject, "pids": tuple(e.data["pids"])},
    ),
    events.WORKER_FAILED: ("on_worker_failed", lambda e: {"failure": e.subject}),
    events.WORKERS_RESTARTED: (
        "on_workers_restarted",
        lambda e: {"restart_count": e.data["restart_count"], "cause": e.data["cause"]},
    ),
    events.SCALE_CHANGED: (
        "on_scale_changed",
        lambda e: {"old_nodes": e.data["old_nodes"], "new_nodes": e.data["new_nodes"]},
    ),
    events.AGENT_STOPPING: (
        "on_agent_stopping",
        lambda e: {"exit_code": e.data["exit_code"], "reason": e.data["reason"]},
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


@dataclass(frozen=True)
class NamedSink:
    """A sink the bus feeds, and who it is (``rallypoint.registry.describe``), to name it
    when it fails."""

    sink: EventSink
    who: str


class EventBus:
    """Delivers the events of one agent."""

    def __init__(
        self,
        run: RunInfo,
        pm: PluginManager,
        sinks: Sequence[NamedSink] = (),
        event_log: str | None = None,
    ) -> None:
        self.run = run
        self.pm = pm
        # The event log first: the jsonl sink's writer, on the --event-log file.
        log = [NamedSink(JsonLinesSink(event_log), "the --event-log file")] if event_log else []
        self.sinks = [*log, *sinks]  # a sink that fails is dropped: nothing more is called
        self._lock = threading.Lock()

    def emit(
        self, name: str, subject: RoundInfo | WorkerFailure | None = None, **data: Any
    ) -> Event:
        """Record the event ``name`` about ``subject`` (see ``Event.subject``); ``data``
        is JSON-ready."""
        event = Event.of(name, self.run, subject, **data)
        with self._lock:
            for named in list(self.sinks):
                try:
                    named.sink.emit(event)
                except Exception as error:  # a plugin's: it must not stop the run
                    self.sinks.remove(named)
                    outcome = "it is disabled (no later event reaches it) and the job goes on"
                    logger.warning("%s", plugin_failure(named.who, "emit", error, outcome))
        hook = _HOOKS.get(name)
        if hook is not None:
            hook_name, arguments = hook
            # Plugin by plugin: one failing hook must not keep the others from the event.
            for _ in self.pm.call_each(
                hook_name, break_on_error=False, run=self.run, **arguments(event)
            ):
                pass
        return event

    def close(self) -> None:
        for named in self.sinks:
            try:
                named.sink.close()
            except Exception as error:  # a plugin's: the agent stops as it was going to
                outcome = "ignored: the job's exit code is unchanged"
                logger.warning("%s", plugin_failure(named.who, "close", error, outcome))
        self.sinks = []
