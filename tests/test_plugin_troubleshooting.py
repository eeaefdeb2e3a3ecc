"""docs/plugins/installing.md, "What to do when a plugin breaks": the broken plugins the
section shows are installed, and every command it shows (`$ ...` in a text block) is run
with bash, as a reader would type it; its output must contain the lines the page shows, in
order, once what changes from run to run (run ids, pids, host names, temporary paths,
addresses) is blanked out on both sides."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rallypoint.testing.helpers import clean_environment

INSTALLING = Path(__file__).resolve().parents[1] / "docs" / "plugins" / "installing.md"
SECTION = ("## What to do when a plugin breaks", "## Conflicts")
TIMEOUT = 120

_FILE = re.compile(r"^`([^`\n]+)`:\n\n```[\w-]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
_TEXT = re.compile(r"^```text\n(\$ .*?)^```", re.MULTILINE | re.DOTALL)
_VARYING = [
    (re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"), "<run>"),
    (re.compile(r"\S*/rallypoint-<run>-\w+/"), "<tmp>/"),
    (re.compile(r"node_id='[^']*'"), "node_id='<node>'"),
    (re.compile(r"hostname='[^']*'"), "hostname='<host>'"),
    (re.compile(r" on [^ ,]+, pid \d+"), " on <host>, pid <pid>"),
    (re.compile(r"pid=\d+"), "pid=<pid>"),
    (re.compile(r"timestamp=[\d.]+"), "timestamp=<time>"),
    (re.compile(r"from '[^']*/(rallypoint_\w+\.py)'"), r"from '<site>/\1'"),
    (re.compile(r" at 0x[0-9a-f]+"), " at <address>"),
]


def normalise(line: str) -> str:
    for pattern, replacement in _VARYING:
        line = pattern.sub(replacement, line)
    return line.rstrip()


def section() -> str:
    text = INSTALLING.read_text(encoding="utf-8")
    start, end = text.index(SECTION[0]), text.index(SECTION[1])
    return text[start:end]


def sessions() -> list[tuple[str, list[str]]]:
    found = []
    for block in _TEXT.findall(section()):
        command, *output = block.splitlines()
        found.append((command[2:], output))
    return found


@pytest.fixture(scope="module")
def scene(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """The section's plugins installed in a folder of their own, its script beside."""
    root = tmp_path_factory.mktemp("troubleshooting")
    site, work = root / "site", root / "work"
    site.mkdir()
    work.mkdir()
    files = dict(_FILE.findall(section()))
    assert "train.py" in files, "the section shows no train.py"
    for name, source in files.items():
        if name == "train.py":
            (work / name).write_text(source)
            continue
        plugin = re.fullmatch(r"rallypoint_(\w+)\.py", name)
        assert plugin, f"{name}: expected rallypoint_NAME.py"
        short = plugin.group(1)
        (site / name).write_text(source)
        info = site / f"rallypoint_{short}-1.0.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: rallypoint-{short}\nVersion: 1.0.0\n"
        )
        (info / "entry_points.txt").write_text(f"[rallypoint]\n{short} = rallypoint_{short}\n")
    bin_dir = str(Path(sys.executable).parent)
    env = clean_environment(
        {"PYTHONPATH": str(site), "PATH": bin_dir + os.pathsep + os.environ.get("PATH", "")}
    )
    return work, env


def test_the_section_shows_each_switch() -> None:
    commands = " ".join(command for command, _ in sessions())
    for switch in (
        "RALLYPOINT_DISABLE_PLUGINS=",
        "RALLYPOINT_TRACE_PLUGINS=1",
        "RALLYPOINT_LOAD_PLUGINS=",
    ):
        assert switch in commands


@pytest.mark.parametrize(("command", "shown"), sessions(), ids=[c for c, _ in sessions()])
def test_shown_output_is_real(
    scene: tuple[Path, dict[str, str]], command: str, shown: list[str]
) -> None:
    work, env = scene
    result = subprocess.run(
        ["bash", "-c", command],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    real = [normalise(line) for line in (result.stdout + result.stderr).splitlines()]
    position = 0
    for line in (normalise(line) for line in shown if line != "..."):
        try:
            position = real.index(line, position) + 1
        except ValueError:
            pytest.fail(f"not in the real output, in this order: {line!r}\n" + "\n".join(real))
