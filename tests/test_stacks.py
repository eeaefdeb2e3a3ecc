"""Taking a rank's stacks before a hang's kill (``rallypoint.agent.monitoring.stacks``),
from real processes: one blocked in Python, one spinning, one stopped."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from rallypoint.agent.monitoring.stacks import capture, keep_flight_records, parse
from rallypoint.worker.variables import STACKS_SIGNAL

PROGRAM = """
import faulthandler, sys, threading, time
stacks = open(sys.argv[1], "a")
faulthandler.register({signal}, file=stacks, all_threads=True, chain=False)
main = threading.main_thread().ident

def inside(frame, name):
    while frame is not None and frame.f_code.co_name != name:
        frame = frame.f_back
    return frame is not None

def ready():  # says the main thread's ident once it is inside its call, not before
    while not inside(sys._current_frames()[main], "{call}"):
        time.sleep(0.001)
    print(main, flush=True)

def read_forever():
    threading.Event().wait()

def spin():
    while True:
        pass

threading.Thread(target=ready, daemon=True).start()
{call}()
"""


def start(tmp_path: Path, call: str) -> tuple[subprocess.Popen[str], Path, int]:
    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent(PROGRAM.format(signal=int(STACKS_SIGNAL), call=call)))
    stacks = tmp_path / "stacks.txt"
    process = subprocess.Popen(
        [sys.executable, str(script), str(stacks)], stdout=subprocess.PIPE, text=True
    )
    assert process.stdout is not None
    main = int(process.stdout.readline())
    return process, stacks, main


@pytest.fixture
def processes() -> list[subprocess.Popen[str]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for process in started:
        process.kill()
        process.wait(10)


@pytest.mark.parametrize(
    ("call", "place"),
    [
        ("read_forever", r"rank\.py:18 in read_forever\(\) \(threading\.py:\d+ in wait\(\)\)"),
        ("spin", r"rank\.py:2[12] in spin\(\)"),
    ],
)
def test_a_rank_that_answers_names_its_line(
    tmp_path: Path, processes: list[subprocess.Popen[str]], call: str, place: str
) -> None:
    process, stacks, main = start(tmp_path, call)
    processes.append(process)
    found = capture({0: process.pid}, {0: stacks}, {0: main})
    assert re.fullmatch(place, found[0].place())
    traceback = found[0].traceback()
    assert traceback.splitlines()[0] == "Stack of the main thread (most recent call last):"
    assert f"in {call}" in traceback
    assert process.poll() is None  # asking for stacks never stops a rank


def test_a_stopped_rank_is_described_from_outside(
    tmp_path: Path, processes: list[subprocess.Popen[str]]
) -> None:
    process, stacks, main = start(tmp_path, "read_forever")
    processes.append(process)
    os.kill(process.pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the stop takes effect asynchronously
        if Path(f"/proc/{process.pid}/stat").read_text().rpartition(")")[2].split()[0] == "T":
            break
        time.sleep(0.01)
    found = capture({0: process.pid}, {0: stacks}, {0: main})
    assert found[0].place().startswith("stopped (SIGSTOP or a debugger)")
    assert stacks.stat().st_size == 0 if stacks.exists() else True
    os.kill(process.pid, signal.SIGCONT)


def test_the_dump_is_parsed_by_thread_innermost_first() -> None:
    text = textwrap.dedent(
        """\
        Thread 0x00007f0000000002 (most recent call first):
          File "/usr/lib/python3.11/threading.py", line 331 in wait
          File "/job/data.py", line 120 in read

        Current thread 0x00007f0000000001 (most recent call first):
          File "/job/train.py", line 88 in <module>
        """
    )
    threads = parse(text)
    assert [f.describe() for f in threads[0x7F0000000002]] == [
        "threading.py:331 in wait()",
        "data.py:120 in read()",
    ]
    assert [f.line for f in threads[0x7F0000000001]] == [88]


def test_a_flight_record_torch_wrote_during_the_attempt_is_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", str(tmp_path / "trace_"))
    (tmp_path / "trace_3").write_bytes(b"dump")
    old = tmp_path / "trace_2"
    old.write_bytes(b"older")
    os.utime(old, (1, 1))  # before the attempt: another run's
    kept = keep_flight_records([2, 3, 4], time.time() - 60, tmp_path / "hang")
    assert [p.name for p in kept] == ["trace_3"]
    assert kept[0].read_bytes() == b"dump"
