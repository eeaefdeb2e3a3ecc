"""The launch configuration: what ``rallypoint run`` was asked to do, decided once.

``LaunchConfig.from_flags`` parses the flags (``rallypoint.flags``, the one table of them),
decides what they leave open (the nodes of ``--nnodes auto``, the rendezvous of
``--standalone``, the workers of ``--nproc-per-node gpu``), looks up the plugins they name
with their options, and returns a fully typed ``LaunchConfig``, or raises a ``UsageError``
whose message is one sentence naming the flag and the fix. ``rallypoint.preflight`` then
checks this machine against it. Nothing after that has to validate user input again.

``RendezvousTarget.from_flags`` does the same for ``rallypoint rendezvous status`` and
``clear``: the rendezvous flags of ``run`` (``rallypoint.flags.RENDEZVOUS_FLAGS``), parsed
as ``run`` parses them.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shlex
import stat
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
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
from rallypoint.flags import (
    AUTO_NODES,
    parse_flags,
    parse_nnodes,
    parse_rendezvous_flags,
    split_list,
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
from rallypoint.worker import variables

logger = logging.getLogger(__name__)

#: torchrun's port of rank 0 when ``--master-port`` is not given (static rendezvous).
DEFAULT_MASTER_PORT = 29500
STANDALONE_ENDPOINT = "localhost:0"
#: Where ``--checkpoint-memory`` keeps a node's memory checkpoints: shared memory, so that
#: they outlive the worker that saved them.
SHARED_MEMORY = "/dev/shm"
#: torchrun's entry-point group for ``--logs-specs``.
LOGS_SPECS_GROUP = "torchrun.logs_specs"

#: The flags that reach no field of their own name, each with the fields ``from_flags``
#: decides from it. Every other flag is the field of its name: one in neither would be
#: dropped, so ``from_flags`` refuses it (``tests/test_flag_fields.py`` walks the table).
DECIDED_FLAGS: Mapping[str, tuple[str, ...]] = {
    "nnodes": ("min_nodes", "max_nodes"),
    "rdzv_backend": ("rendezvous",),
    "rdzv_conf": ("rendezvous", "notes", "job_token"),
    "restart_policy": ("restart",),
    "restart_conf": ("restart",),
    "rank_assigner": ("assigner",),
    "rank_conf": ("assigner",),
    "metrics": ("sinks",),
    "metrics_conf": ("sinks",),
    "metrics_port": ("sinks",),
}

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

    Field names follow torchrun's flags (``--nproc-per-node`` is ``nproc_per_node``); the
    defaults are the flags' own (``rallypoint.flags.FLAGS``), so no field has one here.
    ``redirects`` and ``tee`` map a local rank to 0 (none), 1 (stdout), 2 (stderr) or
    3 (both); the key ``-1`` applies to every rank not listed.
    """

    training_script: str
    rendezvous: Choice[RendezvousBackend]
    restart: Choice[RestartPolicy]
    assigner: Choice[RankAssigner]
    sinks: tuple[Choice[MetricsSink], ...]
    training_script_args: tuple[str, ...]
    min_nodes: int
    max_nodes: int
    nproc_per_node: int
    rdzv_endpoint: str
    rdzv_id: str
    standalone: bool
    max_restarts: int
    monitor_interval: float
    start_method: str
    role: str
    module: bool
    no_python: bool
    run_path: bool
    log_dir: str | None
    redirects: Mapping[int, int]
    tee: Mapping[int, int]
    local_ranks_filter: frozenset[int] | None
    node_rank: int
    master_addr: str
    master_port: int | None
    local_addr: str | None
    signals_to_handle: tuple[str, ...]
    shutdown_timeout: float
    exit_barrier_timeout: float
    node_labels: Mapping[str, str]
    checkpoint_dir: str | None
    event_log: str | None
    watchdog_timeout: float | None  # seconds without a progress signal; None: no watchdog
    #: Hang detection (``rallypoint.agent.monitoring.hangs``): ``auto`` or ``off``, the
    #: shortest deadline a rank is given, and how long a rank may be silent.
    hang_detection: str
    hang_floor: float
    hang_ceiling: float
    logs_specs: str | None  # a torchrun.logs_specs entry point
    event_log_handler: str  # torch's event handler names: null, console, ...
    duplicate_stdout_filters: tuple[str, ...]
    duplicate_stderr_filters: tuple[str, ...]
    numa_binding: str | None  # node, socket, exclusive or core-complex
    virtual_local_rank: bool
    #: Workers forked from an interpreter that imported torch and ``preload`` already
    #: (``rallypoint.agent.processes.warm``); ``--warm-start off``: each starts a fresh one.
    warm_start: bool
    preload: tuple[str, ...]
    #: ``--checkpoint-memory``: the bytes of shared memory a node's checkpoints may take
    #: (0: saves go straight to --checkpoint-dir), the newest copies kept there, and every
    #: how many memory saves the agent copies one to --checkpoint-dir.
    checkpoint_memory: int
    checkpoint_memory_keep: int
    checkpoint_persist_every: int
    #: ``--straggler-factor``: a node whose workers' CPU time per step is above this many
    #: times the median of the round's other nodes is named a straggler (0: never).
    straggler_factor: float
    #: What the agent tells the user once at start (a torch key with no effect here).
    notes: tuple[str, ...]
    #: The job's secret (``--rdzv-conf token_file=PATH`` or ``RALLYPOINT_JOB_TOKEN``): the
    #: agents authenticate each other's checkpoint transfers with it. Never printed.
    job_token: bytes | None = field(repr=False)

    @property
    def elastic(self) -> bool:
        """Whether the job may run on fewer nodes than its maximum (``--nnodes MIN:MAX``)."""
        return self.min_nodes != self.max_nodes

    @property
    def peer_memory(self) -> int | None:
        """The bytes of shared memory the peer tier (copies another node sends this one)
        may take: as many as the node's own memory checkpoints, in a job of several nodes
        (the only one where a peer can send); None where there is none."""
        return self.checkpoint_memory if self.checkpoint_memory and self.max_nodes > 1 else None

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
    def progress_reports(self) -> bool:
        """Whether workers count and report their progress: for hang detection or the
        watchdog (``rallypoint.worker.progress_sources``)."""
        return self.hang_detection != "off" or self.watchdog_timeout is not None

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
    def from_flags(cls, registry: Registry, **given: Any) -> LaunchConfig:
        """Parse and decide the flags of ``rallypoint run``.

        ``given`` are named like the command's parameters (``nnodes``, ``rdzv_backend``,
        ``rdzv_conf``, ``metrics``...) and hold what the user typed; one not given takes
        its default from ``rallypoint.flags.FLAGS``. This checks the flags against the
        installed plugins, not this machine: ``rallypoint.preflight`` does that.

        Raises:
            UsageError: one sentence naming the flag, the bad value and what is expected.
            TypeError: ``given`` names no flag, or a flag of the table reaches no field
                (a mistake in the code: see ``DECIDED_FLAGS``).
        """
        environ = os.environ  # read here only: the parser and the deciders are handed it
        flags = parse_flags(given, environ)
        fields = {field.name for field in dataclasses.fields(cls)}
        lost = sorted(name for name in flags if name not in fields and name not in DECIDED_FLAGS)
        if lost:
            raise TypeError(
                f"flags that reach no field of LaunchConfig: {', '.join(lost)}; give each a "
                "field, or name the fields decided from it in DECIDED_FLAGS"
            )
        shape = _shape(flags, environ)
        nproc_per_node = count_workers(flags["nproc_per_node"])
        rendezvous, notes = choose_rendezvous(registry, shape.backend, flags["rdzv_conf"])
        _check_rendezvous(rendezvous.item, shape)
        restart = _choose(
            registry,
            RESTART_POLICIES,
            flags["restart_policy"],
            flags["restart_conf"],
            "--restart-conf",
        )
        assigner = _choose(
            registry, RANK_ASSIGNERS, flags["rank_assigner"], flags["rank_conf"], "--rank-conf"
        )
        sinks = _choose_sinks(
            registry, flags["metrics"], flags["metrics_conf"], flags["metrics_port"]
        )
        if flags["checkpoint_dir"]:
            registry.check_checkpoint_dir(flags["checkpoint_dir"])
        decided = {
            "min_nodes": shape.min_nodes,
            "max_nodes": shape.max_nodes,
            "rdzv_endpoint": shape.endpoint,
            "rdzv_id": shape.run_id,
            "node_rank": shape.node_rank,
            "nproc_per_node": nproc_per_node,
            "rendezvous": rendezvous,
            "notes": notes,
            "restart": restart,
            "assigner": assigner,
            "sinks": sinks,
            "job_token": job_token(rendezvous.options, environ),
        }
        as_given = {name: value for name, value in flags.items() if name in fields}
        return cls(**{**as_given, **decided})


