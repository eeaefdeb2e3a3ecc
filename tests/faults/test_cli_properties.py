"""``rallypoint run``'s command line, property-based: any combination of flags either starts
the agent or ends as one line on stderr and exit code 2, never a traceback.

Every example runs the real CLI in this process (``rallypoint_cli.main.main``) and the real
agent's set-up (rendezvous handler, event bus, run directory), up to where the network
would begin: the stores' clients are replaced by ``OfflineStore`` and the agent's loop by
one that returns at once. A run of the whole file takes seconds.

The model: each flag has values that are valid and values that are not (with the flag the
error must name). A valid command line, delivered as ``--flag value``, ``--flag=value``,
``--flag_with_underscores`` or through ``RALLYPOINT_*`` / ``PET_*``, starts the agent; one
bad value among valid ones is exit code 2 with one line naming its flag; and any text at
all in any flag is one of the two, never a crash.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from fault_setups import Recovery
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from rallypoint.agent.statemachine import elastic
from rallypoint.config import LaunchConfig
from rallypoint_cli.main import main

#: Reproducible in CI: the same examples every run, nothing remembered between runs.
PROPERTY = settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

ELASTIC_BACKENDS = ("c10d", "etcd", "redis")


class OfflineStore:
    """Stands in for a store's network client: the CLI's checks end where the network
    would begin. Every operation answers as an empty store would."""

    hosting = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def add(self, key: str, amount: int) -> int:
        return amount

    def get(self, key: str) -> bytes | None:
        return None

    def get_many(self, keys: Any) -> list[bytes | None]:
        return [None for _ in keys]

    def set(self, key: str, value: bytes) -> None:
        pass

    def compare_set(self, key: str, expected: bytes | None, desired: bytes) -> bytes:
        return desired

    def wait(self, keys: Any, timeout: float) -> bool:
        return False

    def keep_alive(self, key: str, ttl: float) -> None:
        pass

    def alive(self, key: str, ttl: float) -> bool:
        return True

    def clone(self) -> OfflineStore:
        return self

    def close(self) -> None:
        pass


@dataclass
class Result:
    code: int
    stdout: str
    stderr: str
    config: LaunchConfig | None  # what the agent was started with, if it was


def invoke(args: list[str], env: dict[str, str] | None = None) -> Result:
    """``rallypoint run ARGS`` in this process, with only ``env``'s launcher variables."""
    import rallypoint.rendezvous.tcpstore as tcpstore
    import rallypoint_etcd.store as etcd_store
    import rallypoint_redis.store as redis_store

    started: list[LaunchConfig] = []

    def loop(agent: elastic.Agent) -> tuple[int, str]:
        started.append(agent.config)
        return 0, "checked the command line only"

    with pytest.MonkeyPatch.context() as patch:
        for name in list(os.environ):
            if name.startswith(("RALLYPOINT_", "PET_", "TORCHELASTIC_", "SLURM_", "REDIS_")):
                patch.delenv(name)
        for name, value in (env or {}).items():
            patch.setenv(name, value)
        patch.setattr(tcpstore, "TCPStoreClient", OfflineStore)
        patch.setattr(etcd_store, "EtcdStore", OfflineStore)
        patch.setattr(redis_store, "RedisStore", OfflineStore)
        patch.setattr(redis_store, "_probe", lambda store, retry_timeout: None)
        patch.setattr(elastic.Agent, "_loop", loop)
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(["run", *args])
    return Result(code, out.getvalue(), err.getvalue(), started[0] if started else None)


def assert_one_line_error(result: Result, *fragments: str) -> str:
    """Exit code 2 and one line on stderr, naming ``fragments``; the agent never started."""
    lines = result.stderr.strip().splitlines()
    assert result.code == 2, (result.code, result.stderr)
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("rallypoint: error: "), result.stderr
    assert "Traceback" not in result.stderr
    assert result.config is None
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


# --- the model of a command line ----------------------------------------------------------


@dataclass
class Flag:
    """``--name value``, and how it reaches the CLI."""

    name: str
    value: str
    how: str = "space"  # space, equals, underscore, RALLYPOINT, PET


@dataclass
class CommandLine:
    flags: list[Flag]
    script: str
    script_args: list[str] = field(default_factory=list)
    bad: str | None = None  # the flag the error must name; None: the line is valid

    def render(self) -> tuple[list[str], dict[str, str]]:
        args: list[str] = []
        env: dict[str, str] = {}
        for flag in self.flags:
            dest = flag.name.replace("-", "_")
            if flag.how in ("RALLYPOINT", "PET") and flag.value.strip():
                env[f"{flag.how}_{dest.upper()}"] = flag.value
            elif flag.how == "equals":
                args.append(f"--{flag.name}={flag.value}")
            elif flag.how == "underscore":
                args += [f"--{dest}", flag.value]
            else:
                args += [f"--{flag.name}", flag.value]
        return [*args, self.script, *self.script_args], env


