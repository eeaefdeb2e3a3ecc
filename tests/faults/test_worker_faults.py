"""Worker faults: one worker of a running job is killed, crashes, exits, raises or hangs.

Each job is ``tests/workers/faulty.py``: two gloo workers on one node (standalone) that
all-reduce every step and call ``rallypoint.progress()``; the last rank injects the fault
once, at step 10, and writes when it did to ``fault.json``. Recovery is measured from that
moment to the moment every rank of the restarted workers has completed an all-reduce
(``record.jsonl``). Every worker's command line carries the test's job directory (the
``job`` fixture), so that no process of the test can outlive it unnoticed.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
from fault_setups import Backend, Recovery, on_backends
from faulty_job import fault_time, job_directory, records, run_faulty, seconds_to_training

from launch import assert_no_worker_left, events, exit_codes, kill, worker

#: The watchdog's timeout in the hang scenarios: far above a step (0.05 s plus an
#: all-reduce) even on a 2-core CI machine running three of these jobs at once, where a
#: healthy worker was once starved for 3 s; short enough to keep the test short.
WATCHDOG = 5.0


@pytest.fixture
def job(tmp_path: Path) -> Path:
    return job_directory(tmp_path)


def run_job(job: Path, fault: str, *options: str, restarts: int = 1) -> str:
    """The job, ``fault`` injected by rank 1 at step 10; its stderr."""
    script = ("--fault", fault, "--at", "10", "--steps", "30")
    result = run_faulty(job, *script, options=options, restarts=restarts)
    assert result.returncode == (0 if restarts else 1), result.stderr
    return result.stderr


RESTARTED = "restarted once; the job finishes"
#: gloo's threads sometimes abort the interpreter's exit after an exception (SIGABRT): the
#: exception is named either way.
RAISED = r"(exit code 1|killed by SIGABRT) \(RuntimeError: injected fault at step 10\)"
HANG = ("--watchdog-timeout", str(WATCHDOG))

# (fault, agent options, the restart line's description of rank 1, worker_failed's fields)
CASES = [
    pytest.param(
        "sigkill",
        (),
        "killed by SIGKILL",
        {"signal": "SIGKILL"},
        marks=pytest.mark.fault(
            "Worker SIGKILL", expected=f"reported as killed by SIGKILL; {RESTARTED}"
        ),
        id="sigkill",
    ),
    pytest.param(
        "sigsegv",
        (),
        "killed by SIGSEGV",
        {"signal": "SIGSEGV"},
        marks=pytest.mark.fault(
            "Worker segmentation fault", expected=f"reported as killed by SIGSEGV; {RESTARTED}"
        ),
        id="sigsegv",
    ),
    pytest.param(
        "exit1",
        (),
        "exit code 1",
        {"exit_code": 1, "signal": None},
        marks=pytest.mark.fault(
            "Worker exits with code 1", expected=f"reported as exit code 1; {RESTARTED}"
        ),
        id="exit1",
    ),
    pytest.param(
        "exit137",
        (),
        "exit code 137",
        {"exit_code": 137, "signal": None},
        marks=pytest.mark.fault(
            "Worker exits with code 137",
            expected=f"reported as exit code 137, not as a signal; {RESTARTED}",
        ),
        id="exit137",
    ),
    pytest.param(
        "exception",
        (),
        RAISED,
        {"message": "RuntimeError: injected fault at step 10"},
        marks=pytest.mark.fault(
            "Worker raises an exception", expected=f"the exception is named; {RESTARTED}"
        ),
        id="exception",
    ),
    pytest.param(
        "hang",
        HANG,
        r"killed for a hang: rank 1 made no progress for \d+\.\d s \(watchdog\); "
        r"rank 1 was at faulty\.py:\d+ in \w+\(\)",
        {"signal": "SIGKILL"},
        marks=pytest.mark.fault(
            f"Worker hangs (`--watchdog-timeout {WATCHDOG:g}`)",
            expected=f"killed by the watchdog {WATCHDOG:g} s after its last progress signal, "
            f"its line named; {RESTARTED}",
        ),
        id="hang",
    ),
]


@pytest.mark.parametrize(("kind", "options", "described", "fields"), CASES)
def test_a_failed_worker_is_restarted_and_the_job_finishes(
    job: Path,
    recovery: Recovery,
    kind: str,
    options: tuple[str, ...],
    described: str,
    fields: dict[str, Any],
) -> None:
    stderr = run_job(job, kind, *options)
    # On one node the line ends there: no peer can have been lost.
    assert re.search(
        rf"rank 1 {described}; restart 1 of 1 \(restart policy 'max-restarts': restarts left\)\n",
        stderr,
    ), stderr
    recovery.seconds = seconds_to_training(job, fault_time(job))
    assert sorted(row["rank"] for row in records(job, "done")) == [0, 1]
    failed = events(job / "events.log", "worker_failed")
    assert failed[0]["rank"] == 1, failed  # the root cause first
    assert {k: failed[0][k] for k in fields} == fields, failed[0]
    assert all(row["rank"] == 0 for row in failed[1:]), "only rank 0 may fail after it"
    assert len(events(job / "events.log", "workers_started")) == 2
    if kind == "hang":
        assert failed[0]["stalled_seconds"] >= WATCHDOG
        assert f"made no progress for {failed[0]['stalled_seconds']:.1f} s" in stderr
        recovery.notes.append(f"of which {WATCHDOG:g} s is the watchdog's timeout")
    assert_no_worker_left(str(job))


@pytest.mark.parametrize(
    ("kind", "options"),
    [
        pytest.param(
            "exception",
            (),
            marks=pytest.mark.fault(
                "Worker raises, `--max-restarts 0`",
                expected="exit code 1; failure.json names rank 1 and the exception",
            ),
            id="exception",
        ),
        pytest.param(
            "hang",
            HANG,
            marks=pytest.mark.fault(
                "Worker hangs, `--max-restarts 0`",
                expected="exit code 1; failure.json names rank 1 and the watchdog",
            ),
            id="hang",
        ),
    ],
)
def test_no_restart_left_fails_with_the_root_cause(
    job: Path, recovery: Recovery, kind: str, options: tuple[str, ...]
) -> None:
    logs = job / "logs"
    stderr = run_job(job, kind, "--log-dir", str(logs), *options, restarts=0)
    assert "not restarted: all 0 restarts (--max-restarts) used up" in stderr
    (report_path,) = logs.glob("*/failure.json")
    root = json.loads(report_path.read_text())["root_cause"]
    assert root["rank"] == 1, root
    if kind == "exception":
        assert root["message"] == "RuntimeError: injected fault at step 10"
        assert "RuntimeError: injected fault at step 10" in root["traceback"]
        assert "error: RuntimeError: injected fault at step 10" in stderr
    else:
        assert root["signal"] == "SIGKILL" and root["stalled_seconds"] >= WATCHDOG
        assert re.search(
            r"root cause: rank 1 .*: killed for a hang: rank 1 made no progress for \d+\.\d s "
            r"\(watchdog\); rank 1 was at faulty\.py:\d+ in inject\(\)",
            stderr,
        ), stderr
        assert "faulty.py" in root["traceback"], root  # the stuck rank's main thread
    (stopping,) = events(job / "events.log", "agent_stopping")
    assert stopping["exit_code"] == 1
    recovery.seconds = round(stopping["wall_time"] - fault_time(job), 2)
    recovery.notes.append("to the failure report")
    assert records(job, "done") == []
    assert_no_worker_left(str(job))


@pytest.mark.fault(
    "Worker SIGKILL on one node of two",
    expected="both nodes restart their workers; the job finishes",
)
@on_backends("c10d")
def test_a_worker_killed_on_one_node_restarts_both(
    backend: Backend, job: Path, recovery: Recovery
) -> None:
    logs = [job / "node-a.log", job / "node-b.log"]
    script = (worker("faulty.py"), str(job), "--fault", "sigkill")
    agents: list[subprocess.Popen[str]] = []
    try:
        for log in logs:
            agents.append(
                backend.start_agent("job", "2", *script, log=log, nproc=1, max_restarts=1)
            )
        codes = exit_codes(agents, timeout=150)
    finally:
        kill(*agents)
    output = "\n".join(log.read_text() for log in logs)
    assert codes == [0, 0], output
    recovery.seconds = seconds_to_training(job, fault_time(job))
    # The node of rank 1 reports it, as its root cause (the other may report rank 0, which
    # lost its peer).
    root_causes = [failed[0] for log in logs if (failed := events(log, "worker_failed"))]
    assert {"rank": 1, "signal": "SIGKILL"} in [
        {"rank": row["rank"], "signal": row["signal"]} for row in root_causes
    ], root_causes
    # Until the next round, a node cannot tell a failure from a lost peer: it says so, and
    # counts the restart once the round shows both nodes still there.
    assert re.search(r"rank 1 killed by SIGKILL; the next round tells whether a node", output)
    assert re.search(
        r"rank 1 killed by SIGKILL; restart 1 of 1 \(restart policy 'max-restarts': restarts left\)\n",
        output,
    ), output
    for log in logs:
        assert len(events(log, "workers_started")) == 2, log.read_text()
    assert sorted(row["rank"] for row in records(job, "done")) == [0, 1]
    assert_no_worker_left(str(job))
