"""The named implementations plugins register, one dataclass per extension point.

A plugin yields instances of these from its ``register_*`` hooks (see
``rallypoint.hookspecs``). Names are normalised (stripped, lower-cased) and must look like
``max-restarts`` or ``my_backend.v2``; a registration that breaks these rules marks its
plugin as broken instead of taking the CLI down.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from rallypoint.events import Event, RunInfo, WorkerFailure
from rallypoint.interfaces import CheckpointStorage, CoordinationStore, RendezvousHandler

_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]*$")
#: How every on/off value is spelt: a ``bool`` option's and ``rallypoint run``'s alike.
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def parse_bool(text: str) -> bool:
    """``text`` (any case, spaces around it ignored) as on or off; ``ValueError`` if neither."""
    word = text.strip().lower()
    if word in _TRUE:
        return True
    if word in _FALSE:
        return False
    raise ValueError("expected true or false")


def normalise_name(name: str) -> str:
    """Return ``name`` stripped and lower-cased; raise ``ValueError`` if it is not a valid name."""
    normalised = name.strip().lower()
    if not _NAME.match(normalised):
        raise ValueError(
            f"invalid name {name!r}: use letters, digits, '-', '_' and '.', starting with a letter or digit"
        )
    return normalised


# --- configuration options ----------------------------------------------------------------


_OPTION_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass(frozen=True)
class ConfigOption:
    """One ``key=value`` setting an implementation accepts (``--rdzv-conf``, ``--metrics-conf``...).

    Declaring options lets the CLI reject an unknown key or a malformed value before anything
    starts, and lets ``rallypoint plugins`` and ``--help`` list them.

    Attributes:
        name: the key, e.g. ``"join_timeout"``.
        type: ``str``, ``int``, ``float`` or ``bool``; values are converted to it.
        default: the value when the key is not given.
        help: one line for humans.
        secret: never print the value (passwords, private key files).
        choices: when not empty, the only values allowed (compared after conversion).
        minimum, maximum: for numbers, the least and the greatest value allowed;
            ``exclusive_minimum`` excludes the least itself (a timeout "above 0").
            A float option never takes ``nan`` or ``inf``.
    """

    name: str
    type: type = str
    default: Any = None
    help: str = ""
    secret: bool = False
    choices: tuple[Any, ...] = ()
    minimum: float | None = None
    maximum: float | None = None
    exclusive_minimum: bool = False

    def __post_init__(self) -> None:
        if self.type not in (str, int, float, bool):
            raise ValueError(f"option {self.name!r}: type must be str, int, float or bool")
        if not _OPTION_NAME.fullmatch(self.name):
            # The command line splits at "," and the first "=": a key must hold neither.
            raise ValueError(
                f"option {self.name!r}: a key is a letter or _ followed by letters, digits and _"
            )

    def parse(self, raw: str) -> Any:
        """Convert the text ``raw`` to this option's type; raise ``ValueError`` with the reason."""
        value = self._convert(raw.strip())
        if self.choices and value not in self.choices:
            raise ValueError(f"expected one of {', '.join(map(str, self.choices))}")
        low, high = self.minimum, self.maximum
        if low is not None and (value < low or (self.exclusive_minimum and value == low)):
            raise ValueError(f"must be {'above' if self.exclusive_minimum else 'at least'} {low:g}")
        if high is not None and value > high:
            raise ValueError(f"must be at most {high:g}")
        return value

    def to_dict(self) -> dict[str, Any]:
        """The declaration as JSON-friendly data, for ``rallypoint plugins --json``."""
        return {
            "name": self.name,
            "type": self.type.__name__,
            "default": None if self.secret else self.default,
            "help": self.help,
            "choices": list(self.choices),
            "minimum": self.minimum,
            "maximum": self.maximum,
        }

    def _convert(self, text: str) -> Any:
        if self.type is bool:
            return parse_bool(text)
        if self.type is int:
            try:
                return int(text)
            except ValueError:
                raise ValueError("expected a whole number") from None
        if self.type is float:
            try:
                number = float(text)
            except ValueError:
                raise ValueError("expected a number") from None
            if not math.isfinite(number):  # float() reads "nan" and "inf"
                raise ValueError("expected a finite number")
            return number
        return text