HOW = st.sampled_from(["space", "equals", "underscore", "RALLYPOINT", "PET"])
NUMBER = st.floats(min_value=0.5, max_value=120, allow_nan=False).map(lambda x: f"{x:.3g}")


@st.composite
def rdzv_conf(draw: st.DrawFn, backend: str) -> str:
    """Valid --rdzv-conf for ``backend``: keys in any order, values within their bounds."""
    pairs: dict[str, str] = {}
    heartbeat = draw(st.floats(min_value=1, max_value=15).map(lambda x: round(x, 2)))
    keys = draw(st.sets(st.sampled_from(["join_timeout", "last_call_timeout", "close_timeout"])))
    for key in sorted(keys):
        pairs[key] = draw(NUMBER)
    ttl = {"etcd": "lease_ttl", "redis": "key_ttl"}.get(backend)
    if ttl and draw(st.booleans()):  # the liveness TTL must outlast two renewals
        pairs["heartbeat_timeout"] = f"{heartbeat:g}"
        pairs[ttl] = f"{heartbeat:g}"
    elif draw(st.booleans()):
        pairs["heartbeat_timeout"] = f"{heartbeat:g}"
    if draw(st.booleans()):
        pairs["retry_timeout"] = draw(st.sampled_from(["0", "5", "60"]))
    if backend == "redis" and draw(st.booleans()):
        pairs["db"] = draw(st.sampled_from(["0", "3"]))
    if backend in ("c10d", "static") and draw(st.booleans()):
        pairs["read_timeout"] = draw(NUMBER)
    items = [f"{k}={v}" for k, v in pairs.items()]
    twice = draw(st.sampled_from([None, *sorted(pairs)]))
    if twice is not None:  # a key given twice takes its last value (as in torchrun)
        items.insert(0, f"{twice}=999")
    spaced = draw(st.booleans())
    return (", " if spaced else ",").join(items)


ENDPOINTS = {
    "c10d": ["127.0.0.1:29400", "localhost", "127.0.0.1:31001"],
    "etcd": ["127.0.0.1:2379", "localhost", "http://127.0.0.1:2379,http://127.0.0.2:2379"],
    "redis": ["127.0.0.1:6379", "redis://127.0.0.1:6379/0", "redis://rdzv:pw@127.0.0.1:1/2"],
}


@st.composite
def valid_command_lines(draw: st.DrawFn, script: str) -> CommandLine:
    flags: list[Flag] = []

    def add(name: str, value: str) -> None:
        flags.append(Flag(name, value, draw(HOW)))

    backend = draw(st.sampled_from([*ELASTIC_BACKENDS, "static"]))
    add("rdzv-backend", draw(st.sampled_from([backend, backend.upper(), f" {backend} "])))
    if backend == "static":
        nodes = draw(st.integers(1, 4))
        add("nnodes", str(nodes))
        add("node-rank", str(draw(st.integers(0, nodes - 1))))
        if draw(st.booleans()):
            add("master-port", str(draw(st.integers(1024, 65535))))
    else:
        low = draw(st.integers(1, 4))
        high = draw(st.integers(low, 8))
        add("nnodes", draw(st.sampled_from([f"{low}:{high}", f" {low} : {high} "])))
        endpoint = draw(st.sampled_from(ENDPOINTS[backend]))
        if endpoint or backend != "c10d":
            add("rdzv-endpoint", endpoint)
        add("rdzv-id", draw(st.from_regex(r"[a-z0-9][a-z0-9._-]{0,20}", fullmatch=True)))
    conf = draw(rdzv_conf(backend))
    if conf:
        add("rdzv-conf", conf)
    add("nproc-per-node", draw(st.sampled_from(["1", "2", "8", " 3 ", "cpu", "CPU"])))
    optional: dict[str, st.SearchStrategy[str]] = {
        "max-restarts": st.integers(0, 100).map(str),
        "monitor-interval": st.sampled_from(["0.05", "1", "5"]),
        "role": st.sampled_from(["trainer", "default", "eval-2"]),
        "redirects": st.sampled_from(["0", "3", "0:1,1:2", " 1 "]),
        "tee": st.sampled_from(["0", "2", "1:3"]),
        "local-ranks-filter": st.sampled_from(["0", "0,1", "1, 3"]),
        "signals-to-handle": st.sampled_from(["SIGTERM", "sigterm,SIGUSR1"]),
        "shutdown-timeout": st.sampled_from(["0", "2.5", "30"]),
        "exit-barrier-timeout": st.sampled_from(["0", "10", "300"]),
        "watchdog-timeout": st.sampled_from(["0", "30", "2.5"]),
        "start-method": st.sampled_from(["spawn", "fork", "forkserver"]),
        "restart-policy": st.sampled_from(["max-restarts", "never", "backoff", "NEVER"]),
        "rank-assigner": st.sampled_from(["ordered", "sticky", "topology"]),
        "node-label": st.sampled_from(["rack=a", "zone=1,rack=b"]),
        "metrics": st.sampled_from(["log", " log , log "]),
    }
    for name in draw(st.lists(st.sampled_from(sorted(optional)), unique=True, max_size=6)):
        add(name, draw(optional[name]))
    script_args = draw(st.lists(st.sampled_from(["--lr", "0.1", "-x", "--nnodes", "9"])))
    return CommandLine(flags, script, script_args)


