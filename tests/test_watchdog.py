"""The progress watchdog's parts: heartbeats from a worker, the agent's bookkeeping, the
flag, and how a stalled worker is reported. The real job is in tests/faults/."""

from __future__ import annotations

import math
import queue
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import rallypoint
from launch import events
from launch import rallypoint as run_rallypoint
from rallypoint.agent.monitoring.failures import describe_exit, describe_failure
from rallypoint.agent.monitoring.watchdog import Watchdog
from rallypoint.config import LaunchConfig
from rallypoint.errors import UsageError
from rallypoint.events import WorkerFailure
from rallypoint.plugins import get_plugin_manager
from rallypoint.worker import channel as worker_channel
from rallypoint.worker import progress

# --- the worker's side ------------------------------------------------------------------


@pytest.fixture
def received(monkeypatch: pytest.MonkeyPatch) -> Iterator[queue.Queue[dict[str, Any]]]:
    """The heartbeats an agent's receiver gets from this process, acting as a worker."""
    beats: queue.Queue[dict[str, Any]] = queue.Queue()
    receiver = worker_channel.Receiver(lambda name, data: None, heartbeat=beats.put)
    monkeypatch.setenv(worker_channel.ENV, receiver.address)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(progress, "_last_sent", -math.inf)
    yield beats
    receiver.close()


