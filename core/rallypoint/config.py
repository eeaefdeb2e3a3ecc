"""The launch configuration: torchrun's settings, parsed and checked once.

The CLI hands the raw flag values to ``LaunchConfig.from_flags``, which checks every one
against the installed plugins and returns a fully typed ``LaunchConfig``, or raises a
``UsageError`` whose message is one sentence naming the flag and the fix. Nothing after this
point has to validate user input again.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import signal
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, Generic, TypeVar

from rallypoint.errors import UsageError
from rallypoint.extensions import (
    ConfigOption,
    MetricsSink,
    RankAssigner,
    RendezvousBackend,
    RestartPolicy,
)
from rallypoint.registry import (
    METRICS_SINKS,
    RANK_ASSIGNERS,
    RENDEZVOUS_BACKENDS,
    RESTART_POLICIES,
    Kind,
    Registry,
)
from rallypoint.rendezvous import torch_keys
from rallypoint.slurm import apply_slurm
from rallypoint.worker import env

#: torchrun's defaults, kept so that a torchrun command line means the same here.
DEFAULT_MASTER_PORT = 29500
DEFAULT_SHUTDOWN_TIMEOUT = 30.0
DEFAULT_EXIT_BARRIER_TIMEOUT = 300.0
STANDALONE_ENDPOINT = "localhost:0"
#: Where ``--checkpoint-memory`` keeps a node's memory checkpoints: shared memory, so that
#: they outlive the worker that saved them.
SHARED_MEMORY = "/dev/shm"

_STD_VALUES = {0: "none", 1: "stdout", 2: "stderr", 3: "both"}

#: The registrations chosen by name with options of their own.
R = TypeVar("R", bound=RendezvousBackend | RestartPolicy | RankAssigner | MetricsSink)


@dataclass(frozen=True)
class Choice(Generic[R]):
    """A registration a flag chose, with its own options parsed (every declared key present)."""

    item: R
    options: Mapping[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.item.name


@dataclass(frozen=True)
class LaunchConfig:
    """Everything ``rallypoint run`` was asked to do, validated.

    Field names follow torchrun's flags (``--nproc-per-node`` is ``nproc_per_node``).
    ``redirects`` and ``tee`` map a local rank to 0 (none), 1 (stdout), 2 (stderr) or
    3 (both); the key ``-1`` applies to every rank not listed.
    """

    training_script: str
    rendezvous: Choice[RendezvousBackend]
    restart: Choice[RestartPolicy]
    assigner: Choice[RankAssigner]
    sinks: tuple[Choice[MetricsSink], ...] = ()
    training_script_args: tuple[str, ...] = ()
    min_nodes: int = 1
    max_nodes: int = 1
    nproc_per_node: int = 1
    rdzv_endpoint: str = ""
    rdzv_id: str = "none"
    standalone: bool = False
    max_restarts: int = 0
    monitor_interval: float = 0.1
    start_method: str = "spawn"
    role: str = "default"
    module: bool = False
    no_python: bool = False
    run_path: bool = False
    log_dir: str | None = None
    redirects: Mapping[int, int] = field(default_factory=dict)
    tee: Mapping[int, int] = field(default_factory=dict)
    local_ranks_filter: frozenset[int] | None = None
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    local_addr: str | None = None
    signals_to_handle: tuple[str, ...] = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT
    exit_barrier_timeout: float = DEFAULT_EXIT_BARRIER_TIMEOUT
    node_labels: Mapping[str, str] = field(default_factory=dict)
    checkpoint_dir: str | None = None
    event_log: str | None = None
    watchdog_timeout: float | None = None  # seconds without a heartbeat; None: no watchdog
    logs_specs: str | None = None  # a torchrun.logs_specs entry point
    event_log_handler: str = "null"  # torch's event handler names: null, console, ...
    duplicate_stdout_filters: tuple[str, ...] = ()
    duplicate_stderr_filters: tuple[str, ...] = ()
    numa_binding: str | None = None  # node, socket, exclusive or core-complex
    virtual_local_rank: bool = False
    #: Workers forked from an interpreter that imported torch and ``preload`` already
    #: (``rallypoint.agent.warm``); ``--warm-start off``: each starts a fresh one.
    warm_start: bool = True
    preload: tuple[str, ...] = ()
    #: ``--checkpoint-memory``: the bytes of shared memory a node's checkpoints may take
    #: (0: saves go straight to --checkpoint-dir), the newest copies kept there, and every
    #: how many memory saves the agent copies one to --checkpoint-dir.
    checkpoint_memory: int = 0
    checkpoint_memory_keep: int = 1
    checkpoint_persist_every: int = 10
    #: ``--straggler-factor``: a node whose workers' CPU time per step is above this many
    #: times the median of the round's other nodes is named a straggler (0: never).
    straggler_factor: float = 1.5
    #: What the agent tells the user once at start (a torch key with no effect here).
    notes: tuple[str, ...] = ()
    #: The job's secret (``--rdzv-conf token_file=PATH`` or ``RALLYPOINT_JOB_TOKEN``): the
    #: agents authenticate each other's checkpoint transfers with it. Never printed.
    job_token: bytes | None = field(default=None, repr=False)

    @property
    def elastic(self) -> bool:
        """Whether the job may run on fewer nodes than its maximum (``--nnodes MIN:MAX``)."""
        return self.min_nodes != self.max_nodes

    # The chosen names and options, read as torchrun's flags name them.
    @property
    def rdzv_backend(self) -> str:
        return self.rendezvous.name

    @property
    def rdzv_conf(self) -> Mapping[str, Any]:
        return self.rendezvous.options

    @property
    def restart_policy(self) -> str:
        return self.restart.name

    @property
    def restart_conf(self) -> Mapping[str, Any]:
        return self.restart.options

    @property
    def rank_assigner(self) -> str:
        return self.assigner.name

    @property
    def metrics(self) -> tuple[str, ...]:
        return tuple(sink.name for sink in self.sinks)

    @property
    def metrics_conf(self) -> Mapping[str, Any]:
        """Every chosen sink's options in one mapping (each sink has its own in ``sinks``)."""
        return {key: value for sink in self.sinks for key, value in sink.options.items()}

    @classmethod
    def from_flags(cls, registry: Registry, **flags: Any) -> LaunchConfig:
        """Parse and check the raw flag values of ``rallypoint run``.

        ``flags`` are named like torchrun's flags (``nnodes``, ``rdzv_backend``,
        ``rdzv_conf``, ``metrics``...); text-valued flags arrive as the user typed them.

        Raises:
            UsageError: one sentence naming the flag, the bad value and what is expected.
        """
        values = dict(flags)
        _parse_numbers(values)
        nnodes = str(values.pop("nnodes", "1:1"))
        if nnodes.strip().lower() == "auto":
            nnodes = apply_slurm(values, os.environ)
        min_nodes, max_nodes = parse_nnodes(nnodes)
        values["min_nodes"], values["max_nodes"] = min_nodes, max_nodes
        values["nproc_per_node"] = parse_nproc_per_node(str(values.get("nproc_per_node", "1")))
        check_run_id(str(values.get("rdzv_id", "none")))
        _choose_plugins(values, registry, nnodes)
        values["node_labels"] = parse_labels(values.get("node_labels") or ())
        values["redirects"] = parse_std_spec(str(values.get("redirects", "0")), "--redirects")
        values["tee"] = parse_std_spec(str(values.get("tee", "0")), "--tee")
        values["local_ranks_filter"] = parse_local_ranks(values.get("local_ranks_filter") or "")
        values["signals_to_handle"] = parse_signals(
            values.get("signals_to_handle") or "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
        )
        values["training_script_args"] = tuple(values.get("training_script_args") or ())
        _parse_torchrun_extras(values)
        values["job_token"] = job_token(values["rendezvous"].options, os.environ)
        _parse_warm_start(values)
        _parse_checkpoint_memory(values)
        if values.get("shutdown_timeout") is None:
            values["shutdown_timeout"] = float(
                os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", DEFAULT_SHUTDOWN_TIMEOUT)
            )
        _check_script(values)
        _check_outputs(values)
        return cls(**values)