#: Values each flag must refuse, whatever else is on the command line.
BAD_VALUES: dict[str, list[str]] = {
    "nnodes": ["0", "3:2", "1:2:3", "a", "-1", ":2", "1:", "²", "1:²", "auto", "0:0"],
    "nproc-per-node": ["0", "-1", "many", "1.5", "²", "٣x", "0x10"],
    "rdzv-backend": ["zookeeper", "etcd3", "c10d,etcd", "static/"],
    "rdzv-conf": [
        "join_timeout",
        "=5",
        "no_such_key=1",
        "join_timeout=soon",
        "join_timeout=-5",
        "heartbeat_timeout=0",
        "join_timeout=nan",
        "join_timeout=inf",
        "last_call_timeout=-1e-9",
    ],
    "max-restarts": ["-1", "three", "1.5", "²", "1e3"],
    "monitor-interval": ["0", "-1", "soon", "nan", "inf", "-inf"],
    "shutdown-timeout": ["-1", "nan", "inf", "later"],
    "exit-barrier-timeout": ["-0.5", "nan", "inf", "never"],
    "watchdog-timeout": ["-1", "nan", "inf", "soon"],
    "master-port": ["70000", "-1", "http", "²"],
    "redirects": ["4", "0:9", "x", "1:", ":1", "²", "0:²"],
    "tee": ["7", "a:1", "-1"],
    "local-ranks-filter": ["a", "-1", "0,x", "²"],
    "signals-to-handle": ["SIGNOPE", "TERM", "SIG_DFL", "SIGTERM,KILL9"],
    "start-method": ["thread", ""],
    "restart-policy": ["sometimes"],
    "rank-assigner": ["random"],
    "metrics": ["statsd", "log,nope"],
    "node-label": ["rack", "=a"],
    "rdzv-id": ["a/b", "../up", "", " ", "a b", "tab\tid", "x" * 300],
}

#: The flag each one's errors name (some errors name a related flag).
NAMED = {"rdzv-id": "--rdzv-id"}


@st.composite
def invalid_command_lines(draw: st.DrawFn, script: str) -> CommandLine:
    """A valid command line with one flag's value replaced by one it must refuse."""
    line = draw(valid_command_lines(script))
    name = draw(st.sampled_from(sorted(BAD_VALUES)))
    value = draw(st.sampled_from(BAD_VALUES[name]))
    how = draw(HOW) if value.strip() else "space"  # an empty variable is an unset one
    if name == "rdzv-backend":
        # The backend's own flags would be checked against the wrong backend first.
        line.flags = [f for f in line.flags if f.name not in ("rdzv-conf", "rdzv-endpoint")]
    line.flags = [f for f in line.flags if f.name != name] + [Flag(name, value, how)]
    if name == "nnodes" and value == "auto":
        line.bad = "--nnodes auto"
    else:
        line.bad = NAMED.get(name, f"--{name}")
    return line


@pytest.fixture
def script(tmp_path: Path) -> str:
    path = tmp_path / "train.py"
    path.write_text("print('training')\n")
    return str(path)


@pytest.fixture(autouse=True)
def _quiet_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Whatever an example writes to the working directory lands in the test's own."""
    monkeypatch.chdir(tmp_path)
    yield


# --- the properties -------------------------------------------------------------------------


