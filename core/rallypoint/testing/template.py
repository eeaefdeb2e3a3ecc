"""A new plugin distribution from a template: ``rallypoint plugins new NAME --kind KIND``.

``write_plugin`` writes ``rallypoint-NAME/`` with a ``pyproject.toml`` (entry point in the
``rallypoint`` group), a README, the package ``rallypoint_NAME`` with one working
implementation of the chosen extension point, and tests that run the matching conformance
suite of ``rallypoint.testing``. As written, it installs and its tests pass; the author
then replaces the placeholder logic, and the tests say whether the result still keeps
rallypoint's contract.
"""

from __future__ import annotations

import re
from pathlib import Path
from string import Template

from rallypoint import __version__
from rallypoint.errors import UsageError

#: The kinds ``--kind`` accepts, and what each registers.
KINDS: dict[str, str] = {
    "rendezvous": "rendezvous backend",
    "restart-policy": "restart policy",
    "rank-assigner": "rank assigner",
    "checkpoint-store": "checkpoint backend",
    "metrics-sink": "metrics sink",
}

_NAME = re.compile(r"^[a-z][a-z0-9]*(?:[-_][a-z0-9]+)*$")


def _core_range() -> str:
    """The rallypoint versions a new plugin declares it works with: this minor series."""
    major, minor = (int(part) for part in __version__.split(".")[:2])
    return (
        f"rallypoint>={major}.{minor},<{major}.{minor + 1}"
        if major == 0
        else f"rallypoint>={major}.{minor},<{major + 1}"
    )


def check_name(name: str) -> str:
    """``name`` lower-cased; ``UsageError`` unless it can name a distribution and a module."""
    normalised = name.strip().lower()
    if not _NAME.match(normalised):
        raise UsageError(
            f"plugin name {name!r}: use lower-case letters and digits, words joined by '-' "
            "or '_', starting with a letter (for example: my-backend)"
        )
    return normalised


def plugin_files(name: str, kind: str) -> dict[str, str]:
    """The files of the new distribution, by path relative to its folder."""
    if kind not in KINDS:
        raise UsageError(f"--kind {kind!r}: choose one of: {', '.join(KINDS)}.")
    name = check_name(name)
    ident = name.replace("-", "_")
    values = {
        "name": name,
        "dist": f"rallypoint-{name}",
        "module": f"rallypoint_{ident}",
        "ident": ident,
        "scheme": name.replace("_", "-"),  # URL schemes have no '_'
        "cls": "".join(part.capitalize() for part in re.split(r"[-_]", name)),
        "label": KINDS[kind],
        "core": _core_range(),
    }
    module, code, tests, usage = _KIND_TEMPLATES[kind]
    return {
        "pyproject.toml": Template(_PYPROJECT).substitute(values),
        "README.md": Template(_README).substitute(values, usage=Template(usage).substitute(values)),
        f"{values['module']}/__init__.py": Template(module).substitute(values),
        f"{values['module']}/{_CODE_FILE[kind]}.py": Template(code).substitute(values),
        f"{values['module']}/py.typed": "",
        f"tests/test_{ident}.py": Template(tests).substitute(values),
    }


def write_plugin(name: str, kind: str, directory: str | Path = ".") -> Path:
    """Write the distribution ``rallypoint-NAME`` of ``kind`` under ``directory``; return
    its folder. An existing, non-empty folder is left alone (``UsageError``)."""
    files = plugin_files(name, kind)
    target = Path(directory) / f"rallypoint-{check_name(name)}"
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise UsageError(f"{target} already exists: choose another NAME or --dir.")
    for relative, text in files.items():
        path = target / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return target


_CODE_FILE = {
    "rendezvous": "store",
    "restart-policy": "policy",
    "rank-assigner": "assigner",
    "checkpoint-store": "storage",
    "metrics-sink": "sink",
}

_PYPROJECT = """\
[build-system]
requires = ["setuptools>=64"]
build-backend = "setuptools.build_meta"

[project]
name = "$dist"
version = "0.1.0"
description = "A $label for rallypoint"
readme = "README.md"
requires-python = ">=3.10"
dependencies = ["$core"]

[project.optional-dependencies]
test = ["pytest>=8"]

[project.entry-points.rallypoint]
$name = "$module"

[tool.setuptools]
packages = ["$module"]

[tool.setuptools.package-data]
$module = ["py.typed"]

[tool.pytest.ini_options]
testpaths = ["tests"]
"""

