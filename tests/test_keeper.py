"""The agent's side of its keeper (``rallypoint.agent.processes.keeper``) against a real keeper
process (``rallypoint.agent.processes.keeper_server``), in this process: what the agent's workers
rely on, without a rendezvous. The whole job's view: tests/faults/test_stray_processes.py."""

from __future__ import annotations

import ast
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from rallypoint.agent.processes import keeper as keeper_module
from rallypoint.agent.processes.keeper import BOOT, Keeper, KeeperGone, KeptProcess
from servers import wait_until


@pytest.fixture
def keeper() -> Iterator[Keeper]:
    kept = Keeper()
    try:
        yield kept
    finally:
        kept.close()


def _gone(pid: int) -> bool:
    return not os.path.exists(f"/proc/{pid}")


def test_a_worker_is_started_and_its_exit_reported(keeper: Keeper, tmp_path: Path) -> None:
    out = os.open(tmp_path / "out", os.O_WRONLY | os.O_CREAT)
    try:
        argv = ["sh", "-c", "echo to-out; echo to-err >&2; exit 3"]
        pid = keeper.spawn(argv, dict(os.environ), out, out)
    finally:
        os.close(out)
    assert KeptProcess(keeper, pid).wait(10) == 3
    assert (tmp_path / "out").read_text() == "to-out\nto-err\n"
    # An interpreter without the job's environment or site-packages, which imports the
    # keeper's modules from their folder.
    cmdline = Path(f"/proc/{keeper.process.pid}/cmdline").read_bytes().split(b"\0")
    assert cmdline[:5] == [sys.executable.encode(), b"-I", b"-S", b"-c", BOOT.encode()]


def test_a_program_that_cannot_be_executed_is_an_os_error(keeper: Keeper) -> None:
    with pytest.raises(FileNotFoundError):
        keeper.spawn(["/no/such/program"], {}, 1, 2)
    assert keeper.sweep() == 0  # nothing was left behind


def test_when_the_agent_goes_the_keeper_stops_everything_and_removes_what_it_owns(
    tmp_path: Path,
) -> None:
    owned = tmp_path / "memory"
    owned.mkdir()
    keeper = Keeper()
    pid = keeper.spawn(["sleep", "300"], dict(os.environ), 1, 2)
    keeper.own(str(owned))
    keeper.release()  # as the agent's death closes its end of the socket
    assert keeper.process.wait(10) == 0
    assert wait_until(lambda: _gone(pid), 10)
    assert not owned.exists()


def test_a_killed_keeper_is_gone_and_so_are_its_workers() -> None:
    keeper = Keeper()
    worker = KeptProcess(keeper, keeper.spawn(["sleep", "300"], dict(os.environ), 1, 2))
    keeper.process.send_signal(signal.SIGKILL)
    assert worker.wait(10) == -signal.SIGKILL
    with pytest.raises(KeeperGone, match="died \\(killed by SIGKILL\\)"):
        keeper.spawn(["true"], {}, 1, 2)
    # Its worker died with it (PR_SET_PDEATHSIG) and came to this process, a subreaper
    # too. Not sweep(): it would kill every child of this test process.
    assert wait_until(lambda: _reaped(worker.pid), 10)
    keeper.release()


def _reaped(pid: int) -> bool:
    try:
        return os.waitpid(pid, os.WNOHANG)[0] == pid
    except ChildProcessError:  # not yet handed to this process
        return False


def _imports(path: Path) -> tuple[set[str], set[str]]:
    """The top-level names of what ``path`` imports absolutely, and the siblings it
    imports relatively."""
    absolute: set[str] = set()
    siblings: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            absolute.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            absolute.add((node.module or "").split(".")[0])
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 1, f"{path.name}: an import from above its folder"
            found = [node.module] if node.module else [a.name for a in node.names]
            siblings.update(found)
    return absolute, siblings


def test_what_the_keeper_and_the_preloaded_interpreter_import_is_stdlib_only() -> None:
    """Both import their modules from their folder, without the package and without
    site-packages (``keeper_server``, ``zygote``): every module they reach imports the
    standard library and its siblings in that folder, nothing else."""
    folder = Path(str(keeper_module.__file__)).parent
    todo, seen = ["keeper_server", "zygote"], set()
    while todo:
        name = todo.pop()
        seen.add(name)
        absolute, siblings = _imports(folder / f"{name}.py")
        assert absolute <= set(sys.stdlib_module_names) | {"__future__"}, name
        todo.extend(siblings - seen)
    assert seen == {"keeper_server", "zygote", "wire", "framing", "subreaper"}