# --- the job's secret -------------------------------------------------------------------------

#: The environment variable that may hold the job's secret (never a flag: ``ps`` shows those).
TOKEN_ENV = env.JOB_TOKEN


def job_token(options: Mapping[str, Any], environ: Mapping[str, str]) -> bytes | None:
    """The job's secret: the contents of ``token_file`` (surrounding whitespace dropped),
    else ``RALLYPOINT_JOB_TOKEN``; None when neither is given. A file that is missing,
    unreadable or empty, or an empty variable, is a usage error."""
    path = options.get("token_file")
    if path:
        where = f"--rdzv-conf token_file={path}"
        try:
            token = Path(path).read_bytes().strip()
        except FileNotFoundError:
            raise UsageError(f"{where}: no such file.") from None
        except OSError as error:
            raise UsageError(f"{where}: cannot read it ({error.strerror or error}).") from None
        if not token:
            raise UsageError(f"{where}: the file is empty; put the job's secret in it.")
        return token
    raw = environ.get(TOKEN_ENV)
    if raw is None:
        return None
    if not raw.strip():
        raise UsageError(f"{TOKEN_ENV} is set but empty: give the job's secret, or unset it.")
    return raw.strip().encode()


# --- the plugins the flags choose, each looked up once ----------------------------------------


