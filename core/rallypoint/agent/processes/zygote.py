"""The preloaded interpreter that warm-starts a node's workers.

A fresh interpreter pays for ``import torch`` (seconds) before the script's first line, and
a restarted worker pays it again. So the keeper starts one interpreter per node while the
rendezvous runs, with the job's environment, which imports torch and every ``--preload``
module once and then forks each worker on request: the child shares the imported modules
with it (copy-on-write) and becomes the worker exactly as ``python -u SCRIPT ARGS`` would.
This interpreter never runs the job's code, so it stays fit to fork for every restart.

Why a fork server of our own rather than ``multiprocessing``'s forkserver: its children are
``multiprocessing`` processes (a pickled function to call, its own exit and signal handling,
the server's environment), not a program run as ``__main__`` with the worker's own
environment, ``sys.argv``, streams, session and exit status, which is what the worker
contract (torchrun's) is.

In the child, before the script runs: default signal handlers, a session of its own,
``PR_SET_PDEATHSIG`` (it dies with this interpreter, which dies with the keeper), its
stdout and stderr, working directory, CPUs and environment, what a fresh interpreter draws
or makes for itself (``_fresh_process_state``: the random generators, ``multiprocessing``'s
key and helpers), the progress sources a cold worker's ``sitecustomize`` installs
(``rallypoint.worker.progress_sources``), ``sys.argv`` and a fresh ``__main__``. It ends as an interpreter does (``_finish``): ``sys.exit``'s status, an
uncaught exception printed by ``sys.excepthook`` and 1, threads joined, ``atexit`` handlers
run, output flushed; but then it exits at once, without the teardown of every module.

Run as ``python -u -c BOOT PATH0 FOLDER PRELOADS PADDING`` (``BOOT`` below), so that
the modules are imported with the ``sys.path[0]`` the worker will have, and with no module
in ``sys.modules`` that the worker would not import itself: this module and the siblings it
imports (relatively: ``wire``, ``subreaper``) are stdlib-only, imported from FOLDER as the
package ``_rallypoint_zygote``, which leaves ``sys.modules`` before the first preload.
``PRELOADS`` is a comma-separated list; ``PADDING`` (spaces) makes room in the process's
argument area for the command line a cold worker would have, which each worker writes
there, so that ``ps`` and ``pgrep -f`` show it as they would. It talks to the keeper over
the socket on descriptor 3 (``wire``), a worker's stdout and stderr passed with its ``spawn``
request.
"""

from __future__ import annotations

import atexit
import builtins
import contextlib
import ctypes
import gc
import importlib
import io
import os
import select
import signal
import socket
import sys
import threading
import time
import types
from collections.abc import Sequence
from importlib.machinery import SourceFileLoader
from typing import Any, NoReturn

# Relative: imported as _rallypoint_zygote's in the preloaded interpreter (see above).
from . import wire
from .subreaper import die_with, ended_children

#: The descriptor of the socket to the keeper, in the preloaded interpreter.
SOCKET_FD = 3
#: How the keeper starts this module: the worker's ``sys.path[0]`` first, then this module
#: and its siblings from their folder, as a package no script imports, which leaves
#: ``sys.modules`` before ``main`` preloads anything.
BOOT = (
    "import sys, types; sys.path[0] = sys.argv[1]; "
    "p = sys.modules['_rallypoint_zygote'] = types.ModuleType('_rallypoint_zygote'); "
    "p.__path__ = [sys.argv[2]]; from _rallypoint_zygote import zygote as m; "
    "[sys.modules.pop(n) for n in list(sys.modules) if n.startswith(p.__name__)]; "
    "m.main(sys.argv[3].split(','))"
)
#: A module named with ``--preload`` that is not installed fails the preload; torch, which
#: the agent preloads when the script imports it, does not: its workers fail as they would.
IMPLICIT = "torch"
#: rallypoint.worker.variables.PROGRESS_REPORTS (this module imports no rallypoint): set, the
#: worker counts its progress (``rallypoint.worker.progress_sources``).
PROGRESS_REPORTS = "RALLYPOINT_PROGRESS_REPORTS"


