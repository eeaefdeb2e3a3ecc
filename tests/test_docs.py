"""The documentation matches the code: hooks, flags, option keys and code snippets."""

from __future__ import annotations

import inspect
import json
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import typer
import typer.main

from rallypoint import hookspecs
from rallypoint.events import RoundInfo, RunInfo, WorkerFailure
from rallypoint.plugins import PluginManager, build_plugin_manager, get_plugin_manager
from rallypoint.registry import METRICS_SINKS, RENDEZVOUS_BACKENDS, RESTART_POLICIES, Kind
from rallypoint.testing.helpers import CliRunner, fresh_plugin_manager, plugin_registered
from rallypoint_cli.main import build_app

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
HOOKS_MD = DOCS / "plugins" / "hooks.md"
USER_GUIDE = DOCS / "user-guide.md"
WRITING = DOCS / "plugins" / "writing.md"
#: Every page with python blocks; generated pages and the example plugin's README included.
PAGES_WITH_PYTHON = sorted(p for p in DOCS.rglob("*.md") if "```python" in p.read_text("utf-8"))

#: The distributions of this repository; third-party plugins installed here are not documented.
BUNDLED = {"rallypoint", "rallypoint-etcd", "rallypoint-redis", "rallypoint-prometheus"}

#: The extension points whose registrations declare `key=value` settings.
KINDS_WITH_OPTIONS: tuple[Kind[Any], ...] = (RENDEZVOUS_BACKENDS, RESTART_POLICIES, METRICS_SINKS)

_FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9_-]*[a-z0-9]")
_PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)


def hookspec_functions() -> list[Callable[..., Any]]:
    marker = f"{hookspecs.PROJECT_NAME}_spec"
    return [
        value
        for value in vars(hookspecs).values()
        if inspect.isfunction(value)
        and value.__module__ == hookspecs.__name__
        and hasattr(value, marker)
    ]


def signature_line(function: Callable[..., Any]) -> str:
    # hookspecs.py uses `from __future__ import annotations`: annotations are the source text.
    signature = str(inspect.signature(function)).replace("'", "")
    return f"def {function.__name__}{signature}:"


def _flags(command: Any) -> set[str]:
    """Every option spelling of a click command and of its subcommands, --help included."""
    flags: set[str] = set()
    for param in command.params:
        flags.update(getattr(param, "opts", ()))
        flags.update(getattr(param, "secondary_opts", ()))
    flags.update(command.get_help_option_names(command.context_class(command)))
    for sub in getattr(command, "commands", {}).values():
        flags |= _flags(sub)
    return {flag for flag in flags if flag.startswith("--")}


def _app() -> Any:
    return typer.main.get_command(build_app(build_plugin_manager({})))


def run_command_flags() -> set[str]:
    """Every option spelling `rallypoint run` accepts, --help included."""
    return _flags(_app().commands["run"])


def all_command_flags() -> set[str]:
    """Every option spelling of every `rallypoint` command."""
    return _flags(_app())


def python_blocks(path: Path) -> list[str]:
    return _PYTHON_BLOCK.findall(path.read_text(encoding="utf-8"))


def test_hookspecs_are_found() -> None:
    assert len(hookspec_functions()) >= 13


@pytest.mark.parametrize("function", hookspec_functions(), ids=lambda f: f.__name__)
def test_plugin_hooks_are_documented(function: Callable[..., Any]) -> None:
    text = HOOKS_MD.read_text(encoding="utf-8")
    assert f"\n## {function.__name__}\n" in text, f"no '## {function.__name__}' heading"
    assert signature_line(function) in text, f"signature of {function.__name__} differs"


