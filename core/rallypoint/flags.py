"""``rallypoint run``'s flags, each declared once: the table the CLI makes its options from,
and the parser that turns what a user gave into typed values.

A ``Flag`` holds a flag's name (``--a-b``, also spelled ``--a_b``), its help, its default as
a user would type it, its type, bounds or choices, and torchrun's one-letter alias.
``parse_flags`` takes the values given (text from the command line or the environment,
or Python values) and returns every flag typed, or raises a ``UsageError`` of one sentence.
It does no I/O and reads no environment but the mapping it is handed: what depends on this
machine is decided by ``rallypoint.config`` (Slurm, device counts) and checked by
``rallypoint.preflight`` (files, shared memory, visible devices, entry points).
"""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from rallypoint.errors import UsageError
from rallypoint.extensions import ConfigOption, parse_bool
from rallypoint.registry import (
    METRICS_SINKS,
    RANK_ASSIGNERS,
    RENDEZVOUS_BACKENDS,
    RESTART_POLICIES,
    Kind,
)

#: ``--nnodes auto``: the job's shape is the Slurm job's (``rallypoint.slurm``).
AUTO_NODES = "auto"
#: torchrun's ``--nproc-per-node`` words, counted on the machine by ``rallypoint.config``.
WORKER_COUNTS = ("auto", "cpu", "gpu", "xpu")
#: torch 2.13's event handlers (``torch.distributed.elastic.events.handlers``).
EVENT_LOG_HANDLERS = ("console", "dynamic_rendezvous", "null")
#: torchrun's ``--numa-binding`` modes (``rallypoint.agent.processes.numa`` binds by them).
NUMA_BINDINGS = ("node", "socket", "exclusive", "core-complex")
#: torchrun's ``--start-method`` values: accepted, though workers start as warm start says.
START_METHODS = ("spawn", "fork", "forkserver")

_STD_VALUES = {0: "none", 1: "stdout", 2: "stderr", 3: "both"}


@dataclass(frozen=True)
class Flag:
    """One option of ``rallypoint run``.

    Attributes:
        name: the long name with dashes; ``--name`` and ``--na_me`` are both accepted.
        help: one line; ``{names}`` is replaced by the names registered for ``names``,
            ``{default}`` by ``default``.
        default: the value when the flag is not given, as a user would type it (False for a
            switch); None: not given is a meaning of its own, kept as None.
        type: ``str``, ``int``, ``float`` or ``bool`` (on/off); numbers are checked against
            ``minimum``, ``exclusive_minimum`` and ``maximum``, text against ``choices``.
        parse: a format of its own: ``(text, name) -> value``, ``name`` for the message.
        then: a rule of its own after the type and bounds: ``(value, name) -> value``.
        short: torchrun's one-letter alias (``-m``).
        switch: takes no value (``--standalone``); the environment may say on or off.
        repeated: may be given several times (``parse`` then gets the list).
        show_default: False where the help sentence says the default itself.
        empty_is_default: an empty value means the default.
        env: torch's own variable, read when the flag is not given.
        field: the name of the parsed value, where it is not the flag's (``node_labels``).
        names: the extension point whose registered names the flag chooses from.
    """

    name: str
    help: str
    default: Any = ""
    type: type = str
    minimum: float | None = None
    maximum: float | None = None
    exclusive_minimum: bool = False
    choices: tuple[str, ...] = ()
    parse: Callable[[Any, str], Any] | None = None
    then: Callable[[Any, str], Any] | None = None
    short: str | None = None
    switch: bool = False
    repeated: bool = False
    show_default: bool = True
    empty_is_default: bool = False
    env: str | None = None
    field: str = ""
    names: Kind[Any] | None = None

    @property
    def option(self) -> str:
        """``--name``, as every message names the flag."""
        return f"--{self.name}"

    @property
    def dest(self) -> str:
        """The name of the parsed value (``nproc_per_node``)."""
        return self.field or self.name.replace("-", "_")

    def value(self, given: Any, environ: Mapping[str, str]) -> Any:
        """The typed value, from what was ``given`` (None: not given)."""
        name = self.option
        if given is None and self.env and environ.get(self.env):
            given, name = environ[self.env], self.env
        if given is None or (self.empty_is_default and given == ""):
            given = self.default
        if given is None:
            return None
        if self.repeated:
            return self._finish(self.parse(given, name) if self.parse else tuple(given), name)
        if self.type is bool and isinstance(given, bool):
            return given  # a switch that click set, or a Python caller's bool
        return self.convert(str(given), name)

    def convert(self, text: str, name: str) -> Any:
        """``text`` as this flag's type, checked; ``name`` is the flag or variable it came from."""
        if self.parse is not None:
            value = self.parse(text, name)
        elif self.type is bool:
            try:
                value = parse_bool(text)
            except ValueError:
                raise UsageError(f"{name} {text!r}: choose on or off.") from None
        elif self.type in (int, float):
            value = self._number(text, name)
        elif self.choices and text not in self.choices:
            raise UsageError(f"{name} {text!r}: choose one of {', '.join(self.choices)}.")
        else:
            value = text
        return self._finish(value, name)

    def _finish(self, value: Any, name: str) -> Any:
        return value if self.then is None else self.then(value, name)

    def _number(self, text: str, name: str) -> int | float:
        # The same conversion and bounds as a plugin's numeric key=value option.
        option = ConfigOption(
            self.dest, self.type, minimum=self.minimum, exclusive_minimum=self.exclusive_minimum
        )
        try:
            number: int | float = option.parse(text)
        except ValueError as error:
            raise UsageError(f"{name} {text!r}: {error}.") from None
        if self.maximum is not None and number > self.maximum:
            # A port: the sentence gives the whole range.
            low = self.minimum or 0
            raise UsageError(f"{name} {number}: must be between {low:g} and {self.maximum:g}.")
        return number


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