@dataclass(frozen=True)
class RendezvousTarget:
    """The job whose rendezvous ``rallypoint rendezvous status`` and ``clear`` look at,
    named by the rendezvous flags of ``rallypoint run``, with the same defaults."""

    rendezvous: Choice[RendezvousBackend]
    rdzv_endpoint: str
    rdzv_id: str
    #: The job's secret, as its agents take it: sealed records are read with it.
    job_token: bytes | None = field(repr=False)

    @classmethod
    def from_flags(cls, registry: Registry, **given: Any) -> RendezvousTarget:
        """Parse ``rdzv_backend``, ``rdzv_endpoint``, ``rdzv_id`` and ``rdzv_conf`` as
        ``LaunchConfig.from_flags`` does (one not given takes ``run``'s default).

        Raises:
            UsageError: a bad value, or no ``--rdzv-endpoint``: these commands read the
                job's store from outside it, so they must be told where it is.
            TypeError: ``given`` names no rendezvous flag.
        """
        environ = os.environ
        flags = parse_rendezvous_flags(given, environ)
        rendezvous, _ = choose_rendezvous(registry, flags["rdzv_backend"], flags["rdzv_conf"])
        name = rendezvous.name
        if not flags["rdzv_endpoint"] and rendezvous.item.given_ranks:
            # run's default: the store is at --master-addr:--master-port, which only the
            # job's nodes know (a job of one node keeps it in its agent's memory).
            raise UsageError(
                f"--rdzv-backend {name}: give --rdzv-endpoint MASTER_ADDR:MASTER_PORT of the "
                "job's node rank 0, which hosts its store, or the --rdzv-backend and "
                "--rdzv-endpoint the job was given."
            )
        if not flags["rdzv_endpoint"]:
            raise UsageError(
                f"--rdzv-endpoint is required with --rdzv-backend {name} "
                "(give host:port of the job's rendezvous store)."
            )
        token = job_token(rendezvous.options, environ)
        return cls(rendezvous, flags["rdzv_endpoint"], flags["rdzv_id"], token)