def _choose_plugins(values: dict[str, Any], registry: Registry, nnodes: str) -> None:
    """Replace the flags that name plugins (and their ``-conf`` flags) in ``values`` with
    the chosen registrations and their parsed options."""
    _standalone(values, nnodes)
    values["rendezvous"], values["notes"] = choose_rendezvous(
        registry, values.pop("rdzv_backend", "static"), values.pop("rdzv_conf", None) or ""
    )
    backend = values["rendezvous"].item
    if backend.endpoint_required and not values.get("rdzv_endpoint"):
        raise UsageError(
            f"--rdzv-endpoint is required with --rdzv-backend {backend.name} "
            "(give host:port of the rendezvous service)."
        )
    if backend.name == "static":
        _check_static(values["min_nodes"], values["max_nodes"], values.get("node_rank", 0))
    values["restart"] = _choose(
        registry,
        RESTART_POLICIES,
        values.pop("restart_policy", "max-restarts"),
        values.pop("restart_conf", None) or "",
        "--restart-conf",
    )
    values["assigner"] = _choose(
        registry,
        RANK_ASSIGNERS,
        values.pop("rank_assigner", "ordered"),
        values.pop("rank_conf", None) or "",
        "--rank-conf",
    )
    values["sinks"] = _choose_sinks(
        registry,
        values.pop("metrics", None) or "",
        values.pop("metrics_conf", None) or "",
        values.pop("metrics_port", None),
    )
    if values.get("checkpoint_dir"):
        registry.check_checkpoint_dir(values["checkpoint_dir"])


def _standalone(values: dict[str, Any], nnodes: str) -> None:
    """As in torchrun: --standalone, and a one-node static job given neither an endpoint
    nor a master port, run a local c10d rendezvous on a free port with a fresh run id."""
    max_nodes = values["max_nodes"]
    implicit = (
        values.get("rdzv_backend", "static") == "static"
        and not values.get("rdzv_endpoint")
        and values.get("master_port") is None
        and max_nodes == 1
    )
    if values.get("standalone") and max_nodes > 1:
        raise UsageError(
            f"--standalone runs a job of one node, but --nnodes {nnodes.strip()} allows "
            f"{max_nodes}: leave out --standalone and give --rdzv-backend and "
            "--rdzv-endpoint for a job of several nodes."
        )
    if values.get("standalone") or implicit:
        values["rdzv_backend"] = "c10d"
        values["rdzv_endpoint"] = STANDALONE_ENDPOINT
        values["rdzv_id"] = str(uuid.uuid4())