def generator_check(script: str) -> None:
    """``docs/SCRIPT --check``: what it generates is what the pages hold."""
    result = subprocess.run(
        [sys.executable, str(DOCS / script), "--check"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_hook_reference_is_up_to_date() -> None:
    generator_check("gen_hook_reference.py")


def test_the_plugin_api_page_is_what_its_generator_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/plugins/api.md has one row per name of ``rallypoint.sdk.__all__``, in order, and
    is the page docs/gen_api_reference.py writes today (else: run it)."""
    from rallypoint import sdk

    monkeypatch.syspath_prepend(str(DOCS))
    import gen_api_reference

    page = gen_api_reference.OUTPUT.read_text(encoding="utf-8")
    assert re.findall(r"^\| `(\w+)` \|", page, re.MULTILINE) == list(sdk.__all__)
    assert page == gen_api_reference.render()


def test_the_event_tables_are_what_their_generator_writes() -> None:
    """The user guide's and checkpointing.md's event tables come from
    ``rallypoint.events.EVENTS`` (else: run docs/gen_event_tables.py)."""
    generator_check("gen_event_tables.py")


def test_user_guide_flags_exist() -> None:
    accepted = all_command_flags()
    mentioned = set(_FLAG.findall(USER_GUIDE.read_text(encoding="utf-8")))
    # Shortened flags (--nnode) are accepted as prefixes; the misspelling is the guide's
    # example of the error.
    prefixes = {flag for flag in mentioned if any(a.startswith(flag) for a in accepted)}
    unknown = sorted(mentioned - accepted - prefixes - {"--max-restars"})
    assert not unknown, f"docs/user-guide.md mentions flags no command has: {unknown}"


def test_every_run_flag_is_documented() -> None:
    """The reverse of the above: a flag added to `rallypoint run` needs a line in the guide."""
    mentioned = set(_FLAG.findall(USER_GUIDE.read_text(encoding="utf-8")))
    dashed = {flag for flag in run_command_flags() if "_" not in flag}
    missing = sorted(dashed - mentioned)
    assert not missing, f"flags of `rallypoint run` missing from docs/user-guide.md: {missing}"


def test_every_torchrun_flag_is_accepted() -> None:
    """Every option string of the installed torchrun's parser is one of `rallypoint run`'s."""
    from torch.distributed.run import get_args_parser

    theirs = {
        flag
        for action in get_args_parser()._actions
        for flag in action.option_strings
        if flag.startswith("--")
    }
    missing = sorted(theirs - run_command_flags())
    assert not missing, f"torchrun flags `rallypoint run` does not accept: {missing}"


def test_user_guide_documents_every_option_key() -> None:
    """Every --rdzv-conf, --restart-conf and --metrics-conf key installed here is in the guide."""
    registry = build_plugin_manager({}).registry
    text = USER_GUIDE.read_text(encoding="utf-8")
    missing = sorted(
        f"{kind.flag} {entry.item.name}: {option.name}"
        for kind in KINDS_WITH_OPTIONS
        for entry in registry.entries(kind)
        if entry.distribution in BUNDLED
        for option in entry.item.options
        if f"`{option.name}`" not in text
    )
    assert not missing, f"option keys missing from docs/user-guide.md: {missing}"


def _is_excerpt(source: str) -> bool:
    """A block opened by ``# path/of/file.py`` quotes part of that file (an indented method,
    say); the tests of that code check the quote against the file."""
    return bool(re.match(r"# [\w./-]+\.py\n", source))


def _is_signature(source: str) -> bool:
    """A hook's signature line in the hook reference."""
    return source.rstrip().endswith(":") and source.count("\n") == 1


@pytest.mark.parametrize("path", PAGES_WITH_PYTHON, ids=lambda p: p.relative_to(DOCS).as_posix())
def test_python_snippets_compile(path: Path) -> None:
    blocks = python_blocks(path)
    assert blocks, f"no python blocks in {path.name}"
    for number, source in enumerate(blocks, 1):
        if _is_excerpt(source):
            continue
        if _is_signature(source):  # give it a body
            source += "    ...\n"
        compile(source, f"{path.name}, python block {number}", "exec")


# --- the plugin author's pages: every python block runs ------------------------------------

#: The hook reference's examples assume its first line: `from rallypoint import hookimpl`.
PRELUDE = {HOOKS_MD: {"hookimpl": hookspecs.hookimpl}}

#: Arguments to call each lifecycle hook of a snippet with.
_RUN = RunInfo(run_id="docs", node_id="node-a", hostname="host-a")
_HOOK_ARGUMENTS: dict[str, dict[str, Any]] = {
    "on_agent_started": {"run": _RUN},
    "on_rendezvous_completed": {
        "run": _RUN,
        "round_info": RoundInfo(0, 0, 1, 2, "host-a", 29500, ("node-a",)),
    },
    "on_workers_started": {
        "run": _RUN,
        "round_info": RoundInfo(0, 0, 1, 2, "host-a", 29500, ("node-a",)),
        "pids": (101, 102),
    },
    "on_worker_failed": {
        "run": _RUN,
        "failure": WorkerFailure(local_rank=1, rank=1, pid=102, exit_code=None, signal="SIGKILL"),
    },
    "on_workers_restarted": {"run": _RUN, "restart_count": 1, "cause": "failure"},
    "on_scale_changed": {"run": _RUN, "old_nodes": 2, "new_nodes": 1},
    "on_agent_stopping": {"run": _RUN, "exit_code": 0, "reason": "all workers finished"},
}


@dataclass
class Snippet:
    page: Path
    number: int
    source: str

    @property
    def label(self) -> str:
        return f"{self.page.name}, python block {self.number}"


def snippets(*pages: Path) -> list[Snippet]:
    return [
        Snippet(page, number, source)
        for page in pages
        for number, source in enumerate(python_blocks(page), 1)
        if not _is_signature(source)
    ]


def _page_modules(page: Path) -> dict[str, str]:
    """Modules a page writes in full: a block opened by the docstring of distribution
    ``rallypoint-NAME`` is the module ``rallypoint_NAME``."""
    found = {}
    for source in python_blocks(page):
        match = re.match(r'"""(rallypoint-[\w-]+): ', source)
        if match:
            found[match.group(1).replace("-", "_")] = source
    return found


def _install_module(site: Path, module: str, source: str) -> None:
    """Install ``module`` as a plugin distribution found through its entry point."""
    (site / f"{module}.py").write_text(source)
    name = module.removeprefix("rallypoint_")
    info = site / f"{module}-0.1.0.dist-info"
    info.mkdir()
    distribution = module.replace("_", "-")
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {distribution}\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text(f"[rallypoint]\n{name} = {module}\n")


def _fixture_values(
    function: Callable[..., Any], stack: ExitStack, tmp_path: Path
) -> dict[str, Any]:
    """The fixtures of rallypoint's pytest plugin (and ``tmp_path``) a snippet's test asks
    for, made with the same helpers."""
    pm = stack.enter_context(_fresh_pm())
    values: dict[str, Any] = {
        "tmp_path": tmp_path,
        "rallypoint_pm": pm,
        "rallypoint_register": lambda plugin, name=None: stack.enter_context(
            plugin_registered(plugin, name, pm=pm)
        ),
        "rallypoint_runner": CliRunner(cwd=tmp_path),
    }
    wanted = inspect.signature(function).parameters
    unknown = sorted(set(wanted) - set(values))
    assert not unknown, f"{function.__name__} asks for fixtures the docs test lacks: {unknown}"
    return {name: values[name] for name in wanted}


@contextmanager
def _fresh_pm() -> Iterator[PluginManager]:
    yield fresh_plugin_manager()
    get_plugin_manager.cache_clear()


def _check_plugin(module: ModuleType, label: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Load a snippet that implements hooks as rallypoint loads a plugin, collect what it
    registers, and call its lifecycle hooks and commands."""
    if not any(hasattr(value, f"{hookspecs.PROJECT_NAME}_impl") for value in _members(module)):
        return
    pm = build_plugin_manager({"RALLYPOINT_LOAD_PLUGINS": ""})
    with plugin_registered(module, "snippet", pm=pm):
        info = pm.infos["snippet"]
        assert info.status == "active", f"{label}: {info.error}"
        for hook, arguments in _HOOK_ARGUMENTS.items():
            if hook in info.hooks:
                getattr(pm.hook, hook)(**arguments)
        if "register_commands" in info.hooks:
            app = typer.Typer()
            pm.hook.register_commands(app=app)
            command = typer.main.get_command(app)
            assert command.main(args=["--help"], standalone_mode=False) == 0
    capsys.readouterr()


def _members(module: ModuleType) -> list[Any]:
    members = list(vars(module).values())
    for value in list(members):
        if inspect.isclass(value) and value.__module__ == module.__name__:
            members.extend(vars(value).values())
    return members


@pytest.mark.parametrize("snippet", snippets(WRITING, HOOKS_MD), ids=lambda s: s.label)
def test_python_snippets_run(
    snippet: Snippet,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Each block runs as a module; one that implements hooks is loaded as a plugin, its
    registrations collected and its hooks called; its ``test_*`` functions are run. A block
    importing a module the page writes in full gets it installed as a plugin."""
    if _is_excerpt(snippet.source):
        pytest.skip("an excerpt of a source file, checked against that file by its tests")
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    for module_name, source in _page_modules(snippet.page).items():
        if re.search(rf"^(from|import) {module_name}\b", snippet.source, re.MULTILINE):
            _install_module(site, module_name, source)
            monkeypatch.delitem(sys.modules, module_name, raising=False)
    module = ModuleType(f"docs_snippet_{snippet.number}")
    module.__dict__.update(PRELUDE.get(snippet.page, {}))
    exec(compile(snippet.source, snippet.label, "exec"), module.__dict__)
    _check_plugin(module, snippet.label, capsys)
    tests = [
        value
        for name, value in vars(module).items()
        if name.startswith("test_") and inspect.isfunction(value)
    ]
    for number, test in enumerate(tests):
        workdir = tmp_path / f"test-{number}"
        workdir.mkdir()
        with ExitStack() as stack:
            test(**_fixture_values(test, stack, workdir))
    get_plugin_manager.cache_clear()


# --- docs/reliability.md (docs/gen_reliability.py) -----------------------------------------


def _fault_names() -> set[str]:
    """The first argument of every ``pytest.mark.fault(...)`` in tests/faults."""
    import ast

    names: set[str] = set()
    for path in (REPO / "tests" / "faults").glob("test_*.py"):
        for node in ast.walk(ast.parse(path.read_text("utf-8"))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "fault"
                and node.args
                and isinstance(node.args[0], ast.Constant)
            ):
                names.add(str(node.args[0].value))
    return names


def test_every_fault_of_the_suite_is_in_the_reliability_page() -> None:
    """docs/reliability.md is regenerated (make reliability) when a fault is added."""
    names = _fault_names()
    assert len(names) >= 20, names
    page = (DOCS / "reliability.md").read_text("utf-8")
    rows = {line.split(" | ")[0].removeprefix("| ") for line in page.splitlines()}
    missing = sorted(names - rows)
    assert not missing, f"faults missing from docs/reliability.md (run make reliability): {missing}"


def test_the_reliability_page_is_rendered_from_records(tmp_path: Path) -> None:
    records = tmp_path / "records.jsonl"
    base = {"notes": [], "line": 1, "seconds": None}
    rows = [
        {"fault": "Worker hang", "expected": "restarted", "backend": "any", "outcome": "passed",
         "test": "tests/faults/test_worker_faults.py::test_hang", "seconds": 6.25},
        {"fault": "Agent SIGKILL", "expected": "re-formed", "backend": "etcd", "outcome": "passed",
         "test": "tests/faults/test_agent_faults.py::test_kill[etcd]", "seconds": 4.0},
        {"fault": "Agent SIGKILL", "expected": "re-formed", "backend": "redis", "outcome": "failed",
         "test": "tests/faults/test_agent_faults.py::test_kill[redis]"},
    ]  # fmt: skip
    records.write_text("".join(json.dumps({**base, **row}) + "\n" for row in rows))
    output = tmp_path / "reliability.md"
    result = subprocess.run(
        [sys.executable, str(DOCS / "gen_reliability.py"), "--records", str(records),
         "--output", str(output)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    page = output.read_text()
    assert page.index("## Worker") < page.index("## Agent")
    assert "| Worker hang | restarted | ok, 6.2 s | n/a | n/a |" in page
    assert "| Agent SIGKILL | re-formed | n/a | ok, 4.0 s | **failed** |" in page