# --- what the flags leave to this machine -----------------------------------------------------


@dataclass(frozen=True)
class _Shape:
    """The nodes and the rendezvous, as ``--nnodes``, Slurm and ``--standalone`` decide them."""

    min_nodes: int
    max_nodes: int
    backend: str
    endpoint: str
    run_id: str
    node_rank: int


def _shape(flags: Mapping[str, Any], environ: Mapping[str, str]) -> _Shape:
    """``--nnodes`` (``auto``: the Slurm job's shape, which also fills in the rendezvous
    flags left at their defaults) and, as in torchrun, ``--standalone``: it, and a one-node
    static job given neither an endpoint nor a master port, run a local c10d rendezvous on a
    free port with a fresh run id."""
    rendezvous = {
        key: flags[key] for key in ("rdzv_backend", "rdzv_endpoint", "rdzv_id", "node_rank")
    }
    nodes = flags["nnodes"]
    if nodes == AUTO_NODES:
        nodes = parse_nnodes(apply_slurm(rendezvous, environ))
    low, high = nodes
    implicit = (
        rendezvous["rdzv_backend"] == "static"
        and not rendezvous["rdzv_endpoint"]
        and flags["master_port"] is None
        and high == 1
    )
    if flags["standalone"] and high > 1:
        given = f"{low}:{high}" if low != high else f"{high}"
        raise UsageError(
            f"--standalone runs a job of one node, but --nnodes {given} allows "
            f"{high}: leave out --standalone and give --rdzv-backend and "
            "--rdzv-endpoint for a job of several nodes."
        )
    if flags["standalone"] or implicit:
        rendezvous.update(
            rdzv_backend="c10d", rdzv_endpoint=STANDALONE_ENDPOINT, rdzv_id=str(uuid.uuid4())
        )
    return _Shape(
        low,
        high,
        rendezvous["rdzv_backend"],
        rendezvous["rdzv_endpoint"],
        rendezvous["rdzv_id"],
        rendezvous["node_rank"],
    )


