"""An elastic training job for agent and membership faults: agents of one run id, each with
gloo workers running tests/workers/elastic_train.py (ElasticSampler batches, a checkpoint
through rallypoint.checkpoint every step), sharing one checkpoint directory."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fault_setups import Backend

from launch import assert_no_worker_left, events, kill, wait_for_text, worker

#: The text of a worker's step line at world size ``w``: ``f"{STEP} world={w} at="``.
STEP = " world="


@dataclass
class Node:
    """One agent of the job: its process and its log (events next to it, ``.jsonl``)."""

    name: str
    process: subprocess.Popen[str]
    log: Path

    def text(self) -> str:
        return self.log.read_text()

    def events(self, name: str) -> list[dict[str, Any]]:
        return events(self.log, name)

    def rounds_after(self, moment: float) -> list[dict[str, Any]]:
        """The rounds it completed after ``moment`` (wall time), oldest first."""
        return [e for e in self.events("rendezvous_completed") if e["wall_time"] > moment]

    def worker_pids(self) -> list[int]:
        """The pids of its newest workers."""
        return list(self.events("workers_started")[-1]["pids"])

    def wait_for_event(self, name: str, timeout: float = 60) -> dict[str, Any]:
        """Until it has logged an event ``name``; the first one."""
        deadline = time.monotonic() + timeout
        while not (found := self.events(name)):
            assert time.monotonic() < deadline, f"no {name} event:\n{self.text()}"
            time.sleep(0.05)
        return found[0]

    def wait_for_step(self, world: int, timeout: float = 60) -> None:
        """Until its workers have trained a step at world size ``world``."""
        wait_for_text(self.log, f"{STEP}{world} at=", timeout=timeout)

    def mark(self) -> int:
        """Where its log ends now, for ``wait_for_training``."""
        return len(self.text())

    def wait_for_training(self, world: int, since: int, timeout: float = 60) -> None:
        """Until its workers, started after the log's ``since`` mark, train at world size
        ``world`` (a step, or waiting before the job's last one)."""
        pattern = re.compile(rf"{STEP}{world} at=|holding rank=\d+ world={world}\n")
        deadline = time.monotonic() + timeout
        while not pattern.search(self.text()[since:]):
            assert time.monotonic() < deadline, (
                f"{self.name} never trained at world size {world}:\n{self.text()[since:]}"
            )
            time.sleep(0.05)


class ElasticJob:
    """Agents of run id ``job`` on ``backend``; each epoch of ``size`` samples in batches
    of ``batch`` per worker, one step every ``step_seconds``. The workers wait before the
    job's last step until ``release()``, so that a fault never comes too late, however
    slowly the machine runs."""

    def __init__(
        self,
        backend: Backend,
        tmp_path: Path,
        *,
        nnodes: str,
        size: int,
        batch: int,
        step_seconds: float,
        epochs: int = 1,
        nproc: int = 2,
        shutdown_timeout: float = 10,
        max_restarts: int | None = 3,
        options: tuple[str, ...] = (),
    ) -> None:
        self.backend = backend
        self.tmp_path = tmp_path
        self.nnodes = nnodes
        self.size, self.batch, self.epochs = size, batch, epochs
        self.step_seconds = step_seconds
        self.nproc = nproc
        self.shutdown_timeout = shutdown_timeout
        self.max_restarts = max_restarts
        self.options = options  # more agent options (before the script)
        self.out = tmp_path / "seen.json"  # in every worker's command line: the test's tag
        self.hold = tmp_path / "hold"
        self.hold.touch()  # the job does not end before the test calls release()
        self.nodes: list[Node] = []

    def start(self, name: str) -> Node:
        """Start an agent; a node restarted by its scheduler gets the same command line."""
        log = self.tmp_path / f"{name}.log"
        process = self.backend.start_agent(
            "job", self.nnodes,
            "--checkpoint-dir", str(self.tmp_path / "checkpoints"),
            "--shutdown-timeout", f"{self.shutdown_timeout:g}", *self.options,
            worker("elastic_train.py"), str(self.out),
            "--size", str(self.size), "--batch-size", str(self.batch),
            "--epochs", str(self.epochs), "--step-seconds", f"{self.step_seconds:g}",
            "--hold", str(self.hold),
            log=log, nproc=self.nproc, max_restarts=self.max_restarts,
        )  # fmt: skip
        node = Node(name, process, log)
        self.nodes.append(node)
        return node

    def start_together(self, *names: str) -> list[Node]:
        """Start agents at once, so that they meet in the first round (on c10d they race to
        host the store, and one does: see ``hosting``)."""
        with ThreadPoolExecutor(len(names)) as pool:
            return list(pool.map(self.start, names))

    def hosting(self) -> Node | None:
        """On c10d, the agent whose process listens on the store's port."""
        if self.backend.name != "c10d":
            return None
        inodes = _listening_inodes(self.backend.store_port)
        for node in self.nodes:
            if node.process.poll() is None and _has_socket(node.process.pid, inodes):
                return node
        raise AssertionError(f"no agent listens on port {self.backend.store_port}")

    def release(self) -> None:
        """Let the workers take the job's last step (they wait for this before it)."""
        self.hold.unlink(missing_ok=True)

    def report(self) -> dict[str, Any]:
        """What rank 0 wrote at the end: ``seen`` (per epoch), ``steps``, ``worlds``."""
        return dict(json.loads(self.out.read_text()))

    def assert_every_sample_once(self) -> dict[str, Any]:
        """Every epoch saw each sample once, counting the steps the job continued from."""
        report = self.report()
        assert len(report["seen"]) == self.epochs, report["seen"]
        for epoch, seen in enumerate(report["seen"]):
            counts = Counter(seen)
            repeated = sorted(i for i, n in counts.items() if n > 1)
            skipped = sorted(set(range(self.size)) - set(counts))
            assert not repeated and not skipped, (
                f"epoch {epoch}: repeated {repeated}, skipped {skipped}"
            )
        return report

    def assert_no_worker_left(self) -> None:
        assert_no_worker_left(f"elastic_train.py {self.out}")

    def close(self) -> None:
        kill(*(node.process for node in self.nodes))


def assert_no_restart_used(node: Node) -> None:
    """The node's workers were restarted for membership changes only, none counted as a
    restart: a node that died or left is not a failure of the others."""
    restarts = [(e["cause"], e["restart_count"]) for e in node.events("workers_restarted")]
    assert restarts and set(restarts) == {("membership", 0)}, restarts


def _listening_inodes(port: int) -> set[str]:
    """The inodes of the sockets listening on ``port`` (state 0A in /proc/net/tcp*)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with_header = Path(table).read_text().splitlines() if Path(table).exists() else []
        for line in with_header[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                inodes.add(inode)
    return inodes


def _has_socket(pid: int, inodes: set[str]) -> bool:
    try:
        descriptors = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return False
    for descriptor in descriptors:
        try:
            link = os.readlink(descriptor)
        except OSError:
            continue
        if link.startswith("socket:[") and link[len("socket:[") : -1] in inodes:
            return True
    return False