#: A registration's check across its parsed options (every declared key present), run when
#: the flags are parsed: raise ``ValueError("key=value ...: why, and what to do")``, a
#: sentence that starts with the key, and the user sees it after the flag's name
#: (``--restart-conf max_delay=0.5 is below delay=1``), before anything starts.
Validate = Callable[[Mapping[str, Any]], None]


# --- rendezvous backends ------------------------------------------------------------------

#: Where the rendezvous protocol keeps a run's keys unless a backend's ``prefix`` option says
#: otherwise: ``<prefix>/<run id>/...``.
DEFAULT_PREFIX = "/rallypoint"

#: Options of the rendezvous protocol itself, shared by every backend built on it. Names and
#: defaults follow torchrun's ``--rdzv-conf`` keys where torchrun has them.
COMMON_RENDEZVOUS_OPTIONS: tuple[ConfigOption, ...] = (
    ConfigOption(
        "join_timeout",
        float,
        600.0,
        "seconds to wait for MIN nodes before giving up",
        minimum=0,
        exclusive_minimum=True,
    ),
    ConfigOption(
        "last_call_timeout",
        float,
        30.0,
        "seconds to wait for more nodes once MIN have joined",
        minimum=0,
    ),
    ConfigOption(
        "close_timeout",
        float,
        30.0,
        "seconds the closing node waits for joiners' records",
        minimum=0,
    ),
    ConfigOption(
        "heartbeat_timeout",
        float,
        15.0,
        "seconds without a heartbeat before a node is dead",
        minimum=0,
        exclusive_minimum=True,
    ),
    ConfigOption(
        "ready_timeout",
        float,
        300.0,
        "seconds a node that comes to a running job may take to get ready (its preloaded "
        "interpreter up, the newest memory checkpoint fetched) before it gives up",
        minimum=0,
        exclusive_minimum=True,
    ),
    ConfigOption(
        "token_file",
        str,
        None,
        "a file holding the job's secret, the same on every node (or RALLYPOINT_JOB_TOKEN); "
        "agents then authenticate each other's checkpoint transfers with it",
    ),
    ConfigOption(
        "retry_timeout",
        float,
        60.0,
        "seconds to retry an unreachable store before giving up",
        minimum=0,
    ),
)


def liveness_ttl(options: Mapping[str, Any], key: str) -> float:
    """The TTL of a backend whose liveness expires (``key``: etcd's ``lease_ttl``, Redis's
    ``key_ttl``): the value given, else two thirds of ``heartbeat_timeout`` (10 s at the
    default 15). Agents refresh it every ``heartbeat_timeout / 3``; two refreshes fit in it,
    so one late refresh does not make a live agent look dead.
    """
    given = options.get(key)
    return float(given) if given is not None else 2 * float(options["heartbeat_timeout"]) / 3


def check_liveness_ttl(options: Mapping[str, Any], key: str) -> None:
    """The check of ``liveness_ttl``, for a backend's ``validate``: a TTL given that two
    refreshes do not fit in is refused.

    Raises:
        ValueError: naming the value and the least it may be.
    """
    ttl, heartbeat = liveness_ttl(options, key), float(options["heartbeat_timeout"])
    if ttl < 2 * heartbeat / 3:
        raise ValueError(
            f"{key}={ttl:g} is shorter than two key refreshes (agents refresh their liveness "
            f"every heartbeat_timeout/3 = {heartbeat / 3:g} s): live agents would look dead; set "
            f"{key} to at least {2 * heartbeat / 3:g} or lower heartbeat_timeout."
        )


class WaitSource(Protocol):
    """What a node's hang detection shares with the round's other nodes, and whether it
    needs to hear theirs (``RendezvousRequest.waits``)."""

    def shared(self) -> Mapping[str, Any] | None:
        """This node's ranks' long waits in collectives, as JSON; None: nothing to say."""
        ...

    def wanted(self) -> bool:
        """Whether this node holds a suspect and needs the others' waits now."""
        ...