def choose_rendezvous(
    registry: Registry, name: str, conf: str
) -> tuple[Choice[RendezvousBackend], tuple[str, ...]]:
    """The backend ``--rdzv-backend`` names with its ``--rdzv-conf`` parsed (torch's keys
    translated), and what to tell the user about torch keys that have no effect here."""
    backend = registry.get(RENDEZVOUS_BACKENDS, name)
    text, notes = torch_keys.translate(
        conf, {option.name for option in backend.options}, backend.torch_keys, backend.name
    )
    options = parse_options(text, backend.options, "--rdzv-conf", f"the {backend.name} backend")
    _validate(backend, options, "--rdzv-conf")
    return Choice(backend, options), notes


def _choose(registry: Registry, kind: Kind[R], name: str, conf: str, flag: str) -> Choice[R]:
    item = registry.get(kind, name)
    options = parse_options(conf, item.options, flag, f"the {item.name} {kind.label}")
    _validate(item, options, flag)
    return Choice(item, options)


def _choose_sinks(
    registry: Registry, names: str, conf: str, port: int | None
) -> tuple[Choice[MetricsSink], ...]:
    """The ``--metrics`` sinks, each with the ``--metrics-conf`` keys it declares;
    ``--metrics-port N`` sets the ``port`` of each sink that serves an endpoint."""
    sinks = {
        sink.name: sink for sink in (registry.get(METRICS_SINKS, n) for n in split_list(names))
    }
    declared = [option for sink in sinks.values() for option in sink.options]
    if port is not None and not any(option.name == "port" for option in declared):
        raise UsageError(
            f"--metrics-port {port}: none of the chosen --metrics sinks serves an endpoint; "
            "add one that does (--metrics prometheus)."
        )
    parse_options(conf, declared, "--metrics-conf", "the chosen --metrics sinks")  # every key
    chosen = []
    for sink in sinks.values():
        own = {option.name: option for option in sink.options}
        pairs = [pair for pair in split_list(conf) if pair.partition("=")[0].strip() in own]
        options = parse_options(",".join(pairs), sink.options, "--metrics-conf", sink.name)
        if port is not None and "port" in own:  # the flag wins over --metrics-conf port=
            try:  # the sink's own declaration of its port checks the flag's value
                options["port"] = own["port"].parse(str(port))
            except ValueError as error:
                raise UsageError(f"--metrics-port {port}: {error}.") from None
        _validate(sink, options, "--metrics-conf")
        chosen.append(Choice(sink, options))
    return tuple(chosen)


def _validate(item: R, options: Mapping[str, Any], flag: str) -> None:
    """A registration's own check across its options (``validate``), as a usage error."""
    if item.validate is None:
        return
    try:
        item.validate(options)
    except ValueError as error:
        raise UsageError(f"{flag} {error}") from None


# --- parsers, one per flag format -----------------------------------------------------------


def parse_nnodes(text: str) -> tuple[int, int]:
    """``"4"`` -> ``(4, 4)``; ``"1:4"`` -> ``(1, 4)``."""
    match = re.fullmatch(r"\s*([0-9]+)\s*(?::\s*([0-9]+)\s*)?", text)
    if not match:
        raise UsageError(
            f"--nnodes {text!r}: expected a number of nodes N, a range MIN:MAX, "
            "or auto (inside a Slurm job)."
        )
    low = int(match.group(1))
    high = int(match.group(2)) if match.group(2) is not None else low
    if low < 1:
        raise UsageError(f"--nnodes {text!r}: a job needs at least 1 node.")
    if low > high:
        raise UsageError(f"--nnodes {text!r}: MIN must not exceed MAX.")
    return low, high


def parse_nproc_per_node(text: str) -> int:
    """A positive number, or torchrun's ``cpu``, ``gpu``, ``xpu`` or ``auto``."""
    value = text.strip().lower()
    if _digits(value):
        count = int(value)
        if count < 1:
            raise UsageError(f"--nproc-per-node {text!r}: must be at least 1.")
        return count
    if value == "cpu":
        return os.cpu_count() or 1
    if value in ("gpu", "xpu", "auto"):
        devices = _accelerator_count(value)
        if devices:
            return devices
        if value == "auto":
            return os.cpu_count() or 1
        raise UsageError(
            f"--nproc-per-node {text!r}: no {value.upper()} devices found on this host."
        )
    raise UsageError(
        f"--nproc-per-node {text!r}: expected a whole number or one of auto, cpu, gpu, xpu."
    )


