"""`rallypoint plugins new`: a plugin of every kind, installed as written, passes its own
tests (the conformance suite of its kind) and is listed by `rallypoint plugins`.

The five are installed with one pip call into a folder of the test's own on
``PYTHONPATH`` (see test_example_plugin.py for why not the virtual environment). The
generated rendezvous store keeps its keys in memory, as rallypoint's ``MemoryStore``
does, whose run through the whole store conformance suite, protocol included, is in
test_store_conformance.py; here its store operations run, while the slow protocol
scenarios (seconds of waiting each) are left out.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from launch import pip_install_target
from rallypoint.scaffold import KINDS
from rallypoint.testing.helpers import CliRunner, clean_environment

TIMEOUT = 180
#: The store conformance tests that exercise rallypoint's protocol rather than the store.
PROTOCOL_TESTS = (
    "not joins and not run_ids and not late_node and not full_job and not dead_node "
    "and not leader_that_died and not malformed_state"
)


@pytest.fixture(scope="module")
def generated(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("template")
    runner = CliRunner(cwd=root)
    for kind in KINDS:
        result = runner.invoke("plugins", "new", f"t-{kind}", "--kind", kind, "--dir", "plugins")
        assert result.exit_code == 0, result.output
        assert f"created plugins/rallypoint-t-{kind}: a {KINDS[kind]} plugin" in result.stdout
    plugins = root / "plugins"
    site = root / "site"
    pip_install_target(sorted(plugins.iterdir()), site)
    return plugins, site


def test_every_kind_makes_a_complete_distribution(generated: tuple[Path, Path]) -> None:
    plugins, _ = generated
    for kind in KINDS:
        ident = f"t_{kind.replace('-', '_')}"
        folder = plugins / f"rallypoint-t-{kind}"
        files = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
        files = [f for f in files if not f.startswith(("build/", f"rallypoint_{ident}.egg-info"))]
        assert {"pyproject.toml", "README.md", f"tests/test_{ident}.py"} <= set(files), files
        assert f"rallypoint_{ident}/__init__.py" in files
        assert f'\nt-{kind} = "rallypoint_{ident}"\n' in (folder / "pyproject.toml").read_text()


def test_they_are_listed(generated: tuple[Path, Path], tmp_path: Path) -> None:
    _, site = generated
    result = CliRunner(cwd=tmp_path).run("plugins", pythonpath=[site])
    assert result.exit_code == 0, result.output
    for kind, label in KINDS.items():
        assert f"t-{kind}  [active]  rallypoint-t-{kind} 0.1.0\n" in result.stdout
        assert f"    {label}: t-{kind}\n" in result.stdout


def test_their_own_tests_pass(generated: tuple[Path, Path]) -> None:
    """Two pytest runs at once: the rendezvous store's tests mostly wait."""
    plugins, site = generated
    environment = clean_environment({"PYTHONPATH": str(site)})
    base = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    runs = {
        "rendezvous": subprocess.Popen(
            [*base, "-k", PROTOCOL_TESTS, "rallypoint-t-rendezvous"],
            cwd=plugins,
            env=environment,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        ),
        "others": subprocess.Popen(
            [*base, *(f"rallypoint-t-{kind}" for kind in KINDS if kind != "rendezvous")],
            cwd=plugins,
            env=environment,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        ),
    }
    for name, process in runs.items():
        try:
            output, _ = process.communicate(timeout=TIMEOUT)
        finally:
            process.kill()
        summary = output.strip().splitlines()[-1]
        assert process.returncode == 0, f"{name}:\n{output}"
        assert re.search(r"\d+ passed", summary), f"{name}:\n{output}"
        assert not re.search(r"failed|error", summary), f"{name}:\n{output}"


def test_a_taken_folder_or_a_bad_name_is_a_usage_error(tmp_path: Path) -> None:
    runner = CliRunner(cwd=tmp_path)
    assert runner.invoke("plugins", "new", "dup", "--kind", "rank-assigner").exit_code == 0
    again = runner.invoke("plugins", "new", "dup", "--kind", "rank-assigner")
    assert again.exit_code == 2
    assert "rallypoint-dup already exists: choose another NAME or --dir." in again.stderr
    bad = runner.invoke("plugins", "new", "Not OK", "--kind", "metrics-sink")
    assert bad.exit_code == 2 and "plugin name 'Not OK'" in bad.stderr
    kind = runner.invoke("plugins", "new", "fine", "--kind", "scheduler")
    assert kind.exit_code == 2 and "choose one of: rendezvous, restart-policy" in kind.stderr


def test_checkpoint_store_is_the_former_name_of_checkpoint_backend(tmp_path: Path) -> None:
    result = CliRunner(cwd=tmp_path).invoke("plugins", "new", "old", "--kind", "checkpoint-store")
    assert result.exit_code == 0, result.output
    assert "created rallypoint-old: a checkpoint backend plugin" in result.stdout
    assert (tmp_path / "rallypoint-old" / "rallypoint_old" / "storage.py").is_file()