@dataclass(frozen=True)
class RendezvousRequest:
    """What a rendezvous backend is given to serve one agent.

    Attributes:
        run_id: ``--rdzv-id``; everything the backend keeps is namespaced by it.
        endpoint: ``--rdzv-endpoint`` as given (``""`` when it was not).
        options: the validated ``--rdzv-conf`` values, every declared key present.
        min_nodes, max_nodes: ``--nnodes MIN:MAX``.
        nproc_per_node: workers on this node.
        node: this node, as rank assigners see it.
        rank_assigner: the ``--rank-assigner`` chosen.
        node_rank, master_addr, master_port: torchrun's static-rendezvous flags.
        viewer: ``True`` for a read-only look (``rallypoint rendezvous status``): connect to
            the store, but never host, create or change anything.
        offer: what this node offers the others in each round (where its agent serves
            memory checkpoints, which steps it holds), or None; a handler that carries
            offers puts them in ``Assignment.offers``.
        pace: this node's workers' CPU seconds per step (None until measured), when
            ``--straggler-factor`` is on; a handler that shares paces answers ``paces()``.
        waits: this node's hang detection: where its ranks wait in collectives, for the
            round's other nodes, and whether it wants theirs; a handler that shares them
            answers ``waits()`` (its heartbeat carries them, as it does paces).
        ready: asked before this node enters a job that is already training, with the
            running round's offers (by group rank): what the node still does to be able
            to start workers at once ("importing torch"), or None once it can. A handler
            that supports it waits, saying so, until None (``ready_timeout``).
        token: the job's secret (``--rdzv-conf token_file`` or ``RALLYPOINT_JOB_TOKEN``),
            or None. Core's protocol seals every record it writes with it; a backend with
            its own handler should refuse a node whose token differs. Never log it.
    """

    run_id: str
    endpoint: str
    options: Mapping[str, Any]
    min_nodes: int = 1
    max_nodes: int = 1
    nproc_per_node: int = 1
    node: NodeSpec = field(default_factory=lambda: NodeSpec("viewer"))
    rank_assigner: RankAssigner | None = None
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    viewer: bool = False
    offer: Callable[[], Mapping[str, str]] | None = None
    pace: Callable[[], float | None] | None = None
    waits: WaitSource | None = None
    ready: Callable[[Sequence[Mapping[str, str]]], str | None] | None = None
    token: bytes | None = field(default=None, repr=False)


@dataclass(frozen=True)
class RendezvousBackend:
    """A rendezvous backend, chosen with ``--rdzv-backend NAME``.

    A backend gives one of two things. ``connect``: a client of its coordination store
    (``rallypoint.interfaces.CoordinationStore``), on which core runs the whole
    rendezvous protocol; this is the usual way, and the etcd and Redis plugins take it.
    Or ``create_handler``: a complete ``rallypoint.interfaces.RendezvousHandler``,
    for a backend with its own protocol.

    Attributes:
        name: the value of ``--rdzv-backend``.
        description: one line for ``rallypoint plugins`` and ``--help``.
        options: the ``--rdzv-conf`` keys it accepts; include ``COMMON_RENDEZVOUS_OPTIONS``
            when the backend runs rallypoint's rendezvous protocol, and a ``prefix`` option
            to put its keys under another root than ``/rallypoint``.
        endpoint_required: whether ``--rdzv-endpoint`` must be given.
        connect: ``(request) -> CoordinationStore``, a new client of the store.
        create_handler: ``(request) -> RendezvousHandler``, instead of ``connect``.
        torch_keys: torch's ``--rdzv-conf`` keys this backend takes under another name:
            torch's key -> the option that takes its value (the etcd plugin's
            ``{"etcd_prefix": "prefix"}``). torch's ``timeout`` is ``join_timeout`` on
            every backend; a torch key a backend neither declares nor renames is accepted
            and reported as having no effect (``rallypoint.rendezvous.torch_keys``).
        validate: checks across options, run when the flags are parsed (see ``Validate``).
        given_ranks: torchrun's static rendezvous: the job's size is fixed (``--nnodes N``),
            each node gives its group rank (``--node-rank``, below N), and group rank 0's
            workers meet at ``--master-addr:--master-port``, also in a job of one node.
        store_in_agent: the store lives in an agent's process and ends with it (c10d's
            TCPStore): there is nothing of a run to clear from it afterwards. Its store
            then has a ``hosting`` attribute: whether this process is that agent (the
            host waits for the others before it leaves).
    """

    name: str
    description: str
    options: tuple[ConfigOption, ...] = ()
    endpoint_required: bool = True
    connect: Callable[[RendezvousRequest], CoordinationStore] | None = None
    create_handler: Callable[[RendezvousRequest], RendezvousHandler] | None = None
    torch_keys: Mapping[str, str] = field(default_factory=dict)
    validate: Validate | None = None
    given_ranks: bool = False
    store_in_agent: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "name", normalise_name(self.name))