# --- the preloaded interpreter ------------------------------------------------------------


def main(preload: Sequence[str]) -> None:
    """Preload, say ready (or why not), then fork workers until the keeper goes away."""
    sock = socket.socket(fileno=SOCKET_FD)
    os.set_inheritable(sock.fileno(), False)
    began = time.monotonic()
    preload = [name for name in preload if name]
    failure = _preload(preload)
    if failure is not None:
        wire.send(sock, {"op": "unready", "message": failure})
        return
    preloaded = [name for name in preload if name in sys.modules]
    # Out of the collector's sight: a worker's collections then write to none of these
    # objects, whose pages stay shared with the zygote (the gc.freeze documentation).
    gc.freeze()
    wire.send(sock, {"op": "ready", "preloaded": preloaded, "seconds": time.monotonic() - began})
    child = _Server(sock).serve()
    if child is not None:  # this process is now a worker
        _become_worker(*child)


def _preload(names: Sequence[str]) -> str | None:
    """Import ``names``; one sentence when one cannot be imported."""
    for name in names:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as error:
            if name == IMPLICIT and error.name == IMPLICIT:
                continue
            return f"--preload {name}: {type(error).__name__}: {error}"
        except BaseException as error:  # SystemExit and KeyboardInterrupt too: one sentence
            return f"--preload {name}: importing it raised {type(error).__name__}: {error}"
    return None


def unfit_to_fork() -> str | None:
    """Why forking this interpreter would give a broken worker, if it would."""
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    if cuda is not None and cuda.is_initialized():
        # A forked child cannot use CUDA its parent initialised.
        return "CUDA was initialised in the preloaded interpreter (by a --preload module)"
    if threading.active_count() > 1:
        # Another thread may hold a lock the child would wait on for ever.
        names = ", ".join(
            t.name for t in threading.enumerate() if t is not threading.current_thread()
        )
        return f"a --preload module started Python threads ({names})"
    return None