def test_a_heartbeat_reaches_the_agent_with_the_workers_clock(
    received: queue.Queue[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(progress.ENV, "5")
    before = time.monotonic()
    rallypoint.heartbeat()
    beat = received.get(timeout=10)
    assert beat["local_rank"] == 1
    assert before <= beat["sent"] <= time.monotonic()


def test_heartbeats_are_rate_limited(
    received: queue.Queue[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(progress.ENV, "5")
    clock = SimpleNamespace(monotonic=lambda: 1000.0)
    monkeypatch.setattr(progress, "time", clock)
    for _ in range(1000):
        rallypoint.heartbeat()
    clock.monotonic = lambda: 1000.1  # min(0.1 s, timeout / 10) later
    rallypoint.heartbeat()
    assert received.get(timeout=10)["sent"] == 1000.0
    assert received.get(timeout=10)["sent"] == 1000.1  # datagrams keep their order
    assert received.empty()  # the 999 others were never sent


@pytest.mark.parametrize("timeout", [None, "0", "soon"])
def test_without_a_watchdog_a_heartbeat_still_tells_the_step(
    received: queue.Queue[dict[str, Any]], monkeypatch: pytest.MonkeyPatch, timeout: str | None
) -> None:
    """The agent accounts goodput by the steps, watchdog or not."""
    if timeout is None:
        monkeypatch.delenv(progress.ENV, raising=False)
    else:
        monkeypatch.setenv(progress.ENV, timeout)
    rallypoint.heartbeat(step=7)
    assert received.get(timeout=10)["step"] == 7


def test_a_new_step_is_not_held_back_by_the_rate_limit(
    received: queue.Queue[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = SimpleNamespace(monotonic=lambda: 1000.0)
    monkeypatch.setattr(progress, "time", clock)
    monkeypatch.setattr(progress, "_last_step", None)
    rallypoint.heartbeat(step=1)
    rallypoint.heartbeat(step=1)  # the same step, at once: held back
    clock.monotonic = lambda: 1000.05  # under the 0.1 s gap, but a new step
    rallypoint.heartbeat(step=2)
    assert [received.get(timeout=10)["step"] for _ in range(2)] == [1, 2]
    assert received.empty()


def test_a_heartbeat_without_an_agent_is_harmless(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(progress.ENV, "5")
    monkeypatch.setenv(worker_channel.ENV, "rallypoint-nobody-listens-here")
    monkeypatch.setattr(progress, "_last_sent", -math.inf)
    rallypoint.heartbeat()  # no receiver: dropped, no error
    monkeypatch.delenv(worker_channel.ENV)
    monkeypatch.setattr(progress, "_last_sent", -math.inf)
    rallypoint.heartbeat()  # outside rallypoint run


# --- the agent's side -------------------------------------------------------------------


def test_the_watchdog_arms_on_the_first_heartbeat() -> None:
    watchdog = Watchdog(2.0)
    watchdog.watch(100.0)
    assert watchdog.overdue([0, 1], now=1000.0) == {}  # never beat: start-up takes its time
    assert watchdog.seconds_left([0, 1], now=1000.0) == math.inf
    watchdog.beat({"local_rank": 1, "sent": 101.0})
    assert watchdog.seconds_left([0, 1], now=102.0) == pytest.approx(1.0)
    assert watchdog.overdue([0, 1], now=102.5) == {}
    assert watchdog.overdue([0, 1], now=103.0) == {1: 101.0}
    assert watchdog.overdue([0], now=103.0) == {}  # rank 1 is not running (any more)
    watchdog.beat({"local_rank": 1, "sent": 102.5})
    assert watchdog.overdue([0, 1], now=103.0) == {}
    watchdog.beat({"local_rank": 1, "sent": 101.5})  # late, out of order: not a step back
    assert watchdog.last_heartbeat(1) == 102.5


def test_heartbeats_of_an_earlier_attempt_are_ignored() -> None:
    watchdog = Watchdog(2.0)
    watchdog.beat({"local_rank": 0, "sent": 50.0})  # before any attempt
    watchdog.watch(100.0)
    watchdog.beat({"local_rank": 0, "sent": 99.0})  # sent by a worker already replaced
    assert watchdog.last_heartbeat(0) is None
    watchdog.beat({"local_rank": 0, "sent": 100.5})
    watchdog.watch(200.0)  # the next attempt forgets every worker
    assert watchdog.last_heartbeat(0) is None


@pytest.mark.parametrize(
    "data",
    [
        {},
        {"local_rank": None, "sent": 101.0},
        {"local_rank": True, "sent": 101.0},
        {"local_rank": "0", "sent": 101.0},
        {"local_rank": 0, "sent": "101"},
        {"local_rank": 0, "sent": math.nan},
        {"local_rank": 0, "sent": False},
    ],
)
def test_malformed_heartbeats_are_ignored(data: dict[str, Any]) -> None:
    watchdog = Watchdog(2.0)
    watchdog.watch(100.0)
    watchdog.beat(data)
    assert watchdog.overdue([0, 1], now=1000.0) == {}


def test_a_heartbeat_from_the_future_counts_as_now() -> None:
    watchdog = Watchdog(2.0)
    watchdog.watch(0.0)
    watchdog.beat({"local_rank": 0, "sent": time.monotonic() + 3600})
    last = watchdog.last_heartbeat(0)
    assert last is not None and last <= time.monotonic()


# --- the flag and the report -------------------------------------------------------------


@pytest.fixture
def script(tmp_path: Path) -> str:
    path = tmp_path / "train.py"
    path.write_text("")
    return str(path)


@pytest.mark.parametrize(("value", "expected"), [(None, None), ("0", None), ("2.5", 2.5)])
def test_watchdog_timeout_flag(script: str, value: str | None, expected: float | None) -> None:
    registry = get_plugin_manager().registry
    config = LaunchConfig.from_flags(registry, training_script=script, watchdog_timeout=value)
    assert config.watchdog_timeout == expected


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        ("-1", "must be at least 0"),
        ("soon", "expected a number"),
        ("nan", "expected a finite number"),
    ],
)
def test_a_bad_watchdog_timeout_is_a_usage_error(script: str, value: str, fragment: str) -> None:
    registry = get_plugin_manager().registry
    with pytest.raises(UsageError, match=f"--watchdog-timeout '{value}': {fragment}"):
        LaunchConfig.from_flags(registry, training_script=script, watchdog_timeout=value)


def test_a_bad_watchdog_timeout_is_one_line_and_exit_code_2(script: str) -> None:
    result = run_rallypoint("run", "--watchdog-timeout", "-5", script)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        "rallypoint: error: --watchdog-timeout '-5': must be at least 0."
    ]
    result = run_rallypoint("run", script, env={"PET_WATCHDOG_TIMEOUT": "never"})
    assert result.returncode == 2, result.stderr
    assert "--watchdog-timeout 'never': expected a number." in result.stderr


def test_a_stalled_worker_is_described_by_its_silence() -> None:
    failure = WorkerFailure(
        local_rank=1, rank=3, pid=42, exit_code=None, signal="SIGKILL", stalled_seconds=5.04
    )
    assert describe_exit(failure) == "made no progress for 5.0 s (watchdog)"
    assert describe_failure(failure) == "made no progress for 5.0 s (watchdog)"


def test_checkpoint_saves_alone_arm_the_watchdog(tmp_path: Path) -> None:
    """A script that never calls heartbeat() but saves every step is watched: it hangs
    after step 4, and the watchdog kills it (the saves told the agent its steps)."""
    script = tmp_path / "saves_then_hangs.py"
    script.write_text(
        "import time, torch\n"
        "from rallypoint import checkpoint\n"
        "for step in range(5):\n"
        "    checkpoint.save({'w': torch.zeros(4)}, step)\n"
        "    time.sleep(0.1)\n"
        "time.sleep(120)\n"
    )
    result = run_rallypoint(  # the script alone would sleep for 120 s, past the timeout
        "run", "--watchdog-timeout", "2", "--checkpoint-dir", str(tmp_path / "ckpt"),
        "--event-log", str(tmp_path / "events.jsonl"), str(script), timeout=90,
    )  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr
    assert "made no progress for" in result.stdout + result.stderr
    steps = [e["step"] for e in events(tmp_path / "events.log", "progress")]
    assert steps[-1] == 4