@pytest.mark.fault(
    "A valid command line, in any spelling (`--a-b`, `--a_b`, `RALLYPOINT_*`, `PET_*`)",
    expected="the agent starts with the values given",
)
@PROPERTY
@given(data=st.data())
def test_every_valid_command_line_starts_the_agent(
    script: str, data: st.DataObject, recovery: Recovery
) -> None:
    line = data.draw(valid_command_lines(script))
    args, env = line.render()
    result = invoke(args, env)
    assert result.code == 0, (args, env, result.stderr)
    assert "Traceback" not in result.stderr
    config = result.config
    assert config is not None
    assert config.training_script == script
    assert config.training_script_args == tuple(line.script_args)
    given_nodes = next(f.value for f in line.flags if f.name == "nnodes")
    low, _, high = given_nodes.partition(":")
    assert (config.min_nodes, config.max_nodes) == (int(low), int(high or low))


@pytest.mark.fault(
    "An invalid flag value among valid ones (property-based)",
    expected="exit code 2 and one line naming the flag; never a traceback",
)
@PROPERTY
@given(data=st.data())
def test_one_bad_value_is_one_line_naming_its_flag(
    script: str, data: st.DataObject, recovery: Recovery
) -> None:
    line = data.draw(invalid_command_lines(script))
    args, env = line.render()
    result = invoke(args, env)
    assert line.bad is not None
    assert_one_line_error(result, line.bad)


#: Any text: printable, control characters, other scripts' digits.
ANY_TEXT = st.text(st.characters(exclude_categories=["Cs"], exclude_characters="\x00"), max_size=12)
FREE_FLAGS = sorted(
    {*BAD_VALUES, "rdzv-endpoint", "role", "node-rank", "log-dir", "event-log", "checkpoint-dir"}
)


@pytest.mark.fault(
    "Arbitrary text in any flag (property-based)",
    expected="the agent starts, or exit code 2 and one line; never a traceback",
)
@PROPERTY
@given(
    backend=st.sampled_from([*ELASTIC_BACKENDS, "static"]),
    nodes=st.sampled_from(["1", "2", "1:3"]),
    values=st.dictionaries(st.sampled_from(FREE_FLAGS), ANY_TEXT, max_size=4),
)
@example(backend="etcd", nodes="2", values={"rdzv-endpoint": "u:p@h:1:2"})
@example(backend="redis", nodes="2", values={"rdzv-endpoint": "redis://u:p@h:99999"})
@example(backend="c10d", nodes="2", values={"rdzv-endpoint": "h:0"})
@example(backend="c10d", nodes="1:3", values={"rdzv-id": "../../x"})
def test_any_text_in_any_flag_never_crashes(
    script: str,
    tmp_path: Path,
    backend: str,
    nodes: str,
    values: dict[str, str],
    recovery: Recovery,
) -> None:
    flags = [Flag("rdzv-backend", backend), Flag("nnodes", nodes)]
    if backend != "static" and "rdzv-endpoint" not in values:
        flags.append(Flag("rdzv-endpoint", "127.0.0.1:1"))
    for name, value in values.items():
        if name in ("log-dir", "event-log", "checkpoint-dir"):
            value = str(tmp_path / "out" / value.replace("\x00", ""))
        flags.append(Flag(name, value))
    args, env = CommandLine(flags, script).render()
    result = invoke(args, env)
    if result.code != 0:
        assert_one_line_error(result)
    else:
        assert result.config is not None and "Traceback" not in result.stderr


# --- flags whose values are paths -----------------------------------------------------------


def test_a_missing_script_or_a_directory_is_one_line(tmp_path: Path) -> None:
    assert_one_line_error(invoke([str(tmp_path / "nope.py")]), "does not exist")
    assert_one_line_error(invoke([str(tmp_path)]), "training script", "is a directory")
    assert_one_line_error(invoke([]), "missing the training script")
    assert_one_line_error(invoke(["--no-python", str(tmp_path)]), "training program")
    assert_one_line_error(invoke(["--run-path", "train.py"]), "--run-path")
    assert_one_line_error(invoke(["-m", "--no-python", "pkg"]), "cannot be used together")


@pytest.mark.parametrize("flag", ["--event-log", "--log-dir"])
def test_an_unwritable_output_path_is_one_line(script: str, tmp_path: Path, flag: str) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    # A directory where a file is wanted, or a file where a directory is (or its parent).
    target = tmp_path if flag == "--event-log" else a_file
    assert_one_line_error(invoke([flag, str(target), script]), flag)
    assert_one_line_error(invoke([flag, str(a_file / "below"), script]), flag)