class _Server:
    """The fork loop: a ``spawn`` request forks a worker; a worker's exit is reported."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.wake_read, self.wake_write = os.pipe()
        os.set_blocking(self.wake_write, False)
        os.set_blocking(self.wake_read, False)

    def serve(self) -> tuple[dict[str, Any], list[int]] | None:
        """Serve until the keeper goes; in a forked child, return its request and streams."""
        signal.signal(signal.SIGCHLD, lambda signum, frame: None)
        signal.set_wakeup_fd(self.wake_write, warn_on_full_buffer=False)
        while True:
            ready, _, _ = select.select([self.sock.fileno(), self.wake_read], [], [])
            if self.wake_read in ready:
                with contextlib.suppress(BlockingIOError):
                    while os.read(self.wake_read, 512):
                        pass
                self.reap()
            if self.sock.fileno() in ready:
                try:
                    received = wire.receive(self.sock)
                except (OSError, ValueError):
                    received = None
                if received is None:  # the keeper is gone; the workers die with us
                    return None
                child = self.spawn(*received)
                if child is not None:
                    return child

    def spawn(
        self, message: dict[str, Any], fds: list[int]
    ) -> tuple[dict[str, Any], list[int]] | None:
        unfit = unfit_to_fork()
        if unfit is not None:
            for fd in fds:
                os.close(fd)
            wire.send(self.sock, {"op": "refused", "id": message.get("id"), "message": unfit})
            return None
        # The child closes its end once it leads a session of its own: from then on, a
        # signal to its process group (the agent's way to stop a worker) reaches it.
        settled_read, settled_write = os.pipe()
        zygote = os.getpid()
        pid = os.fork()
        if pid == 0:
            os.close(settled_read)
            self.leave(zygote)
            os.close(settled_write)
            return message, fds
        os.close(settled_write)
        os.read(settled_read, 1)  # EOF: settled, or dead
        os.close(settled_read)
        for fd in fds:
            os.close(fd)
        wire.send(self.sock, {"op": "spawned", "id": message.get("id"), "pid": pid})
        return None

    def leave(self, zygote: int) -> None:
        """In the child: nothing of the server stays but the request being served."""
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in (self.wake_read, self.wake_write):
            os.close(fd)
        self.sock.close()
        os.setsid()
        die_with(zygote)

    def reap(self) -> None:
        for pid, code in ended_children():
            wire.send(
                self.sock, {"op": "exited", "pid": pid, "returncode": code, "at": time.monotonic()}
            )


# --- the forked child, becoming the worker --------------------------------------------------


def _become_worker(request: dict[str, Any], fds: list[int]) -> NoReturn:
    """Set up the worker as a fresh ``python -u`` would be, run its program, and exit."""
    stdout, stderr = fds
    os.dup2(stdout, 1)
    os.dup2(stderr, 2)
    os.close(stdout)
    os.close(stderr)
    os.chdir(request["cwd"])
    if request.get("cpus") is not None:  # --numa-binding; this is the only thread
        os.sched_setaffinity(0, request["cpus"])
    for name in request["unset"]:  # the environment is the job's: the worker's differs
        del os.environ[name]
    os.environ.update(request["set"])
    _fresh_process_state()
    if os.environ.get(PROGRESS_REPORTS):
        _install_progress_sources()
    show_command_line(request["argv"])
    try:
        _run(request["kind"], request["target"], request["args"])
    except SystemExit as done:
        _finish(_exit_code(done))
    except BaseException as error:
        error.__traceback__ = _script_frames(error.__traceback__)  # what is printed
        sys.excepthook(type(error), error, error.__traceback__)
        _finish(1, interrupted=isinstance(error, KeyboardInterrupt))
    _finish(0)


def _exit_code(done: SystemExit) -> int:
    """The status ``sys.exit(code)`` ends an interpreter with; a message is printed, 1."""
    if done.code is None:
        return 0
    if isinstance(done.code, int):
        return done.code
    print(done.code, file=sys.stderr)
    return 1


def _finish(code: int, interrupted: bool = False) -> NoReturn:
    """End as an interpreter does: non-daemon threads joined, ``atexit`` handlers run,
    output flushed; then exit at once. The rest of an interpreter's finalisation (every
    module torn down, then libtorch's static destructors) takes most of a second, and a
    failed worker's peers learn of its death only once it is over."""
    threading._shutdown()  # type: ignore[attr-defined]  # what Py_Finalize does first
    atexit._run_exitfuncs()
    _flush_open_files()
    if interrupted:  # an uncaught KeyboardInterrupt ends an interpreter by SIGINT
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code & 0xFF)


def _flush_open_files() -> None:
    """What a file left open would get when finalisation closes it. Objects the worker
    made are all the collector tracks: the zygote's were frozen before the fork."""
    for obj in gc.get_objects():
        # isinstance itself raises for a weakref.proxy whose object is gone (torch.compile
        # leaves such proxies): every object is looked at under the same suppress.
        with contextlib.suppress(Exception):
            if isinstance(obj, io.IOBase) and not obj.closed and obj.writable():
                obj.flush()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


def show_command_line(argv: Sequence[str]) -> None:
    """Write ``argv`` over this process's argument area, what ``ps`` and ``/proc/PID/cmdline``
    show, as ``setproctitle`` does: one line, the arguments joined by spaces.

    The area is the preloaded interpreter's command line, longer than a worker's. Joined by
    NULs, the rest of it would read as hundreds of empty arguments; with a byte other than
    NUL at its end, the kernel shows the text up to the first NUL instead (proc(5)), which
    ``psutil`` splits on spaces. Cut short if it does not fit."""
    try:
        with open("/proc/self/stat", "rb") as handle:
            fields = handle.read().rpartition(b")")[2].split()
        start, end = int(fields[45]), int(fields[46])  # arg_start, arg_end (man 5 proc)
    except (OSError, IndexError, ValueError):
        return
    area = end - start
    text = b" ".join(arg.encode(errors="surrogateescape") for arg in argv)[: area - 2] + b"\0"
    ctypes.memmove(start, text.ljust(area, b" "), area)