_README = """\
# $dist

A $label for [rallypoint](https://github.com/rallypoint/rallypoint), made with
`rallypoint plugins new $name`.

$usage

## Develop

```sh
pip install -e '.[test]'
rallypoint plugins          # lists "$name  [active]  $dist 0.1.0"
pytest                      # rallypoint's conformance suite for a $label, and yours
```

As generated, the plugin works and its tests pass. Replace the placeholder logic in
`$module/`, keep the tests passing, and add tests of your own. The conformance suite comes
with rallypoint (`rallypoint.testing`); see rallypoint's plugin tutorial.
"""

# --- restart policy -----------------------------------------------------------------------

_POLICY_INIT = '''\
"""$dist: the ``$name`` restart policy (``rallypoint run --restart-policy $name``)."""

from __future__ import annotations

from rallypoint import hookimpl
from rallypoint.extensions import RestartPolicy
from $module.policy import POLICY


@hookimpl
def register_restart_policies() -> list[RestartPolicy]:
    return [POLICY]
'''

_POLICY = '''\
"""The ``$name`` restart policy: restart after each failure, up to ``--max-restarts``."""

from __future__ import annotations

from rallypoint.extensions import ConfigOption, RestartDecision, RestartPolicy, RestartRequest

OPTIONS = (ConfigOption("delay", float, 0.0, "seconds to wait before each restart"),)


def decide(request: RestartRequest) -> RestartDecision:
    """Restart after ``delay`` seconds until ``--max-restarts`` restarts are used up.

    Keep it a pure function of ``request``: every node asks it, tests call it directly.
    """
    if request.restarts_done >= request.max_restarts:
        return RestartDecision(
            False, reason=f"all {request.max_restarts} restarts (--max-restarts) used up"
        )
    return RestartDecision(True, delay=request.options["delay"], reason="restarting")


POLICY = RestartPolicy(
    name="$name",
    description="restart after a delay, up to --max-restarts times",
    decide=decide,
    options=OPTIONS,
)
'''

_POLICY_TESTS = '''\
"""$dist against rallypoint's restart policy conformance suite."""

from __future__ import annotations

import pytest

from rallypoint.extensions import RestartPolicy
from rallypoint.plugins import PluginManager
from rallypoint.registry import RESTART_POLICIES
from rallypoint.testing.restart_policy_conformance import RestartPolicyConformance
from $module.policy import POLICY


class TestConformance(RestartPolicyConformance):
    @pytest.fixture
    def policy(self) -> RestartPolicy:
        return POLICY


def test_the_plugin_is_installed(rallypoint_pm: PluginManager) -> None:
    info = rallypoint_pm.infos["$name"]
    assert info.status == "active", info.error
    assert rallypoint_pm.registry.get(RESTART_POLICIES, "$name") is POLICY
'''

_POLICY_USAGE = """\
```sh
rallypoint run --restart-policy $name --restart-conf delay=5 --max-restarts 3 train.py
```"""

# --- rank assigner ------------------------------------------------------------------------

_ASSIGNER_INIT = '''\
"""$dist: the ``$name`` rank assigner (``rallypoint run --rank-assigner $name``)."""

from __future__ import annotations

from rallypoint import hookimpl
from rallypoint.extensions import RankAssigner
from $module.assigner import ASSIGNER


@hookimpl
def register_rank_assigners() -> list[RankAssigner]:
    return [ASSIGNER]
'''

_ASSIGNER = '''\
"""The ``$name`` rank assigner: group ranks in order of host, then node id."""

from __future__ import annotations

from collections.abc import Sequence

from rallypoint.extensions import NodeSpec, RankAssigner


def assign(nodes: Sequence[NodeSpec]) -> list[int]:
    """The group rank of each node, in the order given: each of 0..N-1 once.

    Every agent may compute it: use only the nodes (host, node id, labels, previous rank),
    never the clock, randomness or the order of a set.
    """
    order = sorted(range(len(nodes)), key=lambda i: (nodes[i].host, nodes[i].node_id))
    ranks = [0] * len(nodes)
    for rank, index in enumerate(order):
        ranks[index] = rank
    return ranks


ASSIGNER = RankAssigner(
    name="$name",
    description="group ranks in order of host, then node id",
    assign=assign,
)
'''

