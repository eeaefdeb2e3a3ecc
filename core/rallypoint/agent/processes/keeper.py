"""The agent's side of its keeper (``rallypoint.agent.processes.keeper_server`` says what the keeper
is): start it, have it start workers and the preloaded interpreter, learn of their exits.

The keeper is the agent's child in a session of its own, and the two talk over a socket
pair (``rallypoint.agent.processes.wire``): the agent sends requests, each with an ``id`` its answer
carries back; the keeper also sends news unasked (a worker's exit, the preloaded
interpreter ready or gone), which ``Keeper.pump`` reads.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Collection, Sequence
from typing import Any

from rallypoint.agent.processes import wire, zygote
from rallypoint.agent.processes.subreaper import KILL_BOUND, become_subreaper, kill_children

#: How the keeper starts, in ``python -I -S -c BOOT FOLDER FD``: its module and the siblings
#: it imports, from FOLDER, as the package ``_rallypoint_keeper`` (``keeper_server`` says why).
BOOT = (
    "import sys, types; p = sys.modules['_rallypoint_keeper'] = types.ModuleType("
    "'_rallypoint_keeper'); p.__path__ = [sys.argv[1]]; "
    "from _rallypoint_keeper.keeper_server import main; main(int(sys.argv[2]))"
)
_FOLDER = os.path.dirname(os.path.abspath(__file__))  # keeper_server's too


class KeeperGone(Exception):
    """The keeper died: the workers it held died with it (their ``PR_SET_PDEATHSIG``)."""


class WarmRefused(Exception):
    """The preloaded interpreter did not fork a worker; the message says why, ``gone``
    whether it is because it died."""

    def __init__(self, message: str, gone: bool = False) -> None:
        super().__init__(message)
        self.gone = gone


class Keeper:
    """The agent's handle on its keeper: start workers, learn of their exits."""

    def __init__(self) -> None:
        become_subreaper()
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock = mine
        self.process = subprocess.Popen(
            # -I -S: nothing of the job's environment or site-packages; the stdlib is enough.
            [sys.executable, "-I", "-S", "-c", BOOT, _FOLDER, str(theirs.fileno())],
            pass_fds=[theirs.fileno()],
            start_new_session=True,  # a signal to the agent's group does not reach it
        )
        theirs.close()
        self.exits: dict[int, tuple[int, float]] = {}  # pid -> (returncode, when)
        #: The preloaded interpreter: None (not asked for), "preparing", "ready", "failed"
        #: or "died"; ``warm_reason`` says why in the last two cases.
        self.warm: str | None = None
        self.warm_reason = ""
        self._replies: dict[int, dict[str, Any]] = {}
        self._next_id = 0
        self._lock = threading.Lock()
        self.gone = False

    @property
    def fileno(self) -> int:
        """Readable when the keeper has news (a worker's exit), or died."""
        return self.sock.fileno()

    def spawn(
        self,
        argv: Sequence[str],
        env: dict[str, str],
        stdout: int,
        stderr: int,
        cpus: Collection[int] | None = None,
    ) -> int:
        """Start a worker, on ``cpus`` if given; its pid. ``OSError`` when it cannot be
        executed."""
        request: dict[str, Any] = {"op": "spawn", "argv": list(argv), "env": env}
        request["cwd"] = os.getcwd()
        if cpus is not None:
            request["cpus"] = sorted(cpus)
        reply = self._request(request, (stdout, stderr))
        if reply["op"] == "failed":
            raise OSError(reply["errno"], reply["message"], argv[0])
        return int(reply["pid"])

    def prepare(self, argv: Sequence[str], env: dict[str, str]) -> None:
        """Start the preloaded interpreter; ``warm`` says when it is ready (``pump``)."""
        request: dict[str, Any] = {"op": "prepare", "argv": list(argv), "env": env}
        request.update(cwd=os.getcwd(), socket_fd=zygote.SOCKET_FD)
        reply = self._request(request)
        self.warm = "preparing" if reply["op"] == "preparing" else "failed"
        self.warm_reason = "" if reply["op"] == "preparing" else str(reply["message"])

    def discard_warm(self, reason: str) -> None:
        """Stop the preloaded interpreter, for ``reason``; workers start cold from now on."""
        self._request({"op": "discard"})
        self.warm, self.warm_reason = "failed", reason

    def spawn_warm(
        self, worker: dict[str, Any], stdout: int, stderr: int, cpus: Collection[int] | None
    ) -> int:
        """Have the preloaded interpreter fork a worker (``rallypoint.agent.processes.zygote`` says
        what ``worker`` holds); its pid. ``WarmRefused`` when it did not."""
        request: dict[str, Any] = {"op": "spawn", "warm": True, **worker, "cwd": os.getcwd()}
        request["cpus"] = None if cpus is None else sorted(cpus)
        reply = self._request(request, (stdout, stderr))
        if reply["op"] == "refused":
            raise WarmRefused(reply["message"], bool(reply.get("gone")))
        return int(reply["pid"])

    def own(self, path: str) -> None:
        """Have the keeper remove the directory ``path`` if the agent dies first."""
        self._request({"op": "own", "path": path})

    def sweep(self, grace: float = 0.0) -> int:
        """Stop whatever the stopped workers left behind (SIGTERM, ``grace`` seconds, then
        SIGKILL); how many processes that was."""
        if not self.gone:
            with contextlib.suppress(KeeperGone):
                return int(self._request({"op": "sweep", "grace": grace})["killed"])
        # The keeper was killed: its orphans come to the agent, a subreaper too. Its socket
        # closes before the kernel hands its children on: reap it first, then they are ours.
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(KILL_BOUND)
        return kill_children(grace=grace)

    def pump(self, timeout: float = 0.0) -> None:
        """Read what the keeper sent within ``timeout`` seconds (0: only what is there)."""
        with self._lock:
            deadline = time.monotonic() + timeout
            while not self.gone:
                left = max(0.0, deadline - time.monotonic())
                readable, _, _ = select.select([self.sock], [], [], left)
                if not readable:
                    return
                self._read_one()
                timeout = 0.0
                deadline = time.monotonic()

    def release(self) -> None:
        """Tell the keeper to stop: it kills what is left below it (``close`` waits)."""
        with contextlib.suppress(OSError):
            self.sock.close()

    def close(self, timeout: float = 10.0) -> None:
        """Stop the keeper (it kills what is left below it) and wait for it."""
        self.release()
        try:
            code = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            code = self.process.wait()
        if code != 0:
            kill_children()  # a keeper that was killed left its orphans to us

    def _request(self, message: dict[str, Any], fds: Sequence[int] = ()) -> dict[str, Any]:
        with self._lock:
            if self.gone:
                raise KeeperGone(self.death())
            self._next_id += 1
            ident = message["id"] = self._next_id
            try:
                wire.send(self.sock, message, fds)
                while ident not in self._replies:
                    self._read_one()
                    if self.gone:
                        raise KeeperGone(self.death())
            except OSError:
                self.gone = True
                raise KeeperGone(self.death()) from None
            reply = self._replies.pop(ident)
        if reply["op"] == "error":
            raise RuntimeError(f"rallypoint's keeper: {reply['message']}")
        return reply

    def _read_one(self) -> None:
        try:
            received = wire.receive(self.sock)
        except (OSError, ValueError):
            received = None
        if received is None:
            self.gone = True
            return
        message, fds = received
        for fd in fds:
            os.close(fd)
        op = message["op"]
        if message.get("id") is not None:  # the answer to a request
            self._replies[int(message["id"])] = message
        elif op == "exited":
            self.exits[int(message["pid"])] = (int(message["returncode"]), float(message["at"]))
        elif op == "ready":
            self.warm = "ready"
        elif op == "unready":
            self.warm, self.warm_reason = "failed", str(message["message"])
        elif op == "zygote-exited" and self.warm in ("ready", "preparing"):  # else said why
            code = int(message["returncode"])
            self.warm = "died"
            self.warm_reason = f"the preloaded interpreter died ({_describe(code)})"

    def death(self) -> str:
        """What happened to the keeper, in a sentence."""
        code = self.process.poll()
        if code is None:
            # Its end of the socket closes as it dies, a moment before it can be reaped.
            with contextlib.suppress(subprocess.TimeoutExpired):
                code = self.process.wait(timeout=1)
        how = "is gone" if code is None else f"died ({_describe(code)})"
        return (
            f"rallypoint's keeper process (pid {self.process.pid}), which holds the workers, "
            f"{how}; its workers died with it"
        )


def _describe(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


class KeptProcess:
    """A worker started by the keeper, with the part of ``subprocess.Popen``'s interface
    the agent uses."""

    def __init__(self, keeper: Keeper, pid: int) -> None:
        self.keeper = keeper
        self.pid = pid
        self.returncode: int | None = None
        self.exited_at: float | None = None  # monotonic, from the keeper

    def poll(self) -> int | None:
        if self.returncode is None:
            self.keeper.pump()
            self._update()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            left = 1.0 if deadline is None else deadline - time.monotonic()
            if left <= 0:
                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0.0)
            self.keeper.pump(min(left, 1.0))
        return code

    def _update(self) -> None:
        found = self.keeper.exits.get(self.pid)
        if found is not None:
            self.returncode, self.exited_at = found
        elif self.keeper.gone:
            # PR_SET_PDEATHSIG killed it with the keeper.
            self.returncode, self.exited_at = -signal.SIGKILL, time.monotonic()
