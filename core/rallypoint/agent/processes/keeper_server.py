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

Warm start: asked to (``prepare``), the keeper also starts the preloaded interpreter
(``zygote``), and hands it the ``spawn`` requests marked ``warm``: it forks
the worker, and its answer and its workers' exits come back through the keeper. Such a
worker is the zygote's child, not the keeper's, but it dies with the zygote, which dies
with the keeper, and whatever it leaves behind comes to the keeper all the same.

The agent's side is ``rallypoint.agent.processes.keeper``, which starts this module in an isolated
interpreter without site-packages (``python -I -S -c BOOT FOLDER FD``): this module and its
siblings are stdlib-only and import each other relatively, so that BOOT can import them
from their folder as the package ``_rallypoint_keeper``. Imported as rallypoint's, with
site-packages, they would take the keeper's start-up from some 30 ms to 75 and add a
quarter to its memory (pluggy and rallypoint's own imports). Messages both ways are
``rallypoint.agent.processes.wire``'s; a ``spawn`` request carries the worker's stdout and stderr.
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import signal
import socket
import time
from typing import Any

# Relative: imported as _rallypoint_keeper's in the keeper process (see above).
from . import wire
from .subreaper import become_subreaper, die_with, ended_children, kill_children

#: The answer to a warm spawn the zygote can no longer give.
_ZYGOTE_GONE = {"op": "refused", "message": "the preloaded interpreter died", "gone": True}


class _Keeper:
    """The keeper's state: its socket to the agent, the workers it started, and the
    preloaded interpreter that forks warm ones (``zygote``), with the workers it forked."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.workers: set[int] = set()
        self.zygote: int | None = None  # the preloaded interpreter's pid, until reaped
        self.zygote_sock: socket.socket | None = None  # until it closes
        self.warm: set[int] = set()  # workers the zygote forked, not yet reported ended
        self.forwarded: set[int] = set()  # ids of the spawn requests it has not answered
        self.owned: list[str] = []  # directories to remove if the agent dies (``own``)
        self.wake_read, self.wake_write = os.pipe()
        os.set_blocking(self.wake_read, False)
        os.set_blocking(self.wake_write, False)
        self.poller = select.poll()

    def serve(self) -> None:
        signal.signal(signal.SIGCHLD, lambda signum, frame: None)
        signal.set_wakeup_fd(self.wake_write, warn_on_full_buffer=False)
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
            # Told to stop by someone else than the agent: the same as the agent gone.
            signal.signal(sig, lambda signum, frame: self.finish())
        self.poller.register(self.sock, select.POLLIN)
        self.poller.register(self.wake_read, select.POLLIN)
        while True:
            ready = {fd for fd, _ in self.poller.poll()}  # retried on EINTR (PEP 475)
            if self.wake_read in ready:
                with contextlib.suppress(BlockingIOError):
                    while os.read(self.wake_read, 512):
                        pass
                self.reap()
            if self.zygote_sock is not None and self.zygote_sock.fileno() in ready:
                self.relay(self.zygote_sock)
            if self.sock.fileno() in ready:
                try:
                    received = wire.receive(self.sock)
                except (OSError, ValueError):
                    received = None
                if received is None:  # the agent is gone, or closed us
                    self.finish()
                self.handle(*received)  # type: ignore[misc]

    def handle(self, message: dict[str, Any], fds: list[int]) -> None:
        op = message.get("op")
        reply: dict[str, Any] | None
        try:
            if op == "spawn" and message.get("warm"):
                reply = self.forward(message, fds)  # the zygote answers
            elif op == "spawn":
                reply = self.spawn(message, fds)
            elif op == "prepare":
                reply = self.prepare(message)
            elif op == "discard":
                self.stop_zygote()
                reply = {"op": "discarded"}
            elif op == "own":
                self.owned.append(str(message["path"]))
                reply = {"op": "owned"}
            elif op == "sweep":
                spare = [*self.workers, *([self.zygote] if self.zygote else [])]
                grace = float(message.get("grace", 0.0))
                reply = {"op": "swept", "killed": kill_children(spare, grace)}
                self.reap()
            else:
                reply = {"op": "error", "message": f"unknown request {op!r}"}
        except Exception as error:  # a bad request must not take the workers down
            reply = {"op": "error", "message": f"{type(error).__name__}: {error}"}
        finally:
            for fd in fds:
                os.close(fd)
        if reply is not None:
            reply["id"] = message.get("id")
            wire.send(self.sock, reply)

    def spawn(self, message: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        """Fork and exec one worker: a session of its own, SIGKILLed if the keeper dies,
        its stdout and stderr the descriptors given, stdin the agent's."""
        pid = _fork_exec(message, fds[0], fds[1])
        if isinstance(pid, str):
            code, _, reason = pid.partition(":")
            return {"op": "failed", "errno": int(code or 0), "message": reason}
        self.workers.add(pid)
        return {"op": "spawned", "pid": pid}

    def prepare(self, message: dict[str, Any]) -> dict[str, Any]:
        """Start the preloaded interpreter (``zygote``), on the keeper's own
        stdout and stderr, its socket on the descriptor it expects; it says when ready."""
        self.stop_zygote()
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            pid = _fork_exec(message, 1, 2, passed=(theirs.fileno(), message["socket_fd"]))
        finally:
            theirs.close()
        if isinstance(pid, str):
            mine.close()
            return {"op": "unready", "message": f"cannot start it: {pid.partition(':')[2]}"}
        self.zygote, self.zygote_sock = pid, mine
        self.poller.register(mine, select.POLLIN)
        return {"op": "preparing", "pid": pid}

    def forward(self, message: dict[str, Any], fds: list[int]) -> dict[str, Any] | None:
        """A warm worker: the zygote forks it and answers the agent (``relay``)."""
        if self.zygote_sock is None:
            return dict(_ZYGOTE_GONE)
        try:
            wire.send(self.zygote_sock, message, fds)
        except OSError:
            return dict(_ZYGOTE_GONE)
        self.forwarded.add(message["id"])
        return None

    def relay(self, sock: socket.socket) -> None:
        """Pass what the zygote says on to the agent; keep count of its workers."""
        try:
            received = wire.receive(sock)
        except (OSError, ValueError):
            received = None
        if received is None:  # it is exiting: reap() tells the agent how, once it has
            self.close_zygote_socket()
            return
        message, fds = received
        for fd in fds:
            os.close(fd)
        self.forwarded.discard(message.get("id"))
        if message.get("op") == "spawned":
            self.warm.add(int(message["pid"]))
        elif message.get("op") == "exited":
            if int(message["pid"]) not in self.warm:
                return  # reported already, by reap() after the zygote died
            self.warm.discard(int(message["pid"]))
        wire.send(self.sock, message)

    def stop_zygote(self) -> None:
        """Kill the zygote (its workers die with it: ``PR_SET_PDEATHSIG``); reaped later."""
        self.close_zygote_socket()
        if self.zygote is not None:
            with contextlib.suppress(OSError):
                os.kill(self.zygote, signal.SIGKILL)
            self.zygote = None

    def close_zygote_socket(self) -> None:
        """The zygote is gone or going: what it was asked and did not answer is refused."""
        if self.zygote_sock is not None:
            self.poller.unregister(self.zygote_sock)
            self.zygote_sock.close()
            self.zygote_sock = None
        for ident in sorted(self.forwarded):
            wire.send(self.sock, {**_ZYGOTE_GONE, "id": ident})
        self.forwarded.clear()

    def reap(self) -> None:
        """Collect every child that ended; tell the agent about its workers, and about the
        zygote (its workers, dying with it, come to the keeper: a subreaper)."""
        for pid, code in ended_children():
            if pid == self.zygote:
                # What it said before it ended goes first (why it could not preload).
                while (
                    self.zygote_sock is not None and select.select([self.zygote_sock], [], [], 0)[0]
                ):
                    self.relay(self.zygote_sock)
                self.stop_zygote()
                wire.send(self.sock, {"op": "zygote-exited", "returncode": code})
            elif pid in self.workers or pid in self.warm:
                self.workers.discard(pid)
                self.warm.discard(pid)
                wire.send(
                    self.sock,
                    {"op": "exited", "pid": pid, "returncode": code, "at": time.monotonic()},
                )

    def finish(self) -> None:
        """The agent is gone: nothing it started may stay, nor what it asked the keeper
        to remove (its memory checkpoints, which would hold shared memory until reboot)."""
        kill_children()
        for path in self.owned:
            shutil.rmtree(path, ignore_errors=True)
        os._exit(0)


def _fork_exec(
    message: dict[str, Any], stdout: int, stderr: int, passed: tuple[int, int] | None = None
) -> int | str:
    """Fork and exec ``message``'s argv in a session of its own, SIGKILLed if the keeper
    dies: its pid, or ``"errno:reason"`` when it could not be executed. ``passed``: a
    descriptor to keep open in it, and the number it gets there."""
    argv: list[str] = message["argv"]
    env: dict[str, str] = message["env"]
    cwd: str = message["cwd"]
    cpus: list[int] | None = message.get("cpus")
    errors_read, errors_write = os.pipe()  # close-on-exec: EOF once exec succeeded
    keeper = os.getpid()
    pid = os.fork()
    if pid == 0:  # the child, until exec
        try:
            for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
                signal.signal(sig, signal.SIG_DFL)
            signal.set_wakeup_fd(-1)
            os.setsid()
            die_with(keeper)
            os.dup2(stdout, 1)
            os.dup2(stderr, 2)
            keep = [errors_write]
            if passed is not None:
                os.dup2(passed[0], passed[1])  # inheritable
                keep.append(passed[1])
            for low, high in zip([2, *sorted(keep)], [*sorted(keep), 1 << 20], strict=True):
                os.closerange(low + 1, high)
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
        return failure.decode(errors="replace")
    return pid


def main(sock_fd: int) -> None:
    """Serve the agent over the socket on ``sock_fd`` until it goes, then kill every process
    below the keeper."""
    sock = socket.socket(fileno=sock_fd)
    os.set_inheritable(sock.fileno(), False)
    become_subreaper()
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        _Keeper(sock).serve()
    kill_children()