_ASSIGNER_TESTS = '''\
"""$dist against rallypoint's rank assigner conformance suite."""

from __future__ import annotations

import pytest

from rallypoint.extensions import RankAssigner
from rallypoint.plugins import PluginManager
from rallypoint.registry import RANK_ASSIGNERS
from rallypoint.testing.rank_assigner_conformance import RankAssignerConformance
from $module.assigner import ASSIGNER


class TestConformance(RankAssignerConformance):
    @pytest.fixture
    def assigner(self) -> RankAssigner:
        return ASSIGNER


def test_the_plugin_is_installed(rallypoint_pm: PluginManager) -> None:
    info = rallypoint_pm.infos["$name"]
    assert info.status == "active", info.error
    assert rallypoint_pm.registry.get(RANK_ASSIGNERS, "$name") is ASSIGNER
'''

_ASSIGNER_USAGE = """\
```sh
rallypoint run --nnodes 2:4 --rank-assigner $name --rdzv-endpoint head:29400 train.py
```"""

# --- metrics sink -------------------------------------------------------------------------

_SINK_INIT = '''\
"""$dist: the ``$name`` metrics sink (``rallypoint run --metrics $name``)."""

from __future__ import annotations

from rallypoint import hookimpl
from rallypoint.extensions import MetricsSink
from $module.sink import SINK


@hookimpl
def register_metrics_sinks() -> list[MetricsSink]:
    return [SINK]
'''

_SINK = '''\
"""The ``$name`` metrics sink: one line per event, appended to a file."""

from __future__ import annotations

import json
import threading
from typing import TextIO

from rallypoint.events import Event
from rallypoint.extensions import ConfigOption, MetricsSink, SinkContext

OPTIONS = (
    # Keys of all chosen sinks share --metrics-conf: prefix yours with the sink's name.
    ConfigOption("${ident}_path", str, "$name-events.txt", "the file to append events to"),
)


class Sink:
    """Receives every event of the run; must neither block the agent for long nor raise."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._file: TextIO | None = None

    def emit(self, event: Event) -> None:
        line = f"{event.wall_time:.3f} {event.name} {json.dumps(dict(event.data), default=str)}"
        with self._lock:
            if self._file is None:
                self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115
            self._file.write(line + "\\n")
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def create(context: SinkContext) -> Sink:
    return Sink(str(context.options["${ident}_path"]))


SINK = MetricsSink(
    name="$name",
    description="every event as a line in a file",
    create=create,
    options=OPTIONS,
)
'''

_SINK_TESTS = '''\
"""$dist against rallypoint's metrics sink conformance suite."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest

from rallypoint.extensions import MetricsSink
from rallypoint.plugins import PluginManager
from rallypoint.registry import METRICS_SINKS
from rallypoint.testing.metrics_sink_conformance import MetricsSinkConformance
from $module.sink import SINK


class TestConformance(MetricsSinkConformance):
    @pytest.fixture
    def sink(self) -> MetricsSink:
        return SINK

    @pytest.fixture
    def options(self, tmp_path: Path) -> Mapping[str, Any]:
        return {"${ident}_path": str(tmp_path / "events.txt")}

    @pytest.fixture
    def check_sink(self) -> Callable[[Mapping[str, Any]], None]:
        def check(options: Mapping[str, Any]) -> None:
            lines = Path(options["${ident}_path"]).read_text().splitlines()
            assert "agent_stopping" in {line.split()[1] for line in lines}

        return check

    @pytest.fixture
    def idempotent_close(self) -> bool:
        return True


def test_the_plugin_is_installed(rallypoint_pm: PluginManager) -> None:
    info = rallypoint_pm.infos["$name"]
    assert info.status == "active", info.error
    assert rallypoint_pm.registry.get(METRICS_SINKS, "$name") is SINK
'''

_SINK_USAGE = """\
```sh
rallypoint run --metrics $name --metrics-conf ${ident}_path=events.txt train.py
```"""

# --- checkpoint backend ---------------------------------------------------------------------

_STORE_INIT = '''\
"""$dist: the ``$name`` checkpoint backend (``rallypoint run --checkpoint-dir $scheme://...``)."""

from __future__ import annotations

from rallypoint import hookimpl
from rallypoint.checkpoint.storage import CheckpointStorage
from rallypoint.extensions import CheckpointBackend


def open_storage(url: str) -> CheckpointStorage:
    # Imported here, in the workers, only when a run uses this store.
    from $module.storage import ${cls}Storage

    return ${cls}Storage(url)


@hookimpl
def register_checkpoint_backends() -> list[CheckpointBackend]:
    return [
        CheckpointBackend(
            "$name",
            "checkpoints in a directory, under $scheme:// URLs",
            schemes=("$scheme",),
            open=open_storage,
        )
    ]
'''

