"""Workers get a terminal when ``rallypoint run`` has one, as under torchrun: a
pseudo-terminal per worker stream that goes to the console, so that tqdm bars animate and
colours stay; prefixes, ``--redirects``, ``--tee``, ``--local-ranks-filter`` and the failure
report keep working. Run under a real pseudo-terminal (util-linux's ``script``)."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from pathlib import Path

from launch import RALLYPOINT, clean_environment, worker


def in_terminal(*args: str, columns: int = 100) -> tuple[int, str]:
    """``rallypoint ARGS`` in a pseudo-terminal of ``columns`` columns: its exit code and
    everything the terminal received."""
    command = shlex.join([RALLYPOINT, *args])
    result = subprocess.run(
        ["script", "-qec", f"stty cols {columns} rows 30; {command}", "/dev/null"],
        capture_output=True,
        env=clean_environment(),
        timeout=120,
    )
    return result.returncode, result.stdout.decode("utf-8", "replace")


def test_a_worker_on_the_console_gets_a_terminal(tmp_path: Path) -> None:
    code, screen = in_terminal(
        "run", "--nproc-per-node", "2", "--log-dir", str(tmp_path), worker("terminal.py"), "--raise"
    )
    assert code == 1, screen
    for rank in (0, 1):
        # The terminal is as wide as the agent's, less the prefix.
        assert f"[default{rank}]:stdout isatty=True stderr isatty=True columns=89" in screen
        assert f"[default{rank}]:\x1b[32mcoloured\x1b[0m" in screen
        # The bar is redrawn in place as it goes (a carriage return, the prefix, the bar).
        redraws = re.findall(rf"\r\[default{rank}\]:steps: +\d+%\|", screen)
        assert len(redraws) >= 5, screen
    assert "[default1]:ValueError: the bar is done" in screen
    (report,) = tmp_path.glob("*/failure.json")
    root = json.loads(report.read_text())["root_cause"]
    assert root["message"] == "ValueError: the bar is done"
    assert "raise ValueError" in root["traceback"]
    assert "\x1b" not in root["traceback"] and "\r" not in root["traceback"]


def test_redirected_and_filtered_streams_are_not_terminals(tmp_path: Path) -> None:
    code, screen = in_terminal(
        "run", "--nproc-per-node", "2", "--log-dir", str(tmp_path),
        "--redirects", "0:2", "--tee", "1:3", "--local-ranks-filter", "0",
        worker("terminal.py"),
    )  # fmt: skip
    assert code == 0, screen
    # Rank 0: stdout on the console, stderr redirected to its file.
    assert "[default0]:stdout isatty=True stderr isatty=False" in screen
    assert "[default0]:steps" not in screen
    (log_dir,) = tmp_path.glob("*/attempt_0")
    assert "steps: 100%" in (log_dir / "0" / "stderr.log").read_text()
    # Rank 1 is filtered off the console: its teed streams go to files only, not terminals.
    assert "[default1]" not in screen
    assert "stdout isatty=False stderr isatty=False" in (log_dir / "1" / "stdout.log").read_text()


def test_a_teed_stream_is_live_on_the_console_and_whole_in_its_file(tmp_path: Path) -> None:
    code, screen = in_terminal(
        "run", "--log-dir", str(tmp_path), "--tee", "3", worker("terminal.py")
    )
    assert code == 0, screen
    assert "[default0]:stdout isatty=True stderr isatty=True" in screen
    assert len(re.findall(r"\r\[default0\]:steps: +\d+%\|", screen)) >= 5, screen
    (log_dir,) = tmp_path.glob("*/attempt_0/0")
    assert (log_dir / "stderr.log").read_bytes().count(b"\rsteps:") >= 5


def test_without_a_terminal_workers_write_to_pipes() -> None:
    result = subprocess.run(
        [RALLYPOINT, "run", worker("terminal.py")],
        capture_output=True,
        env=clean_environment(),
        timeout=120,
    )
    result.stdout, result.stderr = result.stdout.decode(), result.stderr.decode()
    assert result.returncode == 0, result.stderr
    assert "[default0]:stdout isatty=False stderr isatty=False columns=None" in result.stdout
    # A pipe is copied line by line: the bar's redraws arrive as one line, at the end.
    (bar,) = [line for line in result.stderr.split("\n") if "steps: 100%" in line]
    assert bar.startswith("[default0]:") and bar.count("\r") >= 5, repr(bar)