def _nodes(text: str, name: str) -> tuple[int, int] | str:
    """``--nnodes``: a range, or ``AUTO_NODES`` for the Slurm job's."""
    return AUTO_NODES if text.strip().lower() == AUTO_NODES else parse_nnodes(text)


def parse_nproc_per_node(text: str, name: str = "--nproc-per-node") -> int | str:
    """A positive number, or one of torchrun's words ``WORKER_COUNTS`` (lower-cased)."""
    value = text.strip().lower()
    if _digits(value):
        count = int(value)
        if count < 1:
            raise UsageError(f"{name} {text!r}: must be at least 1.")
        return count
    if value in WORKER_COUNTS:
        return value
    raise UsageError(f"{name} {text!r}: expected a whole number or one of auto, cpu, gpu, xpu.")


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


def _run_id(text: str, name: str) -> str:
    check_run_id(text)
    return text


def split_list(text: str) -> list[str]:
    """``"a, b,,c"`` -> ``["a", "b", "c"]``."""
    return [part.strip() for part in text.split(",") if part.strip()]


def parse_labels(pairs: Iterable[str], name: str = "--node-label") -> dict[str, str]:
    """``["rack=a", "zone=1"]`` (or ``"rack=a,zone=1"`` items) -> ``{"rack": "a", "zone": "1"}``."""
    labels: dict[str, str] = {}
    for item in pairs:
        for pair in split_list(item):
            key, sep, value = pair.partition("=")
            if not sep or not key.strip():
                raise UsageError(f"{name} {pair!r}: expected KEY=VALUE.")
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


def parse_local_ranks(text: str, name: str = "--local-ranks-filter") -> frozenset[int] | None:
    """``"0,2"`` -> ``{0, 2}``; empty means every rank."""
    items = split_list(text)
    if not items:
        return None
    if not all(_digits(item) for item in items):
        raise UsageError(f"{name} {text!r}: expected local ranks like 0,1,2.")
    return frozenset(int(item) for item in items)


def parse_signals(text: str, name: str = "--signals-to-handle") -> tuple[str, ...]:
    """``"SIGTERM,SIGUSR1"`` -> names checked against this platform's signals."""
    names = tuple(item.upper() for item in split_list(text))
    for item in names:
        if not item.startswith("SIG") or not hasattr(signal, item) or item.startswith("SIG_"):
            raise UsageError(f"{name} {text!r}: {item!r} is not a signal name.")
    return names


def parse_filters(text: str, name: str = "") -> tuple[str, ...]:
    """torchrun's ``--duplicate-*-filters``: comma-separated, ``,,`` for a comma in one."""
    items = text.replace(",,", "\0").split(",")
    return tuple(item.replace("\0", ",") for item in items if item)


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)b?\s*$", re.IGNORECASE)