def _accelerator_count(kind: str) -> int:
    # Only these values need torch; importing it here keeps every other start-up light.
    import torch

    if kind in ("gpu", "auto") and torch.cuda.is_available():
        return int(torch.cuda.device_count())
    xpu = getattr(torch, "xpu", None)
    if kind in ("xpu", "auto") and xpu is not None and xpu.is_available():
        return int(xpu.device_count())
    return 0


def _digits(text: str) -> bool:
    """Whether ``text`` is a whole number in ASCII digits (``str.isdigit`` is true for "²",
    which ``int`` refuses)."""
    return text.isascii() and text.isdigit()


#: A run id names the job's keys in the store (``<prefix>/<run id>/...``) and its run
#: directories: no ``/`` (another job's namespace, or a path outside the directory), no
#: spaces or control characters.
_RUN_ID = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:@+=-]{0,127}")


def check_run_id(run_id: str) -> None:
    """Refuse a ``--rdzv-id`` that could reach into another job's keys or files."""
    if not _RUN_ID.fullmatch(run_id):
        raise UsageError(
            f"--rdzv-id {run_id!r}: use 1 to 128 letters, digits and . _ - : @ + =, "
            "starting with a letter, digit or _."
        )


def split_list(text: str) -> list[str]:
    """``"a, b,,c"`` -> ``["a", "b", "c"]``."""
    return [part.strip() for part in text.split(",") if part.strip()]


def parse_options(
    text: str, options: Sequence[ConfigOption], flag: str, owner: str
) -> dict[str, Any]:
    """Parse ``"k=v,k2=v2"`` against declared options; every declared key is in the result."""
    declared = {option.name: option for option in options}
    values = {option.name: option.default for option in options}
    for pair in split_list(text):
        key, sep, raw = pair.partition("=")
        key = key.strip()
        if not sep or not key:
            # "password:hunter2" is a secret with a typo: show the key only.
            secret = next((n for n, o in declared.items() if o.secret and key.startswith(n)), "")
            shown = f"{secret}***" if secret else pair
            raise UsageError(f"{flag} {shown!r}: expected KEY=VALUE pairs separated by commas.")
        if key not in declared:
            valid = ", ".join(sorted(declared)) or "none"
            raise UsageError(f"{flag} {key!r}: unknown key for {owner}. Valid keys: {valid}.")
        option = declared[key]
        try:
            values[key] = option.parse(raw)
        except ValueError as error:
            shown = "***" if option.secret else raw
            raise UsageError(f"{flag} {key}={shown!r}: {error}.") from None
    return values


def parse_labels(pairs: Iterable[str]) -> dict[str, str]:
    """``["rack=a", "zone=1"]`` (or ``"rack=a,zone=1"`` items) -> ``{"rack": "a", "zone": "1"}``."""
    labels: dict[str, str] = {}
    for item in pairs:
        for pair in split_list(item):
            key, sep, value = pair.partition("=")
            if not sep or not key.strip():
                raise UsageError(f"--node-label {pair!r}: expected KEY=VALUE.")
            labels[key.strip()] = value.strip()
    return labels


def parse_std_spec(text: str, flag: str) -> dict[int, int]:
    """torchrun's stream spec: ``"3"`` for every rank, or ``"0:1,1:2"`` per local rank."""
    value = text.strip()
    if _digits(value):
        return {-1: _std_value(value, flag, text)}
    spec: dict[int, int] = {}
    for pair in split_list(value):
        rank, sep, stream = pair.partition(":")
        if not sep or not _digits(rank.strip()):
            raise UsageError(
                f"{flag} {text!r}: expected 0-3 for every rank, or LOCAL_RANK:0-3 pairs like 0:1,1:2."
            )
        spec[int(rank)] = _std_value(stream.strip(), flag, text)
    return spec


