"""``make demo``: an elastic job of two nodes on this machine, over the built-in ``c10d``
backend, that grows when a node arrives and goes on when one dies.

    python examples/elastic_demo.py [--dir .demo]

Both nodes run the same command: ``rallypoint run --nnodes 1:2 --nproc-per-node 2
--rdzv-backend c10d ... examples/train_digits.py``. Node a starts alone and trains at
world size 2 (its agent hosts the rendezvous store). Node b starts and gets ready beside
the running job (its preloaded interpreter imports torch and scikit-learn, it fetches the
newest memory checkpoint) while node a trains on; then both nodes stop their workers, meet
again and go on from the newest checkpoint at world size 4, a fraction of a second later. Then node b's
agent is SIGKILLed, as when its machine dies: its workers die with it, node a's workers
lose their peers, and node a goes on alone at world size 2 from the newest checkpoint,
once node b's heartbeat is overdue, and finishes. Neither change uses up a restart. The
workers save a checkpoint every step, to node memory (``--checkpoint-memory``): node a
resumes from its memory, and the demo says how many steps that lost.

Each line is shown with the node it comes from; the workers' logs, the checkpoints and
each node's event log are left under ``--dir``. Every wait is bounded: a step that does not
happen in time stops both nodes and exits 1 with what was awaited.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
#: The longest any one step of the demo may take (starting workers on a busy 2-CPU machine
#: takes a few seconds).
STEP_TIMEOUT = 120.0
HEARTBEAT_TIMEOUT = 5  # seconds after its last heartbeat that a node counts as dead
NODES = ("a", "b")


class DemoFailed(Exception):
    """The demo cannot go on; the message says why (a step that did not come in time, say)."""


class Node:
    """One agent, its output shown line by line with the node's name and kept to wait on."""

    def __init__(self, name: str, command: list[str]) -> None:
        self.name = name
        self.lines: list[str] = []
        self._changed = threading.Condition()
        self.process = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # Ctrl-C reaches the demo, which stops the nodes itself
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            print(f"node {self.name} | {line}", end="", flush=True)
            with self._changed:
                self.lines.append(line)
                self._changed.notify_all()

    def wait_for(self, text: str, after: int = 0) -> int:
        """The index of the first line from ``after`` on that contains ``text``."""
        deadline = time.monotonic() + STEP_TIMEOUT
        with self._changed:
            while True:
                for index in range(after, len(self.lines)):
                    if text in self.lines[index]:
                        return index
                if self.process.poll() is not None and not self._reader.is_alive():
                    raise DemoFailed(
                        f"node {self.name} exited ({self.process.returncode}) before printing "
                        f"{text!r}"
                    )
                left = deadline - time.monotonic()
                if left <= 0:
                    raise DemoFailed(
                        f"node {self.name} did not print {text!r} within {STEP_TIMEOUT:g} s"
                    )
                self._changed.wait(min(left, 1.0))

    def exit_code(self) -> int:
        try:
            code = self.process.wait(timeout=STEP_TIMEOUT)
        except subprocess.TimeoutExpired:
            raise DemoFailed(f"node {self.name} did not finish within {STEP_TIMEOUT:g} s") from None
        self._reader.join(timeout=5)
        return code

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after the agent's shutdown time; its workers go with it."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=45)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def rallypoint_command() -> str:
    """The ``rallypoint`` of the interpreter running the demo (its virtual environment)."""
    beside = Path(sys.executable).parent / "rallypoint"
    found = str(beside) if beside.exists() else shutil.which("rallypoint")
    if found is None:
        raise DemoFailed("rallypoint is not installed: run `make demo`, or pip install -e .")
    return found


def node_command(name: str, directory: Path, port: int) -> list[str]:
    return [
        rallypoint_command(), "run",
        "--nnodes", "1:2", "--nproc-per-node", "2",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
        "--rdzv-id", "digits-demo",
        "--rdzv-conf", f"last_call_timeout=1,heartbeat_timeout={HEARTBEAT_TIMEOUT}",
        "--redirects", "2", "--log-dir", str(directory / "logs" / name),
        "--checkpoint-dir", str(directory / "checkpoints"), "--checkpoint-memory", "64MB",
        "--event-log", str(directory / f"events-{name}.jsonl"),
        # The script imports scikit-learn too: preloaded, no worker pays for its import.
        "--preload", "sklearn.datasets,sklearn.model_selection",
        str(HERE / "train_digits.py"), "--save-every", "1", "--log-every", "25",
        "--step-seconds", "0.05",
    ]  # fmt: skip


def events(event_log: Path, name: str) -> list[dict[str, Any]]:
    """The events called ``name`` in a node's event log, in order."""
    lines = event_log.read_text().splitlines() if event_log.exists() else []
    return [event for event in map(json.loads, lines) if event.get("event") == name]