_STORAGE = '''\
"""``${cls}Storage``: checkpoints under ``$scheme:///a/directory``.

A placeholder that keeps objects in a local directory; replace the four operations with
calls to your service. rallypoint builds its checkpoint format (manifest, checksums,
rotation, fallback to an older checkpoint) on these four.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO
from urllib.parse import urlparse

_PARTIAL = ".partial-"


class ${cls}Storage:
    def __init__(self, url: str) -> None:
        self.url = url
        self.root = Path(urlparse(url).path)
        self.root.mkdir(parents=True, exist_ok=True)

    @contextlib.contextmanager
    def writer(self, name: str) -> Iterator[BinaryIO]:
        """The object appears whole when the block ends, and not at all if it raises."""
        target = self.root / name
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(f"{_PARTIAL}{target.name}-{uuid.uuid4().hex}")
        try:
            with open(partial, "wb") as handle:
                yield handle
            os.replace(partial, target)
        finally:
            partial.unlink(missing_ok=True)

    @contextlib.contextmanager
    def reader(self, name: str) -> Iterator[BinaryIO]:
        with open(self.root / name, "rb") as handle:  # FileNotFoundError when absent
            yield handle

    def names(self) -> list[str]:
        """Every complete object, never one being written."""
        return sorted(
            path.relative_to(self.root).as_posix()
            for path in self.root.rglob("*")
            if path.is_file() and not path.name.startswith(_PARTIAL)
        )

    def delete(self, name: str) -> None:
        """Remove ``name`` and everything under ``name/``."""
        path = self.root / name
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
'''

_STORAGE_TESTS = '''\
"""$dist against rallypoint's checkpoint backend conformance suite."""

from __future__ import annotations

from pathlib import Path

import pytest

from rallypoint.plugins import PluginManager
from rallypoint.testing.checkpoint_storage_conformance import (
    CheckpointStorageConformance,
    OpenStorage,
)
from $module.storage import ${cls}Storage


class TestConformance(CheckpointStorageConformance):
    @pytest.fixture
    def open_storage(self, tmp_path: Path) -> OpenStorage:
        return lambda: ${cls}Storage(f"$scheme://{tmp_path}/checkpoints")


def test_the_plugin_serves_its_scheme(rallypoint_pm: PluginManager) -> None:
    info = rallypoint_pm.infos["$name"]
    assert info.status == "active", info.error
    assert rallypoint_pm.registry.checkpoint_backend_for("$scheme:///ckpt").name == "$name"
'''

_STORAGE_USAGE = """\
```sh
rallypoint run --checkpoint-dir $scheme:///shared/checkpoints/run42 train.py
```"""

# --- rendezvous backend -------------------------------------------------------------------

_RDZV_INIT = '''\
"""$dist: the ``$name`` rendezvous backend (``rallypoint run --rdzv-backend $name``)."""

from __future__ import annotations

from rallypoint import hookimpl
from rallypoint.extensions import (
    COMMON_RENDEZVOUS_OPTIONS,
    ConfigOption,
    RendezvousBackend,
    RendezvousRequest,
)
from rallypoint.rendezvous.store import CoordinationStore


def connect(request: RendezvousRequest) -> CoordinationStore:
    # Imported here, only when a run uses this backend: so is your client library.
    from $module.store import ${cls}Store

    return ${cls}Store(request.endpoint)


@hookimpl
def register_rendezvous_backends() -> list[RendezvousBackend]:
    return [
        RendezvousBackend(
            name="$name",
            description="rendezvous through the $name service",
            options=(
                *COMMON_RENDEZVOUS_OPTIONS,
                ConfigOption("prefix", str, "/rallypoint", "key prefix; the run id is appended"),
            ),
            connect=connect,
        )
    ]
'''

