"""The fixed watchdog (``--watchdog-timeout``): the flag, how a stalled worker is reported,
and a job whose only progress signals are its saves. Its decisions are hang detection's
(tests/test_hangs.py); a worker's progress: tests/test_progress_sources.py. The real job is
in tests/faults/."""

from __future__ import annotations

from pathlib import Path

import pytest

from launch import events
from launch import rallypoint as run_rallypoint
from rallypoint.agent.monitoring.failures import describe_exit, describe_failure
from rallypoint.config import LaunchConfig
from rallypoint.errors import UsageError
from rallypoint.events import WorkerFailure
from rallypoint.plugins import get_plugin_manager


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