def _std_value(value: str, flag: str, text: str) -> int:
    if _digits(value) and int(value) in _STD_VALUES:
        return int(value)
    raise UsageError(
        f"{flag} {text!r}: stream values are 0 (none), 1 (stdout), 2 (stderr), 3 (both)."
    )


def parse_local_ranks(text: str) -> frozenset[int] | None:
    """``"0,2"`` -> ``{0, 2}``; empty means every rank."""
    items = split_list(text)
    if not items:
        return None
    if not all(_digits(item) for item in items):
        raise UsageError(f"--local-ranks-filter {text!r}: expected local ranks like 0,1,2.")
    return frozenset(int(item) for item in items)


def parse_signals(text: str) -> tuple[str, ...]:
    """``"SIGTERM,SIGUSR1"`` -> names checked against this platform's signals."""
    names = tuple(name.upper() for name in split_list(text))
    for name in names:
        if not name.startswith("SIG") or not hasattr(signal, name) or name.startswith("SIG_"):
            raise UsageError(f"--signals-to-handle {text!r}: {name!r} is not a signal name.")
    return names


def parse_filters(text: str) -> tuple[str, ...]:
    """torchrun's ``--duplicate-*-filters``: comma-separated, ``,,`` for a comma in one."""
    items = text.replace(",,", "\0").split(",")
    return tuple(item.replace("\0", ",") for item in items if item)


#: torch 2.13's event handlers (``torch.distributed.elastic.events.handlers``).
EVENT_LOG_HANDLERS = ("console", "dynamic_rendezvous", "null")
#: torchrun's entry-point group for ``--logs-specs``.
LOGS_SPECS_GROUP = "torchrun.logs_specs"
#: torchrun's ``--numa-binding`` modes (``rallypoint.agent.numa`` binds by them).
NUMA_BINDINGS = ("node", "socket", "exclusive", "core-complex")


def check_logs_specs(name: str) -> None:
    """Refuse a ``--logs-specs`` name no installed distribution registers."""
    names = sorted(ep.name for ep in metadata.entry_points(group=LOGS_SPECS_GROUP))
    if name not in names:
        valid = ", ".join(names) if names else "none is installed"
        raise UsageError(
            f"--logs-specs {name!r}: no {LOGS_SPECS_GROUP} entry point of that name ({valid})."
        )


def _parse_torchrun_extras(values: dict[str, Any]) -> None:
    """``--logs-specs``, ``--event-log-handler``, ``--duplicate-*-filters``,
    ``--numa-binding`` and ``--virtual-local-rank``, with torchrun's meanings."""
    if values.get("logs_specs"):
        check_logs_specs(values["logs_specs"])
    handler = str(values.get("event_log_handler") or "null")
    if handler not in EVENT_LOG_HANDLERS:
        raise UsageError(
            f"--event-log-handler {handler!r}: choose one of {', '.join(EVENT_LOG_HANDLERS)}."
        )
    values["event_log_handler"] = handler
    for key in ("duplicate_stdout_filters", "duplicate_stderr_filters"):
        raw = values.get(key) or ()
        values[key] = raw if isinstance(raw, tuple) else parse_filters(str(raw))
    mode = values.get("numa_binding")
    if mode is not None and mode not in NUMA_BINDINGS:
        raise UsageError(f"--numa-binding {mode!r}: choose one of {', '.join(NUMA_BINDINGS)}.")
    if values.get("virtual_local_rank"):
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        devices = [d for d in (visible or "").split(",") if d.strip()]
        if visible is not None and len(devices) < values["nproc_per_node"]:
            raise UsageError(
                f"--virtual-local-rank: {values['nproc_per_node']} workers but "
                f"CUDA_VISIBLE_DEVICES={visible!r} names {len(devices)} devices; each worker "
                "sees the device of its local rank."
            )


_SWITCH = {"on": True, "true": True, "1": True, "off": False, "false": False, "0": False}


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)b?\s*$", re.IGNORECASE)