# --- restart policies ---------------------------------------------------------------------


@dataclass(frozen=True)
class RestartRequest:
    """What a restart policy is asked to decide on, after a worker failure.

    The agent builds one after every failure; a test builds its own, giving the two
    counts and whatever else the policy reads:
    ``RestartRequest(0, 3, WorkerFailure(local_rank=0, rank=0, pid=1234, exit_code=1),
    {"delay": 5.0}, attempt_uptimes=(42.0,))``.

    Attributes:
        restarts_done: restarts already made in this run (membership changes not counted).
        max_restarts: the ``--max-restarts`` value.
        failure: the first worker that failed (the root cause). Default ``None``: the
            agent always gives one, but a policy must answer without one too (the
            conformance suite asks).
        options: the policy's ``--restart-conf`` values, every declared key present;
            default empty.
        attempt_uptimes: how long each failed attempt of this run ran, in seconds, oldest
            first; the last one is the attempt that just failed. Default empty.
        stragglers: the node ids found to be stragglers in the attempt that failed (see
            ``--straggler-factor``), this node's among them if it was one. Default empty.
    """

    restarts_done: int
    max_restarts: int
    failure: WorkerFailure | None = None
    options: Mapping[str, Any] = field(default_factory=dict)
    attempt_uptimes: tuple[float, ...] = ()
    stragglers: tuple[str, ...] = ()


@dataclass(frozen=True)
class RestartDecision:
    """A restart policy's answer: restart after ``delay`` seconds, or give up."""

    restart: bool
    delay: float = 0.0
    reason: str = ""


@dataclass(frozen=True)
class RestartPolicy:
    """A restart policy, chosen with ``--restart-policy NAME``.

    Attributes:
        name: the value of ``--restart-policy``.
        description: one line for humans.
        decide: a pure function from a ``RestartRequest`` to a ``RestartDecision``.
        options: the ``--restart-conf`` keys it accepts.
        validate: checks across options, run when the flags are parsed (see ``Validate``).
    """

    name: str
    description: str
    decide: Callable[[RestartRequest], RestartDecision]
    options: tuple[ConfigOption, ...] = ()
    validate: Validate | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "name", normalise_name(self.name))


# --- rank assignment ----------------------------------------------------------------------


@dataclass(frozen=True)
class NodeSpec:
    """One node of a rendezvous round, as a rank assigner sees it.

    The rendezvous builds one per member of a round, from the record each node wrote when
    it joined; a test builds them directly, giving only what the assigner reads:
    ``NodeSpec("node-a", host="10.0.0.2", labels={"rack": "a"}, previous_rank=1)``.

    Attributes:
        node_id: unique per agent process and stable for its life (the agent's is
            ``<hostname>_<pid>_<8 hex digits>``); the one field without a default.
        host: the node's address, as the other nodes reach it (``--local-addr``, else
            the host's name); default ``""``.
        labels: its ``--node-label KEY=VALUE`` pairs as a ``Mapping[str, str]``, keys and
            values stripped (``--node-label rack=a --node-label zone=1``, or
            ``--node-label rack=a,zone=1``, give ``{"rack": "a", "zone": "1"}``; a key
            given twice keeps its last value). Empty by default; read-only to assigners.
        previous_rank: its group rank in the previous round, ``None`` if it is new (and in
            the first round); default ``None``.
        pace: the CPU seconds its workers spent per step in its last round (how
            stragglers are found, see ``--straggler-factor``), ``None`` if it is new or
            its workers reported no steps; default ``None``. An assigner may place the
            slowest nodes last, for example.
    """

    node_id: str
    host: str = ""
    labels: Mapping[str, str] = field(default_factory=dict)
    previous_rank: int | None = None
    pace: float | None = None