def count_workers(value: int | str) -> int:
    """``--nproc-per-node`` as a number: torchrun's ``cpu``, ``gpu``, ``xpu`` and ``auto``
    counted on this machine."""
    if isinstance(value, int):
        return value
    if value == "cpu":
        return os.cpu_count() or 1
    devices = _accelerator_count(value)
    if devices:
        return devices
    if value == "auto":
        return os.cpu_count() or 1
    raise UsageError(f"--nproc-per-node {value!r}: no {value.upper()} devices found on this host.")


def _accelerator_count(kind: str) -> int:
    # Only these values need torch; importing it here keeps every other start-up light.
    import torch

    if kind in ("gpu", "auto") and torch.cuda.is_available():
        return int(torch.cuda.device_count())
    xpu = getattr(torch, "xpu", None)
    if kind in ("xpu", "auto") and xpu is not None and xpu.is_available():
        return int(xpu.device_count())
    return 0


# --- the job's secret -------------------------------------------------------------------------

#: The environment variable that may hold the job's secret (never a flag: ``ps`` shows those).
TOKEN_ENV = variables.JOB_TOKEN


#: A token shorter than this is said to be weak (a warning): 128 bits, if random.
GOOD_TOKEN_BYTES = 16


def job_token(options: Mapping[str, Any], environ: Mapping[str, str]) -> bytes | None:
    """The job's secret: the contents of ``token_file`` (surrounding whitespace dropped),
    else ``RALLYPOINT_JOB_TOKEN``; None when neither is given. A file that is missing,
    unreadable or empty, or an empty variable, is a usage error; a file that others may
    read, or a short token, is a warning (``rallypoint run`` reads the token once, so each
    is said once per agent)."""
    path = options.get("token_file")
    if path:
        where = f"--rdzv-conf token_file={path}"
        try:
            token = Path(path).read_bytes().strip()
            mode = os.stat(path).st_mode
        except FileNotFoundError:
            raise UsageError(f"{where}: no such file.") from None
        except OSError as error:
            raise UsageError(f"{where}: cannot read it ({error.strerror or error}).") from None
        if not token:
            raise UsageError(f"{where}: the file is empty; put the job's secret in it.")
        if mode & 0o044:
            who = "others" if mode & 0o004 else "its group"
            logger.warning(
                "%s is readable by %s (mode %04o): chmod 600 %s",
                where, who, stat.S_IMODE(mode), shlex.quote(str(path)),
            )  # fmt: skip
        _check_length(token, where)
        return token
    raw = environ.get(TOKEN_ENV)
    if raw is None:
        return None
    if not raw.strip():
        raise UsageError(f"{TOKEN_ENV} is set but empty: give the job's secret, or unset it.")
    token = raw.strip().encode()
    _check_length(token, TOKEN_ENV)
    return token


def _check_length(token: bytes, where: str) -> None:
    if len(token) < GOOD_TOKEN_BYTES:
        logger.warning(
            "%s: the job token is short (%d bytes) and may be guessed; make one of %d random "
            "bytes or more, e.g. with `head -c 32 /dev/urandom | base64`",
            where, len(token), GOOD_TOKEN_BYTES,
        )  # fmt: skip


# --- the plugins the flags choose, each looked up once ----------------------------------------


def _check_rendezvous(backend: RendezvousBackend, shape: _Shape) -> None:
    """What the chosen backend needs of the other flags."""
    if backend.endpoint_required and not shape.endpoint:
        raise UsageError(
            f"--rdzv-endpoint is required with --rdzv-backend {backend.name} "
            "(give host:port of the rendezvous service)."
        )
    if backend.given_ranks:
        _check_given_ranks(backend.name, shape.min_nodes, shape.max_nodes, shape.node_rank)


def _check_given_ranks(name: str, min_nodes: int, max_nodes: int, node_rank: int) -> None:
    if min_nodes != max_nodes:
        raise UsageError(
            f"--rdzv-backend {name} needs a fixed --nnodes N, not {min_nodes}:{max_nodes}; "
            "use c10d, etcd or redis for an elastic job."
        )
    if not 0 <= node_rank < max_nodes:
        raise UsageError(
            f"--node-rank {node_rank}: must be between 0 and {max_nodes - 1} for --nnodes {max_nodes}."
        )


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


# --- a plugin's key=value options -------------------------------------------------------------


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