def parse_size(text: str, flag: str) -> int:
    """Bytes, from ``500MB``, ``2GB``, ``1.5GiB``, ``4G`` or a plain number of bytes."""
    match = _SIZE.match(text)
    if not match:
        raise UsageError(f"{flag} {text!r}: expected a size such as 512MB, 4GB or 2GiB.")
    number, unit, binary = float(match[1]), match[2].lower(), bool(match[3])
    power = "kmgt".index(unit) + 1 if unit else 0
    return int(number * (1024 if binary else 1000) ** power)


def format_size(size: int) -> str:
    """``size`` bytes as ``parse_size`` reads them, in the largest unit that holds it whole
    (``4GB``, ``2GiB``, ``1500MB``)."""
    for power in (4, 3, 2, 1):
        for base, suffix in ((1000, "B"), (1024, "iB")):
            if size % base**power == 0:
                return f"{size // base**power}{'KMGT'[power - 1]}{suffix}"
    return str(size)


def _memory_size(text: str, name: str) -> int:
    """``--checkpoint-memory``: a size above 0; empty for none."""
    if not text:
        return 0
    size = parse_size(text, name)
    if size <= 0:
        raise UsageError(f"{name} {text!r}: give a size above 0, or leave it out.")
    return size


def _modules(text: str, name: str) -> tuple[str, ...]:
    """``--preload a,b.c``: module names."""
    modules = tuple(item.strip() for item in text.split(",") if item.strip())
    for module in modules:
        if not all(part.isidentifier() for part in module.split(".")):
            raise UsageError(f"{name} {module!r}: expected a module name such as numpy.")
    return modules


def _straggler_factor(factor: float, name: str) -> float:
    if 0 < factor <= 1:
        raise UsageError(
            f"{name} {factor:g}: must be above 1 (how many times slower than the others a "
            "straggler is), or 0 to name none."
        )
    return factor


def _zero_is_off(seconds: float, name: str) -> float | None:
    return seconds or None  # 0 turns the watchdog off, like leaving it out


# --- the table --------------------------------------------------------------------------------

