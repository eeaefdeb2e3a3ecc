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
(``rallypoint.agent.zygote``), and hands it the ``spawn`` requests marked ``warm``: it forks
the worker, and its answer and its workers' exits come back through the keeper. Such a
worker is the zygote's child, not the keeper's, but it dies with the zygote, which dies
with the keeper, and whatever it leaves behind comes to the keeper all the same.

The wire format, both ways, is a 4-byte big-endian length and a JSON object; a ``spawn``
request carries the worker's stdout and stderr as file descriptors (``SCM_RIGHTS``).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Collection, Sequence
from typing import Any

try:
    from rallypoint.agent import zygote
except ImportError:  # the keeper process (python -I -S keeper.py): its sibling, by path
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import zygote  # type: ignore[import-not-found,no-redef]

_PR_SET_CHILD_SUBREAPER = 36
_HEADER = struct.Struct(">I")
#: The answer to a warm spawn the zygote can no longer give.
_ZYGOTE_GONE = {"op": "refused", "message": "the preloaded interpreter died", "gone": True}
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


def _ended(pid: int) -> bool:
    """Whether ``pid`` is a zombie: it exited, and only waits to be reaped."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            return handle.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    except (OSError, IndexError):
        return False


def kill_children(spare: Sequence[int] = (), grace: float = 0.0) -> int:
    """Stop every descendant of this process (a subreaper: the orphans come back to it)
    but ``spare``, with their process groups, and reap them; the number stopped.

    With ``grace``, each first gets SIGTERM and up to ``grace`` seconds to exit, as
    ``multiprocessing``'s helpers need: a resource tracker unlinks the semaphores and shared
    memory its process left once that process is gone, then exits (it ignores SIGTERM).
    Then SIGKILL. Killing a child orphans its own children, which the kernel hands to this
    process: so each stage goes round until no child is left, the second bounded by
    ``_KILL_BOUND`` seconds."""
    me = os.getpid()
    stopped: set[int] = set()
    if grace > 0:
        _terminate_children(me, spare, time.monotonic() + grace, stopped)
    deadline = time.monotonic() + _KILL_BOUND
    while time.monotonic() < deadline:
        children = [child for child in _children(me) if child not in spare]
        if not children:
            break
        for child in children:
            if _ended(child):  # it exited on its own (a checkpoint writer): only reap it
                with contextlib.suppress(ChildProcessError, OSError):
                    os.waitpid(child, 0)
                continue
            _signal_with_group(child, signal.SIGKILL)
            stopped.add(child)
        for child in children:
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitpid(child, 0)
    return len(stopped)


def _terminate_children(me: int, spare: Sequence[int], deadline: float, stopped: set[int]) -> None:
    """SIGTERM each child of ``me`` but ``spare`` once, reaping those that exit, until
    none is left or ``deadline``; woken by each exit (a pidfd per child)."""
    pidfds: dict[int, int] = {}
    try:
        while True:
            live = []
            for child in _children(me):
                if child in spare:
                    continue
                if _ended(child):
                    with contextlib.suppress(ChildProcessError, OSError):
                        os.waitpid(child, 0)
                    continue
                live.append(child)
                if child not in pidfds:
                    with contextlib.suppress(OSError):
                        pidfds[child] = os.pidfd_open(child)
                    _signal_with_group(child, signal.SIGTERM)
                    stopped.add(child)
            left = deadline - time.monotonic()
            if not live or left <= 0:
                return
            # Also wakes now and then for orphans handed over meanwhile (no event of ours).
            watched = [pidfds[child] for child in live if child in pidfds]
            select.select(watched, [], [], min(left, 0.05))
    finally:
        for fd in pidfds.values():
            os.close(fd)


def _signal_with_group(pid: int, sig: signal.Signals) -> None:
    """Signal ``pid`` and, unless it is this process's, its process group."""
    with contextlib.suppress(OSError):
        group = os.getpgid(pid)
        if group != os.getpgrp():
            os.killpg(group, sig)
    with contextlib.suppress(OSError):
        os.kill(pid, sig)


# --- the keeper process -------------------------------------------------------------------


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
                    received = receive(self.sock)
                except (OSError, EOFError, ValueError):
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
            send(self.sock, reply)

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
        """Start the preloaded interpreter (``rallypoint.agent.zygote``), on the keeper's own
        stdout and stderr, its socket on the descriptor it expects; it says when ready."""
        self.stop_zygote()
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
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
            zygote.send(self.zygote_sock, message, fds)
        except OSError:
            return dict(_ZYGOTE_GONE)
        self.forwarded.add(message["id"])
        return None

    def relay(self, sock: socket.socket) -> None:
        """Pass what the zygote says on to the agent; keep count of its workers."""
        try:
            received = zygote.receive(sock)
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
        send(self.sock, message)

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
            send(self.sock, {**_ZYGOTE_GONE, "id": ident})
        self.forwarded.clear()

    def reap(self) -> None:
        """Collect every child that ended; tell the agent about its workers, and about the
        zygote (its workers, dying with it, come to the keeper: a subreaper)."""
        for pid, code in zygote.ended_children():
            if pid == self.zygote:
                # What it said before it ended goes first (why it could not preload).
                while (
                    self.zygote_sock is not None and select.select([self.zygote_sock], [], [], 0)[0]
                ):
                    self.relay(self.zygote_sock)
                self.stop_zygote()
                send(self.sock, {"op": "zygote-exited", "returncode": code})
            elif pid in self.workers or pid in self.warm:
                self.workers.discard(pid)
                self.warm.discard(pid)
                send(
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
            zygote.die_with(keeper)
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
            [sys.executable, "-I", "-S", os.path.abspath(__file__), str(theirs.fileno())],
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
        """Have the preloaded interpreter fork a worker (``rallypoint.agent.zygote`` says
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
            self.process.wait(_KILL_BOUND)
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
