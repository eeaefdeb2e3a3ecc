"""Failure reports: which worker failed first, how, and the traceback it left.

The root cause is the worker that failed first, not counting workers whose last words say
a peer failed (gloo's "Connection closed by peer", NCCL's aborted communicator). Exit
times alone mislead: a worker that
raises may spend a while finalising (closing its process group) while a peer notices the
closed connection, raises and exits first. So a failure is dated by the moment the worker
began printing a Python traceback, else by its exit; error-file timestamps (whole seconds)
are too coarse to order failures moments apart. Where a worker left no error file, the
last lines it wrote to stderr stand in for the traceback, so a plain uncaught exception is
reported without ``@record``.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import socket
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rallypoint.agent.processes.workers import Worker
from rallypoint.events import WorkerFailure

logger = logging.getLogger("rallypoint.agent")


@dataclass(frozen=True)
class FailureReport:
    """Everything known about the failures of one attempt."""

    run_id: str
    host: str
    restart_count: int
    max_restarts: int
    root: WorkerFailure
    traceback: str
    failures: tuple[WorkerFailure, ...]
    error_file: str = ""  # the root cause's TORCHELASTIC_ERROR_FILE
    #: Nodes of the round that were lost (no heartbeat) when its workers failed: the
    #: first cause, the workers' errors ("Connection closed by peer") its consequence.
    lost_nodes: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "host": self.host,
            "restart_count": self.restart_count,
            "max_restarts": self.max_restarts,
            "root_cause": {**asdict(self.root), "traceback": self.traceback},
            "lost_nodes": list(self.lost_nodes),
            "failures": [asdict(failure) for failure in self.failures],
        }

    def summary(self) -> str:
        """A few lines for people: the root cause first, its traceback, then the rest."""
        root = self.root
        lines = [
            f"workers failed in run {self.run_id} "
            f"(attempt {self.restart_count}, --max-restarts {self.max_restarts})",
        ]
        if self.lost_nodes:
            lines.append(
                f"  root cause: node {', '.join(self.lost_nodes)} of the round was lost (no "
                "heartbeat); this node's workers failed after it:"
            )
        lines.append(
            f"  {'then' if self.lost_nodes else 'root cause'}: rank {root.rank} (local rank "
            f"{root.local_rank}) on {self.host}, pid {root.pid}: {describe_exit(root)}"
        )
        if root.message:
            lines.append(f"  error: {root.message}")
        if self.traceback:
            lines.append("  traceback:")
            lines += ["    " + line for line in self.traceback.rstrip().splitlines()]
        for other in self.failures:
            if other is not root:
                lines.append(f"  also: rank {other.rank}: {describe_exit(other)}")
        return "\n".join(lines)

    def write(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n", encoding="utf-8")

    def write_parent_error_file(self, path: str) -> None:
        """The root cause in torchrun's parent error file (``TORCHELASTIC_ERROR_FILE`` of
        the launcher, read by TorchX and job operators): the worker's own error file with
        its exit code as ``errorCode``, as torchrun copies it; or, when the worker wrote
        none, a record in the same format made from its exit and its last stderr lines."""
        root = self.root
        code = root.exit_code if root.exit_code is not None else -_signal_number(root.signal)
        data = _load(self.error_file)
        if data is None:
            data = {
                "message": {
                    "message": root.message or describe_exit(root),
                    "extraInfo": {
                        "py_callstack": self.traceback,
                        "timestamp": str(int(root.timestamp)),
                    },
                    "errorCode": code,
                }
            }
        elif isinstance(data.get("message"), dict) and code:
            data["message"]["errorCode"] = code
        write_error_record(path, data)


def write_error_record(path: str, data: dict[str, Any]) -> None:
    """Write a torch-format error record to ``path``; a path that cannot be written is
    warned about, never fatal (torchrun does the same)."""
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(data), encoding="utf-8")
    except OSError as error:
        logger.warning("cannot write the error file %s: %s", path, error.strerror)


def _signal_number(name: str | None) -> int:
    try:
        return int(signal.Signals[name or ""])
    except KeyError:  # "signal 77": a number with no name
        digits = (name or "").removeprefix("signal ")
        return int(digits) if digits.isdigit() else 0


def describe_exit(failure: WorkerFailure) -> str:
    if failure.hang:
        return f"killed for a hang: {failure.hang}"
    if failure.stalled_seconds is not None:
        return f"made no progress for {failure.stalled_seconds:.1f} s (watchdog)"
    if failure.signal:
        return f"killed by {failure.signal}" + (" (out of memory)" if failure.out_of_memory else "")
    return f"exit code {failure.exit_code}"


def describe_failure(failure: WorkerFailure) -> str:
    """One line: how the worker ended and, when known, the error it raised.

    A worker can raise and then die of a signal while exiting (a collective library's
    background thread aborting the interpreter's shutdown): the error says why it failed.
    """
    described = describe_exit(failure)
    if failure.message:
        message = " ".join(failure.message.split())
        if len(message) > _MESSAGE_WIDTH:
            message = message[: _MESSAGE_WIDTH - 3] + "..."
        described += f" ({message})"
    return described


_MESSAGE_WIDTH = 160


def failure_of(worker: Worker, wall_time: float, out_of_memory: bool = False) -> WorkerFailure:
    """Describe a worker that ended with a non-zero status, failing at ``wall_time``;
    ``out_of_memory``: the kernel said its OOM killer killed it."""
    code = worker.returncode
    signal_name = None
    if code is not None and code < 0:
        try:
            signal_name = signal.Signals(-code).name
        except ValueError:
            signal_name = f"signal {-code}"
    return WorkerFailure(
        local_rank=worker.spec.local_rank,
        rank=worker.spec.rank,
        pid=worker.pid,
        exit_code=None if signal_name else code,
        signal=signal_name,
        message=_read_message(worker.spec.error_file) or exception_line(worker.stderr_tail),
        timestamp=wall_time,
        stalled_seconds=None if worker.stalled_for is None else round(worker.stalled_for, 3),
        out_of_memory=out_of_memory,
        hang=worker.hang,
    )


#: What a worker prints when it fails only because a peer did (gloo, NCCL): such a failure
#: is a consequence, never the root cause, whatever the timing says.
PEER_FAILURE_MARKERS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "remote worker crashing",
    "NCCL communicator was aborted",
    "remote process exited or there was a network error",
)


#: torch.distributed prefixes what an uncaught exception prints with the rank.
_RANK_PREFIX = re.compile(r"^\[rank\d+\]: ")


def exception_line(lines: Iterable[str]) -> str:
    """The ``Type: message`` line that ends the last Python traceback in ``lines``, if any."""
    found = ""
    in_traceback = False
    for line in (_RANK_PREFIX.sub("", line, count=1) for line in lines):
        if line.startswith("Traceback (most recent call last)"):
            in_traceback, found = True, ""
        elif in_traceback and line.strip() and not line[0].isspace():
            found, in_traceback = line.strip(), False
    return found


def caused_by_peer(worker: Worker) -> bool:
    return any(marker in line for line in worker.stderr_tail for marker in PEER_FAILURE_MARKERS)


def build_report(
    workers: list[Worker],
    failures: list[WorkerFailure],
    *,
    run_id: str,
    restart_count: int,
    max_restarts: int,
) -> FailureReport:
    by_rank = {w.spec.local_rank: w for w in workers}
    primary = [f for f in failures if not caused_by_peer(by_rank[f.local_rank])]
    root = min(primary or failures, key=lambda f: f.timestamp)
    worker = by_rank[root.local_rank]
    trace = _read_traceback(worker.spec.error_file) or worker.stack or "".join(worker.stderr_tail)
    return FailureReport(
        run_id=run_id,
        host=socket.gethostname(),
        restart_count=restart_count,
        max_restarts=max_restarts,
        root=root,
        traceback=trace,
        failures=tuple(failures),
        error_file=worker.spec.error_file,
    )


def _load(path: str) -> dict[str, Any] | None:
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _read_message(path: str) -> str:
    """The message a worker wrote to its error file (torch's format), if it wrote one."""
    data = _load(path)
    message = data.get("message") if data else None
    if isinstance(message, dict):
        return str(message.get("message", ""))
    return str(message or "")


def _read_traceback(path: str) -> str:
    data = _load(path)
    message = data.get("message") if data else None
    if isinstance(message, dict):
        return str((message.get("extraInfo") or {}).get("py_callstack", ""))
    return ""