def parse_size(text: str, flag: str) -> int:
    """Bytes, from ``500MB``, ``2GB``, ``1.5GiB``, ``4G`` or a plain number of bytes."""
    match = _SIZE.match(text)
    if not match:
        raise UsageError(f"{flag} {text!r}: expected a size such as 512MB, 4GB or 2GiB.")
    number, unit, binary = float(match[1]), match[2].lower(), bool(match[3])
    power = "kmgt".index(unit) + 1 if unit else 0
    return int(number * (1024 if binary else 1000) ** power)


def _parse_checkpoint_memory(values: dict[str, Any]) -> None:
    """``--checkpoint-memory SIZE``: it must fit in this node's shared memory now."""
    for key in ("checkpoint_memory_keep", "checkpoint_persist_every"):
        if values.get(key) is None:
            values.pop(key, None)  # not given: the default
    raw = values.get("checkpoint_memory")
    if raw in (None, "", 0):
        values["checkpoint_memory"] = 0
        return
    size = raw if isinstance(raw, int) else parse_size(str(raw), "--checkpoint-memory")
    if size <= 0:
        raise UsageError(f"--checkpoint-memory {raw!r}: give a size above 0, or leave it out.")
    try:
        stats = os.statvfs(SHARED_MEMORY)
    except OSError as error:
        raise UsageError(
            f"--checkpoint-memory needs shared memory at {SHARED_MEMORY}, which this node "
            f"lacks ({error.strerror})."
        ) from None
    free, total = stats.f_bavail * stats.f_frsize, stats.f_blocks * stats.f_frsize
    if size > free:
        raise UsageError(
            f"--checkpoint-memory {raw}: needs {size / 1e9:.1f} GB of shared memory, and "
            f"{SHARED_MEMORY} has {free / 1e9:.1f} GB free of {total / 1e9:.1f} GB; give less, "
            "or a larger /dev/shm (docker run --shm-size, a Kubernetes emptyDir of medium "
            "Memory)."
        )
    values["checkpoint_memory"] = size


def _parse_warm_start(values: dict[str, Any]) -> None:
    """``--warm-start on|off`` and ``--preload MODULE[,MODULE]``."""
    raw = values.get("warm_start", True)
    if not isinstance(raw, bool):
        text = str(raw).strip().lower()
        if text not in _SWITCH:
            raise UsageError(f"--warm-start {raw!r}: choose on or off.")
        values["warm_start"] = _SWITCH[text]
    preload = values.get("preload") or ()
    if not isinstance(preload, tuple):
        preload = tuple(name.strip() for name in str(preload).split(",") if name.strip())
    for name in preload:
        if not all(part.isidentifier() for part in name.split(".")):
            raise UsageError(f"--preload {name!r}: expected a module name such as numpy.")
    values["preload"] = preload


# --- cross-field checks ----------------------------------------------------------------------


def _check_static(min_nodes: int, max_nodes: int, node_rank: int) -> None:
    if min_nodes != max_nodes:
        raise UsageError(
            f"--rdzv-backend static needs a fixed --nnodes N, not {min_nodes}:{max_nodes}; "
            "use c10d, etcd or redis for an elastic job."
        )
    if not 0 <= node_rank < max_nodes:
        raise UsageError(
            f"--node-rank {node_rank}: must be between 0 and {max_nodes - 1} for --nnodes {max_nodes}."
        )


#: Numeric flags: (field, flag, type, lowest value, whether the lowest value is excluded).
_NUMBERS: tuple[tuple[str, str, type, float, bool], ...] = (
    ("max_restarts", "--max-restarts", int, 0, False),
    ("node_rank", "--node-rank", int, 0, False),
    ("master_port", "--master-port", int, 0, False),
    ("metrics_port", "--metrics-port", int, 0, False),
    ("monitor_interval", "--monitor-interval", float, 0, True),
    ("shutdown_timeout", "--shutdown-timeout", float, 0, False),
    ("exit_barrier_timeout", "--exit-barrier-timeout", float, 0, False),
    ("watchdog_timeout", "--watchdog-timeout", float, 0, False),
    ("checkpoint_memory_keep", "--checkpoint-memory-keep", int, 1, False),
    ("checkpoint_persist_every", "--checkpoint-persist-every", int, 1, False),
    ("straggler_factor", "--straggler-factor", float, 0, False),
)


