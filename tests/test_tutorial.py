"""docs/plugins/tutorial.md, followed literally in a fresh directory: its files are written
from the page's code blocks, the wheel is built and installed as its packaging step says,
and every command it shows with its output (`$ ...` in a text block) is run and compared:
the plugin is listed, passes its tests (the metrics sink conformance suite) and is used by
a real `rallypoint run`.

Two deviations, both because tests run offline and must not change the environment they
run in: pip builds without build isolation from the local index only, and the wheel is
installed into a folder of the test's own on ``PYTHONPATH`` (``pip install --target``)
instead of the virtual environment (see test_example_plugin.py).
"""

from __future__ import annotations

import csv
import io
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from rallypoint.testing.helpers import CliRunner, clean_environment

TUTORIAL = Path(__file__).resolve().parents[1] / "docs" / "plugins" / "tutorial.md"
TIMEOUT = 120

#: A file of the tutorial: a line holding only "`path`:", a blank line, a fenced block.
_FILE = re.compile(r"^`([^`\n]+)`:\n\n```[\w-]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
_BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.MULTILINE | re.DOTALL)
_ISO_TIME = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}\+00:00$")


@dataclass
class Tutorial:
    text: str
    workdir: Path
    site: Path
    #: The shown sessions: command -> the output the page shows for it.
    sessions: dict[str, list[str]]
    #: The commands of the `sh` blocks, one per line.
    commands: list[str]


def _sessions(text: str) -> dict[str, list[str]]:
    sessions: dict[str, list[str]] = {}
    for language, body in _BLOCK.findall(text):
        if language != "text" or not body.startswith("$ "):
            continue
        command = ""
        for line in body.splitlines():
            if line.startswith("$ "):
                command = line[2:]
                sessions[command] = []
            else:
                sessions[command].append(line)
    return sessions


def _pip(*args: str, cwd: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", *args],
        cwd=cwd,
        check=True,
        timeout=300,
        capture_output=True,
    )


@pytest.fixture(scope="module")
def tutorial(tmp_path_factory: pytest.TempPathFactory) -> Tutorial:
    text = TUTORIAL.read_text(encoding="utf-8")
    workdir = tmp_path_factory.mktemp("tutorial")
    files = _FILE.findall(text)
    assert files, "the tutorial shows no files"
    for name, body in files:
        path = workdir / name
        assert not path.exists(), f"{name} is shown twice"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(body, encoding="utf-8")
    commands = [
        line.strip()
        for language, body in _BLOCK.findall(text)
        if language == "sh"
        for line in body.splitlines()
        if line.strip()
    ]
    # Section 7, packaging: build the wheel, then install that wheel.
    build = next(c for c in commands if c.startswith("pip wheel "))
    _pip(*shlex.split(build)[1:], "--no-build-isolation", "--no-index", cwd=workdir)
    install = next(c for c in commands if c.startswith("pip install dist/"))
    wheel = shlex.split(install)[-1]
    assert (workdir / wheel).is_file(), f"pip wheel did not make {wheel}"
    site = workdir.parent / f"{workdir.name}-site"
    _pip("install", "--no-deps", "--no-index", "--target", str(site), wheel, cwd=workdir)
    return Tutorial(text, workdir, site, _sessions(text), commands)


def _runner(tutorial: Tutorial) -> CliRunner:
    return CliRunner(cwd=tutorial.workdir, timeout=TIMEOUT)


def test_every_shown_command_is_checked(tutorial: Tutorial) -> None:
    """A command added to the page needs a check here."""
    assert sorted(tutorial.sessions) == sorted(
        [
            "rallypoint plugins",
            "pytest rallypoint-csv",
            "rallypoint run --standalone --nproc-per-node 2 --metrics csv "
            "--metrics-conf csv_path=events.csv train.py",
            "cat events.csv",
        ]
    )


def test_the_plugin_is_listed(tutorial: Tutorial) -> None:
    result = _runner(tutorial).run("plugins", pythonpath=[tutorial.site])
    assert result.exit_code == 0, result.output
    shown = [line for line in tutorial.sessions["rallypoint plugins"] if line != "..."]
    missing = [line for line in shown if line not in result.stdout.splitlines()]
    assert not missing, f"not in the real output:\n{result.stdout}"


def test_its_tests_pass(tutorial: Tutorial) -> None:
    shown = "\n".join(tutorial.sessions["pytest rallypoint-csv"])
    count = re.search(r"(\d+) passed", shown)
    assert count, shown
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "rallypoint-csv"],
        cwd=tutorial.workdir,
        env=clean_environment({"PYTHONPATH": str(tutorial.site)}),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f" {count.group(1)} passed" in result.stdout, result.stdout


def test_a_real_run_uses_it(tutorial: Tutorial) -> None:
    run = next(command for command in tutorial.sessions if command.startswith("rallypoint run"))
    result = _runner(tutorial).run(*shlex.split(run)[1:], pythonpath=[tutorial.site])
    assert result.exit_code == 0, result.output
    worker_lines = {line for line in result.stdout.splitlines() if line.startswith("[default")}
    assert worker_lines == set(tutorial.sessions[run])

    shown = list(csv.reader(io.StringIO("\n".join(tutorial.sessions["cat events.csv"]))))
    written = list(csv.reader(io.StringIO((tutorial.workdir / "events.csv").read_text())))
    assert written[0] == shown[0], "the header differs"
    assert len(written) == len(shown), written
    nodes = {row[2] for row in written[1:]}
    assert len(nodes) == 1, nodes
    for real, page in zip(written[1:], shown[1:], strict=True):
        assert _ISO_TIME.match(real[0]), real
        # time and node differ from run to run; event, round, world size, exit code do not
        assert [real[1], *real[3:]] == [page[1], *page[3:]], (real, page)
