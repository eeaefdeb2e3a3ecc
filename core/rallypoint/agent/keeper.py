"""The keeper: the process that holds a node's workers, so that none of them, nor anything
they start, outlives the agent.

``PR_SET_PDEATHSIG`` kills a worker when its parent dies, but not the processes the worker
started (a data loader's pool, ``subprocess.Popen``, a daemon that double-forked and called
``setsid``): those are re-parented to init and live on. So the agent does not start workers
itself. It starts one keeper, a small stdlib-only Python process in a session of its own,
which is a child subreaper (``PR_SET_CHILD_SUBREAPER``): every process the workers start
that loses its parent is re-parented to the keeper, not to init, wherever it moved its
session or process group. The keeper forks and execs the workers on the agent's behalf,
reports their exits, and, when asked (a worker group stopped) or when the agent is gone
(its end of the keeper's socket closed, however the agent died, SIGKILL included), kills
every process below it until none is left, then, in the second case, exits.

The agent is a subreaper too: if the keeper itself is killed, what it held comes to the
agent, which kills it (``kill_children``).

What escapes: a process started outside this tree on the job's behalf (by a system service
such as ``systemd-run`` or an ``ssh`` to another host), and a process below the keeper that
makes itself a subreaper and outlives it. When the agent and the keeper are SIGKILLed at
the same moment, nothing is left to clean up: a container or a cgroup of the job's own (as
Kubernetes and Slurm give each job) is the last line there.

The wire format, both ways, is a 4-byte big-endian length and a JSON object; a ``spawn``
request carries the worker's stdout and stderr as file descriptors (``SCM_RIGHTS``).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Collection, Sequence
from typing import Any

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_HEADER = struct.Struct(">I")
#: How long killing everything below a process may take before it gives up on stragglers
#: (a process stuck in the kernel); SIGKILL needs milliseconds otherwise.
_KILL_BOUND = 5.0


def _prctl(option: int, value: int) -> bool:
    """``prctl(option, value)``; whether it took effect (False off Linux)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(option, value, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


def become_subreaper() -> bool:
    """Make orphaned descendants of this process its children, not init's."""
    return _prctl(_PR_SET_CHILD_SUBREAPER, 1)


# --- messages ---------------------------------------------------------------------------


def send(sock: socket.socket, message: dict[str, Any], fds: Sequence[int] = ()) -> None:
    body = json.dumps(message).encode()
    frame = _HEADER.pack(len(body)) + body
    if fds:
        socket.send_fds(sock, [frame], list(fds))
    else:
        sock.sendall(frame)


def receive(sock: socket.socket) -> tuple[dict[str, Any], list[int]] | None:
    """The next message and the descriptors it carried; None when the other end closed."""
    data, fds, _flags, _addr = socket.recv_fds(sock, _HEADER.size, 4)
    for fd in fds:
        os.set_inheritable(fd, False)
    if not data:
        return None
    data += _read_exactly(sock, _HEADER.size - len(data))
    (length,) = _HEADER.unpack(data)
    message: dict[str, Any] = json.loads(_read_exactly(sock, length))
    return message, fds


def _read_exactly(sock: socket.socket, count: int) -> bytes:
    chunks = []
    while count > 0:
        chunk = sock.recv(count)
        if not chunk:
            raise EOFError("the keeper's socket closed mid-message")
        chunks.append(chunk)
        count -= len(chunk)
    return b"".join(chunks)


# --- killing everything below a process -------------------------------------------------


def _children(pid: int) -> list[int]:
    """The children of ``pid``, from /proc."""
    found: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as handle:
                found += [int(child) for child in handle.read().split()]
        except OSError:
            continue
    return found


def kill_children(spare: Sequence[int] = ()) -> int:
    """SIGKILL every descendant of this process (a subreaper: the orphans come back to it)
    but ``spare``, with their process groups, and reap them; the number killed.

    Killing a child orphans its own children, which the kernel hands to this process: so
    it goes round until no child is left, bounded by ``_KILL_BOUND`` seconds."""
    me = os.getpid()
    killed: set[int] = set()
    deadline = time.monotonic() + _KILL_BOUND
    while time.monotonic() < deadline:
        children = [child for child in _children(me) if child not in spare]
        if not children:
            break
        for child in children:
            with contextlib.suppress(OSError):
                group = os.getpgid(child)
                if group != os.getpgrp():
                    os.killpg(group, signal.SIGKILL)
            with contextlib.suppress(OSError):
                os.kill(child, signal.SIGKILL)
            killed.add(child)
        for child in children:
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitpid(child, 0)
    return len(killed)


# --- the keeper process -------------------------------------------------------------------


class _Keeper:
    """The keeper's state: its socket to the agent and the workers it started."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.workers: set[int] = set()
        self.wake_read, self.wake_write = os.pipe()
        os.set_blocking(self.wake_read, False)
        os.set_blocking(self.wake_write, False)

    def serve(self) -> None:
        signal.signal(signal.SIGCHLD, lambda signum, frame: None)
        signal.set_wakeup_fd(self.wake_write, warn_on_full_buffer=False)
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
            # Told to stop by someone else than the agent: the same as the agent gone.
            signal.signal(sig, lambda signum, frame: self.finish())
        poller = select.poll()
        poller.register(self.sock, select.POLLIN)
        poller.register(self.wake_read, select.POLLIN)
        while True:
            ready = {fd for fd, _ in poller.poll()}  # retried on EINTR (PEP 475)
            if self.wake_read in ready:
                with contextlib.suppress(BlockingIOError):
                    while os.read(self.wake_read, 512):
                        pass
                self.reap()
            if self.sock.fileno() in ready:
                try:
                    received = receive(self.sock)
                except (OSError, EOFError, ValueError):
                    received = None
                if received is None:  # the agent is gone, or closed us
                    self.finish()
                self.handle(*received)  # type: ignore[misc]

    def handle(self, message: dict[str, Any], fds: list[int]) -> None:
        op = message.get("op")
        try:
            if op == "spawn":
                reply = self.spawn(message, fds)
            elif op == "sweep":
                reply = {"op": "swept", "killed": kill_children(spare=tuple(self.workers))}
                self.reap()
            else:
                reply = {"op": "error", "message": f"unknown request {op!r}"}
        except Exception as error:  # a bad request must not take the workers down
            reply = {"op": "error", "message": f"{type(error).__name__}: {error}"}
        finally:
            for fd in fds:
                os.close(fd)
        reply["id"] = message.get("id")
        send(self.sock, reply)

    def spawn(self, message: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        """Fork and exec one worker: a session of its own, SIGKILLed if the keeper dies,
        its stdout and stderr the descriptors given, stdin the agent's."""
        argv: list[str] = message["argv"]
        env: dict[str, str] = message["env"]
        cwd: str = message["cwd"]
        cpus: list[int] | None = message.get("cpus")
        stdout, stderr = fds
        errors_read, errors_write = os.pipe()  # close-on-exec: EOF once exec succeeded
        keeper = os.getpid()
        pid = os.fork()
        if pid == 0:  # the worker, until exec
            try:
                for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
                    signal.signal(sig, signal.SIG_DFL)
                signal.set_wakeup_fd(-1)
                os.setsid()
                _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
                if os.getppid() != keeper:  # the keeper died before prctl took effect
                    os._exit(1)
                os.dup2(stdout, 1)
                os.dup2(stderr, 2)
                os.closerange(3, errors_write)
                os.closerange(errors_write + 1, 1 << 20)
                os.chdir(cwd)
                if cpus is not None:  # --numa-binding; kept across exec, by every thread
                    os.sched_setaffinity(0, cpus)
                os.execvpe(argv[0], argv, env)
            except OSError as error:
                os.write(errors_write, f"{error.errno}:{error.strerror}".encode())
            finally:
                os._exit(127)
        os.close(errors_write)
        failure = b""
        while chunk := os.read(errors_read, 4096):
            failure += chunk
        os.close(errors_read)
        if failure:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
            code, _, reason = failure.decode(errors="replace").partition(":")
            return {"op": "failed", "errno": int(code or 0), "message": reason}
        self.workers.add(pid)
        return {"op": "spawned", "pid": pid}

    def reap(self) -> None:
        """Collect every child that ended; tell the agent about its workers."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if pid in self.workers:
                self.workers.discard(pid)
                send(
                    self.sock,
                    {
                        "op": "exited",
                        "pid": pid,
                        "returncode": os.waitstatus_to_exitcode(status),
                        "at": time.monotonic(),
                    },
                )

    def finish(self) -> None:
        """The agent is gone: nothing it started may stay."""
        kill_children()
        os._exit(0)


def main(argv: Sequence[str]) -> None:
    sock = socket.socket(fileno=int(argv[1]))
    os.set_inheritable(sock.fileno(), False)
    become_subreaper()
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        _Keeper(sock).serve()
    kill_children()


# --- the agent's side ---------------------------------------------------------------------


class KeeperGone(Exception):
    """The keeper died: the workers it held died with it (their ``PR_SET_PDEATHSIG``)."""


class Keeper:
    """The agent's handle on its keeper: start workers, learn of their exits."""

    def __init__(self) -> None:
        become_subreaper()
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock = mine
        self.process = subprocess.Popen(
            [sys.executable, "-I", "-S", os.path.abspath(__file__), str(theirs.fileno())],
            pass_fds=[theirs.fileno()],
            start_new_session=True,  # a signal to the agent's group does not reach it
        )
        theirs.close()
        self.exits: dict[int, tuple[int, float]] = {}  # pid -> (returncode, when)
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

    def sweep(self) -> int:
        """Kill whatever the stopped workers left behind; how many processes that was."""
        if not self.gone:
            with contextlib.suppress(KeeperGone):
                return int(self._request({"op": "sweep"})["killed"])
        # The keeper was killed: its orphans come to the agent, a subreaper too. Its socket
        # closes before the kernel hands its children on: reap it first, then they are ours.
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(_KILL_BOUND)
        return kill_children()

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

    def close(self, timeout: float = 10.0) -> None:
        """Stop the keeper (it kills what is left below it) and wait for it."""
        with contextlib.suppress(OSError):
            self.sock.close()
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
                send(self.sock, message, fds)
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
            received = receive(self.sock)
        except (OSError, EOFError, ValueError):
            received = None
        if received is None:
            self.gone = True
            return
        message, fds = received
        for fd in fds:
            os.close(fd)
        if message["op"] == "exited":
            self.exits[int(message["pid"])] = (int(message["returncode"]), float(message["at"]))
        else:
            self._replies[int(message["id"])] = message

    def death(self) -> str:
        """What happened to the keeper, in a sentence."""
        code = self.process.poll()
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


if __name__ == "__main__":
    main(sys.argv)