#: Every option of ``rallypoint run``, in the order ``--help`` lists them.
FLAGS: tuple[Flag, ...] = (
    Flag(
        "nnodes",
        "Number of nodes N, a range MIN:MAX for an elastic job, or auto (Slurm).",
        "1:1",
        parse=_nodes,
    ),
    Flag(
        "nproc-per-node",
        "Workers per node: a number, or auto, cpu, gpu, xpu.",
        "1",
        parse=parse_nproc_per_node,
    ),
    Flag("rdzv-backend", "Rendezvous backend: {names}.", "static", names=RENDEZVOUS_BACKENDS),
    Flag("rdzv-endpoint", "Rendezvous endpoint, usually host:port."),
    Flag("rdzv-id", "Job id shared by every node of the job.", "none", parse=_run_id),
    Flag("rdzv-conf", "Backend settings as key=value,key=value."),
    Flag(
        "standalone",
        "Single node: local c10d store on a free port, fresh run id.",
        False,
        bool,
        switch=True,
    ),
    Flag("max-restarts", "Worker group restarts before failing.", "0", int, minimum=0),
    Flag(
        "monitor-interval",
        "Seconds between worker checks.",
        "0.1",
        float,
        minimum=0,
        exclusive_minimum=True,
    ),
    Flag("start-method", "Accepted for torchrun compatibility.", "spawn", choices=START_METHODS),
    Flag("role", "User-defined role of the workers.", "default"),
    Flag("module", "Run SCRIPT as a module, like python -m.", False, bool, short="-m", switch=True),
    Flag("no-python", "Run SCRIPT directly, not with python.", False, bool, switch=True),
    Flag(
        "run-path", "Run SCRIPT (an absolute path) with runpy.run_path.", False, bool, switch=True
    ),
    Flag("log-dir", "Base directory for worker log files.", None),
    Flag(
        "redirects",
        "Redirect streams to files: 0-3 or LOCAL_RANK:0-3,...",
        "0",
        parse=parse_std_spec,
        short="-r",
    ),
    Flag(
        "tee",
        "Copy streams to files and the console (like --redirects).",
        "0",
        parse=parse_std_spec,
        short="-t",
    ),
    Flag(
        "local-ranks-filter",
        "Show console output only from these local ranks (0,1,...).",
        parse=parse_local_ranks,
    ),
    Flag("node-rank", "This node's rank (static rendezvous).", "0", int, minimum=0),
    Flag("master-addr", "Rank 0's address (static rendezvous).", "127.0.0.1"),
    Flag(
        "master-port",
        "Rank 0's port (static rendezvous; default 29500).",
        None,
        int,
        minimum=0,
        maximum=65535,
    ),
    Flag("local-addr", "This node's address, as others reach it.", None),
    Flag(
        "signals-to-handle",
        "Signals forwarded to workers.",
        "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
        parse=parse_signals,
        empty_is_default=True,
    ),
    Flag(
        "shutdown-timeout",
        "Seconds workers get to stop before SIGKILL (default {default}).",
        "30",
        float,
        minimum=0,
        show_default=False,
        env="TORCH_ELASTIC_SHUTDOWN_TIMEOUT",
    ),
    Flag(
        "exit-barrier-timeout",
        "Seconds to wait for other nodes to finish.",
        "300",
        float,
        minimum=0,
    ),
    Flag("restart-policy", "Restart policy: {names}.", "max-restarts", names=RESTART_POLICIES),
    Flag("restart-conf", "Restart policy settings as key=value,..."),
    Flag("rank-assigner", "Rank assignment: {names}.", "ordered", names=RANK_ASSIGNERS),
    Flag("rank-conf", "Rank assigner settings as key=value,..."),
    Flag(
        "node-label",
        "KEY=VALUE label of this node (repeatable), for rank assignment.",
        (),
        parse=parse_labels,
        repeated=True,
        field="node_labels",
    ),
    Flag("metrics", "Metrics sinks, comma-separated: {names}.", names=METRICS_SINKS),
    Flag("metrics-conf", "Metrics sink settings as key=value,..."),
    Flag(
        "metrics-port",
        "Port of the metrics endpoint (0: a free one); --metrics-conf port=N.",
        None,
        int,
        minimum=0,
        maximum=65535,
    ),
    Flag("checkpoint-dir", "Where workers save checkpoints: a path or URL.", None),
    Flag(
        "checkpoint-memory",
        "Save checkpoints to this node's shared memory, at most SIZE (4GB); the agent "
        "copies them to --checkpoint-dir.",
        parse=_memory_size,
    ),
    Flag(
        "checkpoint-memory-keep",
        "Memory checkpoints kept per node (default {default}).",
        "1",
        int,
        minimum=1,
        show_default=False,
    ),
    Flag(
        "checkpoint-persist-every",
        "Copy every Nth memory checkpoint to --checkpoint-dir (default {default}).",
        "10",
        int,
        minimum=1,
        show_default=False,
    ),
    Flag("event-log", "Append a JSON-lines log of every phase.", None),
    Flag(
        "straggler-factor",
        "Name a node whose workers work this many times longer per step than the "
        "others' median (default {default}; 0: never).",
        "1.5",
        float,
        minimum=0,
        then=_straggler_factor,
        show_default=False,
    ),
    Flag(
        "watchdog-timeout",
        "Restart a worker with no progress signal for this many seconds, whatever it does "
        "(default: off; hang detection needs none).",
        None,
        float,
        minimum=0,
        then=_zero_is_off,
    ),
    Flag(
        "hang-detection",
        "auto: kill and restart a rank found hung, on evidence; off: never (default {default}).",
        "auto",
        choices=("auto", "off"),
        show_default=False,
    ),
    Flag(
        "hang-floor",
        "The shortest deadline a rank's progress is given before it counts as hung, in "
        "seconds (default {default}).",
        "60",
        float,
        minimum=0,
        exclusive_minimum=True,
        show_default=False,
    ),
    Flag(
        "hang-ceiling",
        "Kill a rank silent, or alone in a collective, this many seconds (default {default}).",
        "600",
        float,
        minimum=0,
        exclusive_minimum=True,
        show_default=False,
    ),
    Flag("logs-specs", "A torchrun.logs_specs entry point: where worker logs go.", None),
    Flag(
        "event-log-handler",
        "torch's event handler: null, console, dynamic_rendezvous.",
        "null",
        choices=EVENT_LOG_HANDLERS,
        empty_is_default=True,
    ),
    Flag(
        "duplicate-stdout-filters",
        "Also copy teed stdout lines containing one of these (a,b; ,, for a comma) to a file.",
        parse=parse_filters,
    ),
    Flag("duplicate-stderr-filters", "The same for stderr.", parse=parse_filters),
    Flag(
        "numa-binding",
        "Bind workers near their device: node, socket, exclusive, core-complex.",
        None,
        choices=NUMA_BINDINGS,
    ),
    Flag(
        "virtual-local-rank",
        "LOCAL_RANK=0 in every worker, CUDA_VISIBLE_DEVICES its own device.",
        False,
        bool,
        switch=True,
    ),
    Flag(
        "warm-start",
        "on: fork workers from an interpreter that imported torch already; off: a fresh one each.",
        "on",
        bool,
    ),
    Flag(
        "preload",
        "Modules to import before forking workers, besides torch (a,b).",
        parse=_modules,
    ),
)