def steps_lost(event_log: Path, killed: float) -> str:
    """Where node a resumed from after node b was killed, and how many steps that lost: the
    newest step its workers had saved (a save every step, to memory) against the step
    loaded."""
    restarted = min(
        e["wall_time"] for e in events(event_log, "workers_restarted") if e["wall_time"] > killed
    )
    saved = max(
        e["step"] for e in events(event_log, "checkpoint_saved") if e["wall_time"] < restarted
    )
    loaded = next(e for e in events(event_log, "checkpoint_loaded") if e["wall_time"] > restarted)
    lost = saved - loaded["step"]
    return (
        f"node a resumed from {loaded['source']}, {lost} step{'' if lost == 1 else 's'} lost "
        f"(its workers had saved step {saved} when node b was lost; resumed at {loaded['step']})"
    )


def join_pause(event_log: Path) -> str:
    """How long node b's join held node a's training up: from its workers' last save before
    the round changed to their first after it (a save every step)."""
    changed = events(event_log, "workers_restarted")[0]["wall_time"]
    saves = [e["wall_time"] for e in events(event_log, "checkpoint_saved")]
    before = max(t for t in saves if t < changed)
    after = min(t for t in saves if t > changed)
    return (
        f"node b's join paused node a for {after - before:.2f} s (node b got ready beside "
        "the running job first)"
    )


def still_running(pids: list[int]) -> list[int]:
    """Those of ``pids`` that still run, after a few seconds' grace (a zombie has ended)."""
    deadline = time.monotonic() + 10
    while True:
        running = []
        for pid in pids:
            try:
                status = Path(f"/proc/{pid}/status").read_text()
            except OSError:
                continue
            if "\nState:\tZ" not in status:
                running.append(pid)
        if not running or time.monotonic() > deadline:
            return running
        time.sleep(0.1)


def prepare(directory: Path) -> None:
    """Clear what an earlier demo left in ``directory`` (and nothing else): a fresh job must
    not resume from its checkpoints."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        for name in ("logs", "checkpoints"):
            shutil.rmtree(directory / name, ignore_errors=True)
        for name in NODES:
            (directory / f"events-{name}.jsonl").unlink(missing_ok=True)
    except OSError as error:
        raise DemoFailed(f"cannot use {directory} for the demo's files: {error.strerror}") from None


def run(directory: Path) -> int:
    nodes: list[Node] = []
    killed = 0.0  # when node b was killed (wall time)
    try:
        prepare(directory)
        port = free_port()
        a = Node("a", node_command("a", directory, port))
        nodes.append(a)
        # The workers' lines: "learning rate ... x world size N" once they train at N (the
        # agent's own round lines name the world size too, before the workers start).
        seen = a.wait_for("per worker x world size 2")
        print("demo: node a trains alone; starting node b", flush=True)
        b = Node("b", node_command("b", directory, port))
        nodes.append(b)
        seen = a.wait_for("per worker x world size 4", seen)
        # Two loss lines, 25 steps apart: training at world size 4 is under way.
        seen = a.wait_for(" loss ", a.wait_for(" loss ", seen) + 1)
        print("demo: both nodes train at world size 4; killing node b (SIGKILL)", flush=True)
        killed = time.time()
        b.process.kill()
        b.exit_code()
        seen = a.wait_for("per worker x world size 2", seen)
        code = a.exit_code()
        if code != 0:
            raise DemoFailed(f"node a exited {code}")
    except DemoFailed as failure:
        print(f"demo failed: {failure}", file=sys.stderr, flush=True)
        return 1
    finally:
        for node in nodes:
            node.stop()
    logs = [directory / f"events-{node.name}.jsonl" for node in nodes]
    sizes = [e["world_size"] for e in events(logs[0], "rendezvous_completed")]
    pids = [pid for log in logs for e in events(log, "workers_started") for pid in e["pids"]]
    left = still_running(pids)
    if left:
        print(f"demo failed: workers {left} outlived their agents", file=sys.stderr, flush=True)
        return 1
    print(f"demo: {join_pause(logs[0])}", flush=True)
    print(f"demo: {steps_lost(logs[0], killed)}", flush=True)
    print(
        f"demo done: node a trained at world sizes {', '.join(map(str, sizes))} and finished; "
        f"none of the {len(pids)} workers started is left running. The workers' logs, the "
        f"checkpoints and each node's event log are under {directory}/",
        flush=True,
    )
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=Path(".demo"), help="where it all goes")
    args = parser.parse_args()
    # The agents' output comes through pipes: unbuffered, each line is shown as it is printed.
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        sys.exit(run(args.dir))
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