@dataclass(frozen=True)
class RankAssigner:
    """A rank assignment, chosen with ``--rank-assigner NAME``.

    The leader of every round of rallypoint's rendezvous protocol calls ``assign``, in a
    job of one node too: that job runs the protocol on a store in the agent's memory, and
    ``assign`` gets a list of one node, to which it must answer ``[0]``. A ``static`` job
    of several nodes does not call it (its ranks are the ``--node-rank`` values given),
    and a backend with a ``create_handler`` of its own decides whether to.

    Attributes:
        name: the value of ``--rank-assigner``.
        description: one line for humans.
        assign: given the round's nodes in join order, return their group ranks in the same
            order: a permutation of ``0..len(nodes)-1``, the same for the same input.
            An assigner that declares ``options`` is called ``assign(nodes, options=...)``
            with its ``--rank-conf`` values, every declared key present.
        options: the ``--rank-conf`` keys it accepts.
        validate: checks across options, run when the flags are parsed (see ``Validate``).
    """

    name: str
    description: str
    assign: Callable[..., Sequence[int]]
    options: tuple[ConfigOption, ...] = ()
    validate: Validate | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "name", normalise_name(self.name))


# --- checkpoint storage -------------------------------------------------------------------


@dataclass(frozen=True)
class CheckpointBackend:
    """A checkpoint backend, chosen by the URL scheme of ``--checkpoint-dir``.

    Attributes:
        name: a short name shown by ``rallypoint plugins``.
        description: one line for humans.
        schemes: the URL schemes it serves; ``""`` means a plain path.
        open: ``(url) -> CheckpointStorage`` (``rallypoint.checkpoint.storage``): the
            storage at ``url``, on which rallypoint writes, verifies, rotates and loads
            checkpoints. Called in the workers.
        check: ``(url) -> None``, raising ``ValueError`` with a sentence when ``url`` is
            not one the backend can serve (a malformed bucket name): called by the agent
            when it parses ``--checkpoint-dir``, so that the user hears it before any
            worker starts rather than from every worker's ``open``. No I/O: the storage
            may not be reachable from the agent's host.
    """

    name: str
    description: str
    schemes: tuple[str, ...] = ()
    open: Callable[[str], CheckpointStorage] | None = None
    check: Callable[[str], None] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "name", normalise_name(self.name))
        object.__setattr__(self, "schemes", tuple(s.lower() for s in self.schemes))


# --- metrics ------------------------------------------------------------------------------


class EventSink(Protocol):
    """What a metrics sink's ``create`` returns: it receives every event of the run."""

    def emit(self, event: Event) -> None:
        """Record ``event``; must not block the agent for long or raise for a bad event."""

    def close(self) -> None:
        """Flush and release resources; called once when the agent stops."""


@dataclass(frozen=True)
class SinkContext:
    """What a metrics sink is created with.

    Attributes:
        run: the run being measured.
        options: the sink's ``--metrics-conf`` values, every declared key present.
        worker_metrics_dir: for a sink registered with ``worker_metrics=True``, the
            directory where this node's workers record their ``rallypoint.metrics``
            (``RALLYPOINT_METRICS_DIR``); ``None`` for other sinks. The agent creates it
            empty before the first worker starts and removes it when it stops; the sink
            reads it, and clears what dead workers left that must not outlive them.
    """

    run: RunInfo
    options: Mapping[str, Any] = field(default_factory=dict)
    worker_metrics_dir: str | None = None


@dataclass(frozen=True)
class MetricsSink:
    """A metrics sink, chosen with ``--metrics NAME[,NAME...]`` (several at once).

    Attributes:
        name: the value given to ``--metrics``.
        description: one line for humans.
        create: builds the sink for one run.
        options: the ``--metrics-conf`` keys it accepts.
        worker_metrics: the sink also exports the metrics workers record with
            ``rallypoint.metrics``. When a chosen sink sets it, the agent gives the workers
            a metrics directory (``RALLYPOINT_METRICS_DIR``, files in prometheus_client's
            multiprocess format) and the sink its path in ``SinkContext.worker_metrics_dir``.
            Without such a sink, ``rallypoint.metrics`` calls in workers do nothing.
        validate: checks across options, run when the flags are parsed (see ``Validate``).
    """

    name: str
    description: str
    create: Callable[[SinkContext], EventSink]
    options: tuple[ConfigOption, ...] = ()
    worker_metrics: bool = False
    validate: Validate | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "name", normalise_name(self.name))


#: Every registration type, in the order ``rallypoint plugins`` lists them.
Registration = RendezvousBackend | RestartPolicy | RankAssigner | CheckpointBackend | MetricsSink
