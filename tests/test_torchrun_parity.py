"""What real job scripts pass to torchrun works the same under ``rallypoint run``:
abbreviated long options, a directory or zip file as the script, ``python -m`` spellings,
``--standalone`` refused in one sentence where it cannot mean anything, and the address the
other nodes reach this one at. Measured side by side with torchrun where torchrun runs."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest

from launch import clean_environment, rallypoint, torchrun, worker
from rallypoint.errors import UsageError
from rallypoint.rendezvous.endpoints import node_address


def environments(stdout: str) -> list[dict[str, Any]]:
    """The workers' launcher variables printed by dump_env.py, by local rank."""
    rows = [json.loads(line[line.index("{") :]) for line in stdout.splitlines() if "{" in line]
    return sorted(rows, key=lambda row: int(row["LOCAL_RANK"]))


def one_line_error(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("rallypoint: error: ") and "Traceback" not in result.stderr
    return line.removeprefix("rallypoint: error: ")


def test_abbreviated_long_options_are_accepted_as_torchrun_accepts_them() -> None:
    line = ("--nnode", "1", "--nproc_per", "2", "--max-restart=1", "--monitor-int", "0.2")
    ours = rallypoint("run", *line, worker("dump_env.py"))
    theirs = torchrun(*line, worker("dump_env.py"))
    assert ours.returncode == theirs.returncode == 0, ours.stderr + theirs.stderr
    for rows in (environments(ours.stdout), environments(theirs.stdout)):
        assert [row["LOCAL_WORLD_SIZE"] for row in rows] == ["2", "2"]
        assert rows[0]["TORCHELASTIC_MAX_RESTARTS"] == "1"


def test_an_ambiguous_prefix_names_the_candidates() -> None:
    message = one_line_error(rallypoint("run", "--no", "1", worker("dump_env.py")))
    assert message == "ambiguous option --no: it could be --no-python, --node-label, --node-rank."


def test_a_misspelt_option_gets_the_likely_one() -> None:
    message = one_line_error(rallypoint("run", "--max-restars", "3", worker("dump_env.py")))
    assert message.startswith("no such option: --max-restars; did you mean --max-restarts?")


def test_the_script_s_own_options_are_left_alone(tmp_path: Path) -> None:
    """After the script, ``--nnode`` is the script's: not expanded, not refused."""
    script = tmp_path / "argv.py"
    script.write_text("import sys; print(sys.argv[1:])\n")
    result = rallypoint("run", "--nproc", "1", str(script), "--nnode", "--max")
    assert result.returncode == 0, result.stderr
    assert "['--nnode', '--max']" in result.stdout


@pytest.mark.parametrize("kind", ["directory", "zip"])
def test_a_directory_or_zip_with_main_runs_as_python_runs_it(tmp_path: Path, kind: str) -> None:
    # One write per line: torchrun's workers share its stdout, and print() writes its
    # words one by one when unbuffered, so two workers' words could interleave.
    main = "import os, sys; sys.stdout.write(f\"main of {os.environ['RANK']}\\n\")\n"
    if kind == "directory":
        target = tmp_path / "app"
        target.mkdir()
        (target / "__main__.py").write_text(main)
    else:
        target = tmp_path / "app.zip"
        with zipfile.ZipFile(target, "w") as archive:
            archive.writestr("__main__.py", main)
    ours = rallypoint("run", "--nproc-per-node", "2", str(target))
    theirs = torchrun("--nproc-per-node", "2", str(target))
    assert ours.returncode == theirs.returncode == 0, ours.stderr + theirs.stderr
    assert "main of 1" in ours.stdout and "main of 1" in theirs.stdout


def test_a_directory_without_main_is_one_line(tmp_path: Path) -> None:
    message = one_line_error(rallypoint("run", str(tmp_path)))
    assert message.endswith("is a directory without a __main__.py; name the script in it.")


def test_standalone_with_several_nodes_is_one_sentence() -> None:
    message = one_line_error(
        rallypoint("run", "--standalone", "--nnodes", "1:2", worker("dump_env.py"))
    )
    assert message.startswith("--standalone runs a job of one node, but --nnodes 1:2 allows 2")


@pytest.mark.parametrize("module", [("rallypoint", "run"), ("rallypoint.run",)])
def test_python_m_runs_the_launcher(module: tuple[str, ...]) -> None:
    result = subprocess.run(
        [sys.executable, "-m", *module, "--nproc-per-node", "2", worker("dump_env.py")],
        capture_output=True,
        text=True,
        env=clean_environment(),
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert [row["RANK"] for row in environments(result.stdout)] == ["0", "1"]


def test_python_m_rallypoint_run_reports_errors_as_the_command_does() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "rallypoint.run", "--nnodes", "3:2", "x.py"],
        capture_output=True,
        text=True,
        env=clean_environment(),
        timeout=60,
    )
    assert one_line_error(result).startswith("--nnodes '3:2': MIN must not exceed MAX")


# --- the address other nodes reach this one at --------------------------------------------


def names(monkeypatch: pytest.MonkeyPatch, hostname: str, fqdn: str, resolving: set[str]) -> None:
    def getaddrinfo(name: str, *args: object) -> list[object]:
        if name not in resolving:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.0.0.7", 0))]

    monkeypatch.setattr(socket, "gethostname", lambda: hostname)
    monkeypatch.setattr(socket, "getfqdn", lambda: fqdn)
    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)


def test_the_fully_qualified_name_as_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    names(monkeypatch, "node7", "node7.cluster.example", {"node7", "node7.cluster.example"})
    assert node_address(None, max_nodes=2) == "node7.cluster.example"
    assert node_address("10.1.2.3", max_nodes=2) == "10.1.2.3"


def test_a_localhost_alias_is_not_an_address_for_others(monkeypatch: pytest.MonkeyPatch) -> None:
    # /etc/hosts mapping the host name to 127.0.0.1 makes getfqdn() say "localhost".
    names(monkeypatch, "vm", "localhost", {"vm", "localhost"})
    assert node_address(None, max_nodes=2) == "vm"
    names(monkeypatch, "node7", "node7.cluster.example", {"node7"})
    assert node_address(None, max_nodes=2) == "node7"


def test_no_name_that_resolves_is_one_sentence(monkeypatch: pytest.MonkeyPatch) -> None:
    names(monkeypatch, "node7", "node7.cluster.example", set())
    with pytest.raises(UsageError) as raised:
        node_address(None, max_nodes=2)
    assert str(raised.value) == (
        "this host's name 'node7' does not resolve to an address (nor does "
        "'node7.cluster.example'), so other nodes could not reach it: give --local-addr "
        "with an address they can reach."
    )
    assert node_address(None, max_nodes=1) == "node7"  # nobody else needs to reach it
