"""The conformance suite every metrics sink must pass.

A sink's tests subclass ``MetricsSinkConformance`` and provide one fixture, ``sink``: the
``MetricsSink`` registration, as the plugin's ``register_metrics_sinks`` returns it. The
suite creates the sink as the agent does (a ``SinkContext`` with every declared option,
and a worker metrics directory when the sink asks for one), feeds it events and closes it,
checking what the agent relies on:

* ``create`` returns an object with ``emit(event)`` and ``close()``;
* ``emit`` accepts every event of ``rallypoint.events``, with the data the agent sends, with
  no data at all, and events whose names do not exist yet (a newer agent sends more):
  it never raises;
* a whole run, from ``agent_started`` to ``agent_stopping``, then ``close``, works; so does
  ``close`` without any event; two sinks of one kind live side by side;
* options are well formed.

``close`` is called once, as the agent does; a sink whose ``close`` may be called twice
says so with the ``idempotent_close`` fixture (default ``False``) and the suite checks it.

Optional fixtures: ``options`` (the ``--metrics-conf`` values; default: every declared
option at its default, which is fine for most sinks; a sink that binds a port or writes
a file should point it at a free port or into ``tmp_path``), ``run`` (the ``RunInfo``),
``idempotent_close`` and ``check_sink`` (called with the options after each run, to look
at what the sink produced; default: does nothing).

    import pytest
    from rallypoint_mysink import SINK
    from rallypoint.testing.metrics_sink_conformance import MetricsSinkConformance

    class TestMySink(MetricsSinkConformance):
        @pytest.fixture
        def sink(self):
            return SINK

        @pytest.fixture
        def options(self, tmp_path):
            return {"path": str(tmp_path / "metrics.out")}
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest

from rallypoint import events
from rallypoint.events import Event, RunInfo
from rallypoint.extensions import ConfigOption, EventSink, MetricsSink, SinkContext

CheckSink = Callable[[Mapping[str, Any]], None]

_ROUND = {
    "round": 1,
    "group_rank": 0,
    "group_world_size": 2,
    "world_size": 8,
    "master_addr": "host-a",
    "master_port": 29500,
    "members": ["node-a", "node-b"],
}

#: The data the agent sends with each event (see ``rallypoint.events`` and the user guide).
SAMPLE_DATA: dict[str, dict[str, Any]] = {
    events.AGENT_STARTED: {"nproc_per_node": 4, "min_nodes": 1, "max_nodes": 2},
    events.RENDEZVOUS_STARTED: {"restart_count": 0},
    events.RENDEZVOUS_COMPLETED: {**_ROUND, "duration_seconds": 0.12},
    events.WORKERS_STARTED: {**_ROUND, "pids": [101, 102, 103, 104]},
    events.WORKER_FAILED: {
        "local_rank": 1,
        "rank": 1,
        "pid": 102,
        "exit_code": None,
        "signal": "SIGKILL",
        "message": "killed",
        "timestamp": 1_700_000_000.0,
    },
    events.WORKERS_RESTARTED: {"restart_count": 1, "cause": "failure"},
    events.SCALE_CHANGED: {"old_nodes": 2, "new_nodes": 1},
    events.NODES_WAITING: {"nodes_waiting": 1},
    events.CHECKPOINT_SAVED: {
        "step": 100,
        "seconds": 1.5,
        "bytes": 4096,
        "rank": 0,
        "blocked_seconds": 0.1,
        "asynchronous": True,
    },
    events.CHECKPOINT_LOADED: {"step": 100, "seconds": 0.5, "bytes": 4096, "rank": 0, "skipped": 1},
    events.AGENT_STOPPING: {"exit_code": 0, "reason": "all workers finished"},
}


def event_names() -> list[str]:
    """Every event name ``rallypoint.events`` declares (its upper-case string constants)."""
    return sorted(
        value
        for name, value in vars(events).items()
        if re.fullmatch(r"[A-Z][A-Z_]+", name) and isinstance(value, str)
    )


def run_timeline() -> list[tuple[str, dict[str, Any]]]:
    """A run with a failure, a restart and a checkpoint, in the agent's order."""
    order = [
        events.AGENT_STARTED,
        events.RENDEZVOUS_STARTED,
        events.RENDEZVOUS_COMPLETED,
        events.WORKERS_STARTED,
        events.CHECKPOINT_LOADED,
        events.CHECKPOINT_SAVED,
        events.NODES_WAITING,
        events.WORKER_FAILED,
        events.WORKERS_RESTARTED,
        events.RENDEZVOUS_STARTED,
        events.RENDEZVOUS_COMPLETED,
        events.SCALE_CHANGED,
        events.WORKERS_STARTED,
        events.AGENT_STOPPING,
    ]
    return [(name, SAMPLE_DATA[name]) for name in order]