#: The flags that say where a job's rendezvous is: ``rallypoint rendezvous status`` and
#: ``clear`` take them as ``run`` does, with the same defaults and variables.
RENDEZVOUS_FLAGS: tuple[Flag, ...] = tuple(
    flag for flag in FLAGS if flag.name in ("rdzv-backend", "rdzv-endpoint", "rdzv-id", "rdzv-conf")
)

#: The script and its arguments, given with the flags (``rallypoint run [OPTIONS] SCRIPT ...``).
ARGUMENTS = ("training_script", "training_script_args")
_NAMES = frozenset(flag.dest for flag in FLAGS) | frozenset(ARGUMENTS)


def parse_flags(given: Mapping[str, Any], environ: Mapping[str, str]) -> dict[str, Any]:
    """Every flag of ``FLAGS`` typed, by ``Flag.dest``, with the script and its arguments.

    ``given`` holds the values the user gave, by ``Flag.dest``: text as typed, or from
    Python a number, a bool for an on/off flag and a list for ``--node-label``; a flag
    missing or None takes its default. ``environ`` is read for torch's own variables
    (``Flag.env``) only.

    Raises:
        UsageError: one sentence naming the flag, the bad value and what is expected.
        TypeError: ``given`` names no flag (a caller's mistake, not a user's).
    """
    unknown = sorted(set(given) - _NAMES)
    if unknown:
        raise TypeError(f"not flags of rallypoint run: {', '.join(unknown)}")
    values = {flag.dest: flag.value(given.get(flag.dest), environ) for flag in FLAGS}
    values["training_script"] = script = str(given.get("training_script") or "")
    values["training_script_args"] = tuple(given.get("training_script_args") or ())
    _check_script(script, values["module"], values["no_python"], values["run_path"])
    if values["hang_ceiling"] < values["hang_floor"]:
        raise UsageError(
            f"--hang-ceiling {values['hang_ceiling']:g} is under --hang-floor "
            f"{values['hang_floor']:g}: the ceiling is the longest a rank may be silent, "
            "so give it at least the floor."
        )
    return values


def parse_rendezvous_flags(given: Mapping[str, Any], environ: Mapping[str, str]) -> dict[str, Any]:
    """The ``RENDEZVOUS_FLAGS`` typed, by ``Flag.dest``, as ``parse_flags`` types them.

    Raises:
        UsageError: one sentence naming the flag, the bad value and what is expected.
        TypeError: ``given`` names no rendezvous flag (a caller's mistake).
    """
    unknown = sorted(set(given) - {flag.dest for flag in RENDEZVOUS_FLAGS})
    if unknown:
        raise TypeError(f"not rendezvous flags: {', '.join(unknown)}")
    return {flag.dest: flag.value(given.get(flag.dest), environ) for flag in RENDEZVOUS_FLAGS}


def _check_script(script: str, module: bool, no_python: bool, run_path: bool) -> None:
    """What the command line alone says about the script (``rallypoint.preflight`` looks
    whether it is there)."""
    if not script:
        raise UsageError("missing the training script: rallypoint run [OPTIONS] SCRIPT [ARGS]...")
    if script.startswith("-"):
        # Options after the first unknown one are the script's; before it, this is a typo.
        raise UsageError(f"no such option: {script}. See 'rallypoint run --help'.")
    if module:
        if no_python:
            raise UsageError("-m/--module and --no-python cannot be used together.")
        return  # resolved by the worker's interpreter, as with `python -m`
    if run_path and not os.path.isabs(script):
        raise UsageError(f"--run-path needs an absolute script path, not {script!r}.")