_RDZV_STORE = '''\
"""``${cls}Store``: the coordination store rallypoint runs its rendezvous protocol on.

A placeholder: it keeps the keys in this process's memory (rallypoint's ``MemoryStore``),
so the conformance tests pass as generated, but agents on other hosts cannot meet through
it. Replace each operation with calls to your service, keeping the promise in its
docstring; raise ``StoreUnavailable`` when the service cannot be reached and ``StoreError``
for anything else, never your client library's exceptions.
"""

from __future__ import annotations

from collections.abc import Sequence

from rallypoint.rendezvous.memory import MemoryStore


class ${cls}Store:
    def __init__(self, endpoint: str, _memory: MemoryStore | None = None) -> None:
        self.endpoint = endpoint
        self._memory = _memory or MemoryStore()  # replace: a client of your service

    def add(self, key: str, amount: int) -> int:
        """Atomically add ``amount`` to the integer at ``key`` (0 if absent); the sum."""
        return self._memory.add(key, amount)

    def add_and_get(self, key: str, amount: int, other: str) -> tuple[int, bytes | None]:
        """``add(key, amount)`` and ``get(other)``, in one request where the service
        allows (a transaction, a script)."""
        return self._memory.add_and_get(key, amount, other)

    def get(self, key: str) -> bytes | None:
        """The value, ``None`` if absent; never blocks."""
        return self._memory.get(key)

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """The values in order, in as few requests as the service allows."""
        return self._memory.get_many(keys)

    def set(self, key: str, value: bytes) -> None:
        self._memory.set(key, value)

    def compare_set(self, key: str, expected: bytes | None, desired: bytes) -> bytes:
        """Atomically set ``desired`` if ``key`` holds ``expected`` (``None``: absent);
        return what ``key`` holds afterwards (``b""`` if absent)."""
        return self._memory.compare_set(key, expected, desired)

    def wait(self, keys: Sequence[str], timeout: float) -> bool:
        """Block until every key exists, woken by the service (a watch), never a sleep
        loop; ``False`` after ``timeout`` seconds."""
        return self._memory.wait(keys, timeout)

    def wait_value(self, key: str, timeout: float) -> bytes | None:
        """``wait`` for one key, answering its value (``None`` after ``timeout``); answer
        from the notification when it carries the value (a watch event, a message)."""
        return self._memory.wait_value(key, timeout)

    def keep_alive(self, key: str, ttl: float) -> None:
        """This node is alive for ``ttl`` more seconds (a lease, a key TTL)."""
        self._memory.keep_alive(key, ttl)

    def alive(self, key: str, ttl: float) -> bool:
        """Whether ``key``'s owner called ``keep_alive`` within ``ttl`` seconds."""
        return self._memory.alive(key, ttl)

    def delete_prefix(self, prefix: str) -> int:
        """Delete every key under ``prefix`` (a finished run's keys); how many there were."""
        return self._memory.delete_prefix(prefix)

    def clone(self) -> ${cls}Store:
        """A second connection to the same service, for another thread."""
        return ${cls}Store(self.endpoint, self._memory.clone())

    def close(self) -> None:
        """Release the connection; the keys kept alive through it die now (revoke the
        lease, delete the key), so the other nodes see this one leave at once."""
        self._memory.close()
'''

_RDZV_TESTS = '''\
"""$dist against rallypoint's rendezvous store conformance suite.

Point ``connect`` at a real server of your service, started by a fixture on a free port
(and give ``outage`` to check that agents ride out a restart of it)."""

from __future__ import annotations

import pytest

from rallypoint.plugins import PluginManager
from rallypoint.registry import RENDEZVOUS_BACKENDS
from rallypoint.testing.store_conformance import Connect, StoreConformance
from $module.store import ${cls}Store


class TestConformance(StoreConformance):
    @pytest.fixture
    def connect(self) -> Connect:
        store = ${cls}Store("localhost:1234")
        return store.clone


def test_the_plugin_is_installed(rallypoint_pm: PluginManager) -> None:
    info = rallypoint_pm.infos["$name"]
    assert info.status == "active", info.error
    assert rallypoint_pm.registry.get(RENDEZVOUS_BACKENDS, "$name").connect is not None
'''

_RDZV_USAGE = """\
```sh
rallypoint run --nnodes 2:4 --rdzv-backend $name --rdzv-endpoint HOST:PORT --rdzv-id job1 train.py
```"""

_KIND_TEMPLATES: dict[str, tuple[str, str, str, str]] = {
    "rendezvous": (_RDZV_INIT, _RDZV_STORE, _RDZV_TESTS, _RDZV_USAGE),
    "restart-policy": (_POLICY_INIT, _POLICY, _POLICY_TESTS, _POLICY_USAGE),
    "rank-assigner": (_ASSIGNER_INIT, _ASSIGNER, _ASSIGNER_TESTS, _ASSIGNER_USAGE),
    "checkpoint-store": (_STORE_INIT, _STORAGE, _STORAGE_TESTS, _STORAGE_USAGE),
    "metrics-sink": (_SINK_INIT, _SINK, _SINK_TESTS, _SINK_USAGE),
}