def test_env_defaults_and_their_precedence(script: str) -> None:
    """The command line wins over RALLYPOINT_*, which wins over PET_*."""
    env = {"PET_NNODES": "3:2", "RALLYPOINT_NNODES": "5:4"}
    assert_one_line_error(invoke([script], {"PET_NNODES": "3:2"}), "'3:2'")
    assert_one_line_error(invoke([script], env), "'5:4'")
    assert_one_line_error(invoke(["--nnodes", "7:6", script], env), "'7:6'")
    good = invoke(["--nnodes", "1", script], env)
    assert good.code == 0, good.stderr
    pet = invoke([script], {"PET_NPROC_PER_NODE": "3", "PET_MAX_RESTARTS": "4"})
    assert pet.config is not None
    assert (pet.config.nproc_per_node, pet.config.max_restarts) == (3, 4)


def test_rdzv_conf_bounds_are_checked_per_backend(script: str) -> None:
    """Cross-key limits that depend on the backend are usage errors before any connection."""
    base = ["--nnodes", "2", "--rdzv-id", "job"]
    etcd = invoke(
        [*base, "--rdzv-backend", "etcd", "--rdzv-endpoint", "127.0.0.1:2379",
         "--rdzv-conf", "heartbeat_timeout=30,lease_ttl=5", script]
    )  # fmt: skip
    assert_one_line_error(etcd, "lease_ttl=5")
    redis = invoke(
        [*base, "--rdzv-backend", "redis", "--rdzv-endpoint", "127.0.0.1:6379",
         "--rdzv-conf", "heartbeat_timeout=30,key_ttl=10", script]
    )  # fmt: skip
    assert_one_line_error(redis, "key_ttl=10")
    both = invoke(
        [*base, "--rdzv-backend", "etcd", "--rdzv-endpoint", "127.0.0.1:2379",
         "--rdzv-conf", "user=root", script]
    )  # fmt: skip
    assert_one_line_error(both, "user and password")


def test_a_secret_value_is_never_echoed_in_the_error(script: str) -> None:
    """A password that fails to parse, or a URL with one that fails to parse, is shown
    masked: the error line goes to logs and CI output."""
    for conf in ("password:hunter2", "password", "user=root,password hunter2"):
        result = invoke(
            ["--nnodes", "2", "--rdzv-backend", "etcd", "--rdzv-endpoint", "127.0.0.1:1",
             "--rdzv-conf", conf, script]
        )  # fmt: skip
        assert "hunter" not in result.stderr
        assert_one_line_error(result, "--rdzv-conf")
    c10d = invoke(
        ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "u:hunter2@h:1", script]
    )
    assert "hunter2" not in c10d.stderr
    assert_one_line_error(c10d, "--rdzv-endpoint 'u:***@h:1'")
    for endpoint in (
        "redis://u:hunter2@h:1/x",
        "rediss://u:hunter2@h:1/0?db=1",
        "memc://u:hunter2@h",
    ):
        result = invoke(
            ["--nnodes", "2", "--rdzv-backend", "redis", "--rdzv-endpoint", endpoint, script]
        )
        assert "hunter2" not in result.stderr
        assert_one_line_error(result, "--rdzv-endpoint")
    etcd = invoke(
        ["--nnodes", "2", "--rdzv-backend", "etcd", "--rdzv-endpoint", "https://u:hunter2@h:x",
         script]
    )  # fmt: skip
    assert "hunter2" not in etcd.stderr
    assert_one_line_error(etcd, "--rdzv-endpoint")


def test_nan_is_never_a_number(script: str) -> None:
    """float() accepts nan and inf; no timeout or interval may be either."""
    for flag in ("--monitor-interval", "--shutdown-timeout", "--exit-barrier-timeout"):
        for value in ("nan", "inf", "NaN", "-inf", "Infinity"):
            assert_one_line_error(invoke([flag, value, script]), flag)
    assert math.isnan(float("nan"))  # the reason this test exists


def test_errors_quote_what_was_typed_on_one_line(script: str) -> None:
    """A value with a line break or control characters is quoted (repr), so the error
    stays one line and the terminal is not told to do anything."""
    for args in (
        ["--nnodes", "2\n3"],
        ["--rdzv-backend", "a\nb"],
        ["--role", "x", "--bogus\nflag"],
        ["--redirects", "\x1b[2J"],
    ):
        line = assert_one_line_error(invoke([*args, script]))
        assert "\x1b" not in line
        assert re.search(r"\\n|\\x1b", line), line
