"""What happens during a run, as plain data.

The agent describes every phase of a run with these records. The same records are passed
to the lifecycle hooks (see ``rallypoint.hookspecs``), to every metrics sink and to the
JSON-lines event log, so a plugin, a dashboard and a benchmark all see one account.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

#: Event names, one per agent phase. Sinks may see names added later: ignore unknown ones.
AGENT_STARTED = "agent_started"
RENDEZVOUS_STARTED = "rendezvous_started"
RENDEZVOUS_COMPLETED = "rendezvous_completed"
WORKERS_STARTED = "workers_started"
#: A ``WorkerFailure``'s fields, and ``detected``: when the agent noticed it (wall time).
WORKER_FAILED = "worker_failed"
WORKERS_RESTARTED = "workers_restarted"
SCALE_CHANGED = "scale_changed"
#: While workers run, the number of nodes waiting to join the next round changed:
#: ``nodes_waiting``. Never sent on a one-node job; a completed round means none wait.
NODES_WAITING = "nodes_waiting"
AGENT_STOPPING = "agent_stopping"
#: The agent found a local rank hung and is about to kill it
#: (``rallypoint.agent.monitoring.hangs``): ``kind`` (``stuck``, ``collective``,
#: ``silent`` or ``watchdog``), ``ranks`` (those killed), ``sentence`` (what it found,
#: where each waited and was) and ``stacks`` (the attempt's directory, where each rank's
#: ``stacks.txt`` holds every thread's stack). Its ``worker_failed`` events follow.
HANG_DETECTED = "hang_detected"
#: The step this node's workers reached (``rallypoint.progress(step=...)``, a checkpoint
#: save, the ``ElasticSampler``, ``rallypoint.metrics.step``): ``step``, and
#: ``step_seconds`` (the median time of a step here lately) once two steps are known.
#: At most one every 2 s while the step moves, and one when the workers stop.
PROGRESS = "progress"
#: This node's workers work markedly longer per step than the round's others (see
#: ``rallypoint.agent.monitoring.stragglers``): ``pace`` (its workers' CPU seconds per step),
#: ``median`` (the other nodes' median pace), ``ratio``. Once per round.
STRAGGLER = "straggler"
#: Sent by workers (``rallypoint.checkpoint``) through their agent: ``step``, ``seconds``,
#: ``bytes``, ``rank``; saves add ``blocked_seconds`` and ``asynchronous``, loads ``skipped``.
CHECKPOINT_SAVED = "checkpoint_saved"
CHECKPOINT_LOADED = "checkpoint_loaded"
#: The agent copied a memory checkpoint (``--checkpoint-memory``) to ``--checkpoint-dir``:
#: ``step``, ``seconds``, ``bytes``, ``url``.
CHECKPOINT_PERSISTED = "checkpoint_persisted"
#: The agent refused a checkpoint transfer that did not prove the job's token
#: (``--rdzv-conf token_file``) or was unsafe (a file name that is a path, files that fail
#: their MAC), or a worker skipped a checkpoint whose manifest names a path: ``peer`` (its
#: address, or the checkpoint directory's URL), ``reason``.
PEER_REFUSED = "peer_refused"

#: The fields every record of the event log carries besides an event's own.
COMMON_FIELDS = ("event", "wall_time", "monotonic", "run_id", "node", "host", "role")
_ROUND = {
    "round": "",
    "group_rank": "",
    "group_world_size": "",
    "world_size": "",
    "master_addr": "",
    "master_port": "",
    "members": "node ids by group rank",
}
_WORKER = {"rank": "", "local_rank": ""}  # what the worker channel adds to a worker's event


@dataclass(frozen=True)
class EventSpec:
    """One event as the agent sends it: when, its own fields (name -> what it holds, in
    markdown; empty where the name says it), and the lifecycle hook it goes to, if any.
    The user guide's and checkpointing.md's tables are generated from ``EVENTS``
    (docs/gen_event_tables.py), and the tests check every event log they read against it.
    """

    name: str
    when: str
    fields: Mapping[str, str]
    hook: str | None = None


EVENTS: tuple[EventSpec, ...] = (
    EventSpec(
        AGENT_STARTED,
        "the agent started, before the first rendezvous",
        {"nproc_per_node": "", "min_nodes": "", "max_nodes": ""},
        "on_agent_started",
    ),
    EventSpec(
        RENDEZVOUS_STARTED,
        "a rendezvous round begins",
        {
            "restart_count": "the restarts counted so far: after a failure on one node, the "
            "restart it is for; after a failure of a job of several nodes, the round decides "
            "whether the failure counts, and the `workers_restarted` after it says",
        },
    ),
    EventSpec(
        RENDEZVOUS_COMPLETED,
        "the round completed",
        {**_ROUND, "duration_seconds": ""},
        "on_rendezvous_completed",
    ),
    EventSpec(
        SCALE_CHANGED,
        "the round has a different number of nodes than the one before (never on one node)",
        {"old_nodes": "", "new_nodes": ""},
        "on_scale_changed",
    ),
    EventSpec(
        WORKERS_STARTED,
        "this node's workers were started",
        {**_ROUND, "pids": "by local rank"},
        "on_workers_started",
    ),
    EventSpec(
        WORKER_FAILED,
        "one per failed worker, root cause first, once the other workers are stopped",
        {
            "local_rank": "",
            "rank": "",
            "pid": "",
            "exit_code": "",
            "signal": "",
            "message": "",
            "timestamp": "when it failed",
            "detected": "when the agent noticed",
            "stalled_seconds": "set when it was killed for a hang",
            "hang": "the hang's sentence, set when it was killed for one",
            "out_of_memory": "whether the kernel's OOM killer ended it",
        },
        "on_worker_failed",
    ),
    EventSpec(
        HANG_DETECTED,
        "the agent found a local rank hung and is about to kill it",
        {
            "kind": "`stuck`, `collective`, `silent`, `watchdog`",
            "ranks": "those killed",
            "sentence": "",
            "stacks": "the attempt's directory, with each rank's `stacks.txt`",
        },
    ),
    EventSpec(
        WORKERS_RESTARTED,
        "the workers are about to be restarted: for a membership change, before the next "
        "round; after a failure, once the next round completed (after the restart "
        "policy's delay), since that round tells whether the failure was a lost node's "
        "(`membership`)",
        {
            "restart_count": "restarts after failures so far, counting this one",
            "cause": "`failure` or `membership`",
            "reason": "after a failure, the restart policy's name and reason, as on the "
            "console; else that the job's nodes changed",
        },
        "on_workers_restarted",
    ),
    EventSpec(
        NODES_WAITING,
        "the number of nodes waiting to join changed (never on one node)",
        {"nodes_waiting": ""},
    ),
    EventSpec(
        CHECKPOINT_SAVED,
        "a worker saved a checkpoint",
        {
            "step": "",
            "seconds": "until the checkpoint was complete",
            "blocked_seconds": "how long `save` held up training",
            "bytes": "",
            "asynchronous": "",
            "tier": "`memory` or `durable`",
            "format": "on memory saves: `state`, a whole state, or `sharded`, a rank's share",
            **_WORKER,
        },
    ),
    EventSpec(
        CHECKPOINT_LOADED,
        "a worker loaded one",
        {
            "step": "",
            "seconds": "",
            "bytes": "",
            "skipped": "damaged or unfinished checkpoints passed over",
            "source": "`memory`, `peer` or `durable`",
            **_WORKER,
        },
    ),
    EventSpec(
        CHECKPOINT_PERSISTED,
        "the agent copied a memory checkpoint to `--checkpoint-dir`",
        {"step": "", "seconds": "", "bytes": "", "url": ""},
    ),
    EventSpec(
        PEER_REFUSED,
        "the agent refused a checkpoint transfer: one that did not prove the job's token, "
        "or one that was unsafe (a file name that is a path, a message over its bound, "
        "files that fail their MAC); or a worker skipped a checkpoint whose manifest no "
        "rallypoint writes, such as one that names a path",
        {
            "peer": "the peer's address; from a worker, the checkpoint directory's URL",
            "reason": "what was refused and why",
            **_WORKER,
        },
    ),
    EventSpec(
        PROGRESS,
        "the step this node's workers reached moved (at most every 2 s), and when they stop",
        {
            "step": "",
            "step_seconds": "the median time of a step here, over the last 20 steps of each rank",
        },
    ),
    EventSpec(
        STRAGGLER,
        "a node's workers step markedly slower than the round's others",
        {
            "pace": "its workers' CPU seconds per step",
            "median": "the other nodes' median pace",
            "ratio": "",
        },
    ),
    EventSpec(
        AGENT_STOPPING,
        "the agent is about to exit",
        {"exit_code": "", "reason": "one line"},
        "on_agent_stopping",
    ),
)


@dataclass(frozen=True)
class RunInfo:
    """Who is running: the job, this node and the worker role.

    Attributes:
        run_id: the rendezvous id (``--rdzv-id``) shared by every node of the job.
        node_id: unique for this agent process, stable for its life.
        hostname: the host this agent runs on.
        role: the worker role (``--role``), ``"default"`` unless set.
    """

    run_id: str
    node_id: str
    hostname: str
    role: str = "default"


@dataclass(frozen=True)
class RoundInfo:
    """The outcome of one completed rendezvous round, as this node sees it.

    Attributes:
        round: the round number, starting at 0 and increasing by one per round.
        group_rank: this node's rank among the nodes of the round.
        group_world_size: how many nodes took part.
        world_size: how many workers in all (sum of every node's ``--nproc-per-node``).
        master_addr, master_port: where rank 0's process group listens.
        members: the node ids of the round, ordered by group rank.
    """

    round: int
    group_rank: int
    group_world_size: int
    world_size: int
    master_addr: str
    master_port: int
    members: tuple[str, ...] = ()


@dataclass(frozen=True)
class WorkerFailure:
    """One worker process that ended badly.

    Attributes:
        local_rank, rank: the worker's rank on this node and in the job.
        pid: its process id.
        exit_code: the exit status, or ``None`` when it died of a signal.
        signal: the signal's name (``"SIGKILL"``) when it died of one, else ``None``.
        message: the root cause, from the worker's error file when it wrote one, else the
            last line of the Python traceback it printed.
        timestamp: wall-clock time of the failure (seconds since the epoch); for a worker
            killed for a hang, the time of its last progress signal.
        stalled_seconds: set when the agent killed the worker for a hang (or by
            ``--watchdog-timeout``): how long it had made no progress; ``None`` otherwise.
        hang: for such a worker, the agent's one-line explanation: who made no progress,
            where the others waited, and where it was (``rank 3 made no progress for
            41 s while ranks 0-2 waited in all_reduce (train.py:88); rank 3 was at
            data.py:120 in read()``); ``None`` otherwise.
        out_of_memory: the kernel's out-of-memory killer killed it (its log named the
            pid, or its memory cgroup counted an OOM kill meanwhile).
    """

    local_rank: int
    rank: int
    pid: int
    exit_code: int | None
    signal: str | None = None
    message: str = ""
    timestamp: float = 0.0
    stalled_seconds: float | None = None
    out_of_memory: bool = False
    hang: str | None = None


@dataclass(frozen=True)
class Event:
    """One line of the event log and one message to every metrics sink.

    Attributes:
        name: what happened, one of the names at the top of this module.
        run: the run it happened in.
        data: details of the event; values are JSON-serialisable.
        wall_time: seconds since the epoch, for people and other hosts.
        monotonic: ``time.monotonic()``, for measuring durations on one host.
        subject: the record the event is about, typed: the ``RoundInfo`` of
            ``rendezvous_completed`` and ``workers_started``, the ``WorkerFailure`` of
            ``worker_failed``; ``None`` for the others. Its fields are in ``data`` too.
    """

    name: str
    run: RunInfo
    data: Mapping[str, Any] = field(default_factory=dict)
    wall_time: float = field(default_factory=time.time)
    monotonic: float = field(default_factory=time.monotonic)
    subject: RoundInfo | WorkerFailure | None = None

    @classmethod
    def of(
        cls, name: str, run: RunInfo, subject: RoundInfo | WorkerFailure | None = None, **data: Any
    ) -> Event:
        """The event ``name`` about ``subject``, whose fields go into ``data`` with the rest."""
        fields = dataclasses.asdict(subject) if subject is not None else {}
        return cls(name, run, {**fields, **data}, subject=subject)

    def to_json(self) -> str:
        """One compact JSON object, the format of the event log and the ``jsonl`` sink.
        The header (name, times, run, node) wins over a data field of the same name: a
        log's reader files each event under the node that wrote it."""
        record = {
            **self.data,
            "event": self.name,
            "wall_time": self.wall_time,
            "monotonic": self.monotonic,
            "run_id": self.run.run_id,
            "node": self.run.node_id,
            "host": self.run.hostname,
            "role": self.run.role,
        }
        return json.dumps(record, sort_keys=True, default=str)