def _parse_numbers(values: dict[str, Any]) -> None:
    """Convert the numeric flags in ``values`` (text from the CLI, or numbers) in place."""
    for key, flag, kind, low, exclusive in _NUMBERS:
        raw = values.get(key)
        if raw is None:
            continue
        try:
            number = kind(str(raw).strip())
        except ValueError:
            what = "a whole number" if kind is int else "a number"
            raise UsageError(f"{flag} {raw!r}: expected {what}.") from None
        if not math.isfinite(number):  # float() reads "nan" and "inf"
            raise UsageError(f"{flag} {raw!r}: expected a finite number.")
        if number < low or (exclusive and number == low):
            bound = f"above {low:g}" if exclusive else f"at least {low:g}"
            raise UsageError(f"{flag} {raw!r}: must be {bound}.")
        values[key] = number
    if values.get("straggler_factor", 1.5) is None:
        values.pop("straggler_factor")  # not given: the default
    elif 0 < values.get("straggler_factor", 1.5) <= 1:
        raise UsageError(
            f"--straggler-factor {values['straggler_factor']:g}: must be above 1 (how many "
            "times slower than the others a straggler is), or 0 to name none."
        )
    if values.get("watchdog_timeout") == 0:
        values["watchdog_timeout"] = None  # 0 turns the watchdog off, like leaving it unset
    for key in ("master_port", "metrics_port"):
        port = values.get(key)
        if port is not None and port > 65535:
            flag = "--" + key.replace("_", "-")
            raise UsageError(f"{flag} {port}: must be between 0 and 65535.")
    if values.get("start_method", "spawn") not in ("spawn", "fork", "forkserver"):
        raise UsageError(
            f"--start-method {values['start_method']!r}: choose one of spawn, fork, forkserver."
        )


def _check_script(values: Mapping[str, Any]) -> None:
    script = values.get("training_script") or ""
    if not script:
        raise UsageError("missing the training script: rallypoint run [OPTIONS] SCRIPT [ARGS]...")
    if script.startswith("-"):
        # Options after the first unknown one are the script's; before it, this is a typo.
        raise UsageError(f"no such option: {script}. See 'rallypoint run --help'.")
    if values.get("module"):
        if values.get("no_python"):
            raise UsageError("-m/--module and --no-python cannot be used together.")
        return  # resolved by the worker's interpreter, as with `python -m`
    if values.get("run_path") and not os.path.isabs(script):
        raise UsageError(f"--run-path needs an absolute script path, not {script!r}.")
    if values.get("no_python") and not values.get("run_path"):
        if os.path.isfile(script) or shutil.which(script):
            return
        raise UsageError(f"training program {script!r} does not exist and is not on PATH.")
    if os.path.isdir(script):
        # python runs a directory (or a zip file) by its __main__.py, and so does torchrun.
        if os.path.isfile(os.path.join(script, "__main__.py")):
            return
        raise UsageError(
            f"training script {script!r} is a directory without a __main__.py; name the "
            "script in it."
        )
    if not os.path.isfile(script):
        raise UsageError(f"training script {script!r} does not exist.")


def _check_outputs(values: Mapping[str, Any]) -> None:
    """The files the agent will write: refused now, before it joins anything, when they
    cannot be (a directory where the event log should go, a file where a directory)."""
    for key, want_dir in (("event_log", False), ("log_dir", True)):
        path = values.get(key)
        if not path:
            continue
        flag = "--" + key.replace("_", "-")
        if not want_dir and os.path.isdir(path):
            raise UsageError(f"{flag} {path!r}: is a directory; name a file in it.")
        if want_dir and os.path.exists(path) and not os.path.isdir(path):
            raise UsageError(f"{flag} {path!r}: is a file; name a directory.")
        parent = os.path.dirname(os.path.abspath(path))
        while parent and not os.path.exists(parent):
            parent = os.path.dirname(parent)
        if parent and not os.path.isdir(parent):
            raise UsageError(f"{flag} {path!r}: {parent!r} is a file, not a directory.")