class MetricsSinkConformance:
    """Subclass with a ``sink`` fixture returning the ``MetricsSink`` to check."""

    @pytest.fixture
    def options(self, sink: MetricsSink) -> Mapping[str, Any]:
        return {option.name: option.default for option in sink.options}

    @pytest.fixture
    def run(self) -> RunInfo:
        return RunInfo(run_id="conformance", node_id="node-a", hostname="host-a", role="trainer")

    @pytest.fixture
    def idempotent_close(self) -> bool:
        return False

    @pytest.fixture
    def check_sink(self) -> CheckSink:
        return lambda options: None

    @pytest.fixture
    def create(
        self,
        sink: MetricsSink,
        options: Mapping[str, Any],
        run: RunInfo,
        tmp_path: Path,
    ) -> Iterator[Callable[[], EventSink]]:
        """Creates the sink as the agent does; closes what a failing test left open."""
        created: list[EventSink] = []
        closed: set[int] = set()

        def make() -> EventSink:
            metrics_dir = None
            if sink.worker_metrics:
                directory = tmp_path / f"worker-metrics-{len(created)}"
                directory.mkdir()
                metrics_dir = str(directory)
            values = {option.name: option.default for option in sink.options}
            values.update(options)
            instance = sink.create(SinkContext(run, MappingProxyType(values), metrics_dir))
            created.append(instance)
            original_close = instance.close

            def close_once() -> None:
                closed.add(id(instance))
                original_close()

            try:
                instance.close = close_once  # type: ignore[method-assign]
            except AttributeError:  # __slots__: the test closes it, or nobody does
                closed.add(id(instance))
            return instance

        yield make
        for instance in created:
            if id(instance) not in closed:
                instance.close()

    def _event(self, run: RunInfo, name: str, data: Mapping[str, Any]) -> Event:
        return Event(name, run, MappingProxyType(dict(data)))

    # --- the registration ---------------------------------------------------------------

    def test_registration_is_well_formed(self, sink: MetricsSink) -> None:
        assert isinstance(sink, MetricsSink)
        assert sink.name == sink.name.strip().lower()
        assert sink.description.strip(), "describe the sink in one line for --help"
        assert callable(sink.create)
        names = [option.name for option in sink.options]
        assert len(names) == len(set(names)), f"an option is declared twice: {names}"
        for option in sink.options:
            assert isinstance(option, ConfigOption)
            assert option.help, f"option {option.name!r} needs a help line"
            if option.default is not None:
                assert isinstance(option.default, option.type), option

    def test_create_gives_emit_and_close(self, create: Callable[[], EventSink]) -> None:
        instance = create()
        assert callable(getattr(instance, "emit", None)), "the sink has no emit(event)"
        assert callable(getattr(instance, "close", None)), "the sink has no close()"
        instance.close()

    # --- events -------------------------------------------------------------------------

    def test_every_event_is_accepted(
        self,
        create: Callable[[], EventSink],
        run: RunInfo,
        options: Mapping[str, Any],
        check_sink: CheckSink,
    ) -> None:
        instance = create()
        for name in event_names():
            instance.emit(self._event(run, name, SAMPLE_DATA.get(name, {})))
        instance.close()
        check_sink(options)

    def test_events_without_data_are_accepted(
        self, create: Callable[[], EventSink], run: RunInfo
    ) -> None:
        instance = create()
        for name in event_names():
            instance.emit(self._event(run, name, {}))
        instance.close()

    def test_unknown_events_are_accepted(
        self, create: Callable[[], EventSink], run: RunInfo
    ) -> None:
        """A newer agent sends events this sink has never heard of: ignore, never raise."""
        instance = create()
        unknown: list[tuple[str, dict[str, Any]]] = [
            ("event_from_the_future", {}),
            ("gpu_temperature", {"celsius": 81.5, "device": 3}),
            ("nested_data", {"members": [{"id": "a"}], "ok": True, "none": None}),
            (events.WORKER_FAILED, {"exit_code": "not a number", "signal": 9}),
        ]
        for name, data in unknown:
            instance.emit(self._event(run, name, data))
        instance.close()

    def test_a_whole_run(
        self,
        create: Callable[[], EventSink],
        run: RunInfo,
        options: Mapping[str, Any],
        check_sink: CheckSink,
    ) -> None:
        instance = create()
        for name, data in run_timeline():
            instance.emit(self._event(run, name, data))
        instance.close()
        check_sink(options)

    def test_close_without_events(self, create: Callable[[], EventSink]) -> None:
        create().close()

    def test_close_twice(
        self, create: Callable[[], EventSink], run: RunInfo, idempotent_close: bool
    ) -> None:
        if not idempotent_close:
            pytest.skip("close() is called once; this sink does not promise more")
        instance = create()
        instance.emit(self._event(run, events.AGENT_STARTED, SAMPLE_DATA[events.AGENT_STARTED]))
        instance.close()
        instance.close()

    def test_one_after_another(self, create: Callable[[], EventSink], run: RunInfo) -> None:
        """A second run in one process (tests, notebooks) creates the sink again."""
        for _ in range(2):
            instance = create()
            for name, data in run_timeline()[:4]:
                instance.emit(self._event(run, name, data))
            instance.close()