def _fresh_process_state() -> None:
    """What a fresh interpreter draws or makes for itself, which a fork would copy from
    the preloaded one (docs/user-guide.md, "Warm start", says what stays shared).

    Python's ``random`` and ``tempfile`` reseed themselves after a fork. torch seeds its
    CPU generator once, when it is imported; its CUDA generators are made and seeded when
    the worker first uses CUDA, which this interpreter never did (``unfit_to_fork``)."""
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        numpy_random.seed()
    generator = getattr(sys.modules.get("torch"), "default_generator", None)
    if generator is not None:
        generator.seed()
    process = sys.modules.get("multiprocessing.process")
    if process is not None:
        process.current_process().authkey = os.urandom(32)
    util = sys.modules.get("multiprocessing.util")
    if util is not None:
        util._run_after_forkers()  # what multiprocessing runs in a child it forks
    _forget_helpers()


def _install_progress_sources() -> None:
    """What a cold worker's ``sitecustomize`` does (torch, imported here, is patched at once).
    Imported by name, in the worker only: the preloaded interpreter imports the standard
    library alone, from this folder rather than the package (see above)."""
    try:
        importlib.import_module("rallypoint.worker.progress_sources").install()
    except Exception as error:
        print(f"rallypoint: no progress reports from this worker: {error!r}", file=sys.stderr)


def _forget_helpers() -> None:
    """A ``multiprocessing`` resource tracker or fork server that a ``--preload`` module
    started belongs to this interpreter: the worker starts its own when it needs one, as
    a fresh interpreter does, instead of sharing it with every other worker."""
    tracker = getattr(
        sys.modules.get("multiprocessing.resource_tracker"), "_resource_tracker", None
    )
    server = getattr(sys.modules.get("multiprocessing.forkserver"), "_forkserver", None)
    for helper, fd_name, fields in (
        (tracker, "_fd", ("_fd", "_pid")),
        (
            server,
            "_forkserver_alive_fd",
            ("_forkserver_alive_fd", "_forkserver_address", "_forkserver_pid"),
        ),
    ):
        fd = getattr(helper, fd_name, None)
        if fd is None:
            continue
        with contextlib.suppress(OSError):
            os.close(fd)
        for field in fields:
            setattr(helper, field, None)


def _run(kind: str, target: str, args: Sequence[str]) -> None:
    """Run the worker's program as ``python -u`` runs it (``sys.path[0]`` is already set)."""
    import runpy

    if kind == "module":  # python -m TARGET: runpy sets sys.argv[0] to the module's file
        sys.argv = ["-m", *args]
        runpy._run_module_as_main(target)  # type: ignore[attr-defined]
        return
    sys.argv = [target, *args]
    if kind == "run_path":  # torchrun's --run-path
        runpy.run_path(target, run_name="__main__")
    elif os.path.isdir(target) or _is_zip(target):  # python DIR: its __main__.py
        runpy._run_module_as_main("__main__", alter_argv=False)  # type: ignore[attr-defined]
    else:
        _run_file(target)


def _run_file(path: str) -> None:
    """``python -u PATH``: the file's code in a fresh ``__main__``."""
    main = types.ModuleType("__main__")
    filename = os.path.abspath(path)
    main.__dict__.update(
        __annotations__={},  # as the interpreter's own __main__ has
        __file__=filename,
        __cached__=None,
        __builtins__=builtins,
        __loader__=SourceFileLoader("__main__", filename),
    )
    sys.modules["__main__"] = main
    try:
        with open(path, "rb") as handle:
            source = handle.read()
    except OSError as error:
        print(
            f"{sys.executable}: can't open file {filename!r}: [Errno {error.errno}] {error.strerror}",
            file=sys.stderr,
        )
        raise SystemExit(2) from None
    exec(compile(source, filename, "exec", dont_inherit=True), main.__dict__)


def _is_zip(path: str) -> bool:
    import zipfile

    return zipfile.is_zipfile(path)


def _script_frames(tb: types.TracebackType | None) -> types.TracebackType | None:
    """The traceback from the script's first frame on, as a fresh interpreter prints it."""
    while tb is not None and tb.tb_frame.f_code.co_filename in (__file__, "<string>"):
        tb = tb.tb_next
    return tb
