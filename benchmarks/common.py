"""The harness every benchmark shares: its options, free loopback ports, jobs run and their
leftovers killed, the rounds of runs, and the page and charts written from a results JSON.

The scripts run as ``python benchmarks/bench_*.py``, so this directory is on ``sys.path``
and they import this module as ``common``. Each page is hand-written markdown but for the
blocks between ``<!-- begin NAME -->`` and ``<!-- end NAME -->``, which its script rewrites
from the results: after a run, or with ``--render-only`` from the committed JSON alone.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from importlib.metadata import version
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from matplotlib.figure import Figure

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DOCS = ROOT / "docs"
BIN = Path(sys.executable).parent
HOST = "127.0.0.1"
#: The two launchers compared, as commands, in the order of every table and chart.
LAUNCHERS = {"rallypoint": [str(BIN / "rallypoint"), "run"], "torchrun": [str(BIN / "torchrun")]}
COLORS = {"rallypoint": "#2b7bba", "torchrun": "#999999"}
Sample = TypeVar("Sample")


# --- measuring ----------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((HOST, 0))
        return int(probe.getsockname()[1])


def port_open(port: int) -> bool:
    """Whether something listens on ``port`` of the loopback address."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        return probe.connect_ex((HOST, port)) == 0


def start_redis(wait: float = 30.0) -> tuple[subprocess.Popen[bytes], int]:
    """redis-server on a free loopback port, without persistence; it and its port."""
    import shutil

    port = free_port()
    binary = shutil.which("redis-server") or "/usr/bin/redis-server"
    server = subprocess.Popen(
        [binary, "--port", str(port), "--bind", HOST, "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + wait
    while not port_open(port):
        if time.monotonic() > deadline or server.poll() is not None:
            server.kill()
            raise SystemExit("redis-server did not start (make servers installs it)")
        time.sleep(0.05)
    return server, port


def clean_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment without launcher settings (as tests/launch.py), plus ``extra``."""
    launcher = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    prefixes = ("RALLYPOINT_", "PET_", "TORCHELASTIC_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(prefixes) and k not in launcher}
    return {**env, **(extra or {})}


def matching(marker: str) -> list[int]:
    """The processes but this one whose command line holds ``marker`` (as ``pgrep -f``)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            with contextlib.suppress(OSError):
                if marker.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
    return found


def kill(pids: Iterable[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def kill_tagged(marker: str, wait: float = 0.0) -> int:
    """SIGKILL every process whose command line holds ``marker``, with the process group it
    leads (a worker in a session of its own, and what it started), again until none is left
    or ``wait`` seconds are over; how many were still there at the last look."""
    deadline = time.monotonic() + wait
    while left := matching(marker):
        for pid in left:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                if os.getpgid(pid) == pid:
                    os.killpg(pid, signal.SIGKILL)
        kill(left)
        if time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    return len(left)


def run_job(
    command: list[str],
    timeout: float,
    watch: Callable[[subprocess.Popen[str], list[str]], None] | None = None,
    leftovers: str | None = None,
) -> tuple[int | None, str, float]:
    """Run ``command`` in a session of its own, ``watch(process, lines so far)`` meanwhile;
    after ``timeout`` kill its process group. Whatever carries ``leftovers`` on its command
    line is killed then and after the run: workers that a launcher left must not skew the
    next run. Its exit code (None: killed), its output and its wall time."""
    began = time.monotonic()
    process = subprocess.Popen(
        command,
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines: list[str] = []

    def read() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            lines.append(line)

    threads = [threading.Thread(target=read, daemon=True)]
    if watch is not None:
        threads.append(threading.Thread(target=watch, args=(process, lines), daemon=True))
    for thread in threads:
        thread.start()
    code: int | None = None
    try:
        code = process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        if leftovers:  # torchrun's workers may hold the output pipe open
            kill_tagged(leftovers)
        process.wait(30)
    threads[0].join(30)
    wall = time.monotonic() - began
    for thread in threads[1:]:
        thread.join(10)
    if leftovers:
        kill_tagged(leftovers)
    return code, "".join(lines), wall


def rounds(
    repeat: int,
    names: Sequence[str],
    once: Callable[[str], Sample],
    show: Callable[[Sample], str] = str,
    *,
    rotate: bool = True,
    skip: Callable[[str, int], bool] | None = None,
) -> dict[str, list[Sample]]:
    """``repeat`` rounds of ``once(name)`` for every name, each round in an order shifted by
    one (``rotate``: A B, then B A), so that noise and warm-up hit every name alike;
    ``skip(name, round)`` leaves a run out."""
    samples: dict[str, list[Sample]] = {name: [] for name in names}
    for index in range(repeat):
        shift = index % len(names) if rotate else 0
        for name in [*names[shift:], *names[:shift]]:
            if skip is None or not skip(name, index):
                samples[name].append(sample := once(name))
                print(f"round {index + 1}/{repeat} {name:24} {show(sample)}", flush=True)
    return samples


def median(values: Iterable[float]) -> float | None:
    """Their median; None where there are none (nothing succeeded)."""
    kept = list(values)
    return statistics.median(kept) if kept else None


def load_average() -> str:
    """The 1, 5 and 15 minute load averages: ``0.52 0.61 0.70``."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def git_state(watched: str, fingerprint: str | None = None) -> str:
    """The commit measured, and whether the code in the directory ``watched`` differs from
    it; then the sha256 of its file ``fingerprint`` tells two such runs apart."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout

    commit = git("rev-parse", "--short", "HEAD").strip() or "unknown"
    if not git("status", "--porcelain", "--", watched).strip():
        return commit
    state = f"{commit} + uncommitted changes to {Path(watched).name}/"
    if fingerprint is None:
        return state
    digest = hashlib.sha256((ROOT / watched / fingerprint).read_bytes()).hexdigest()[:12]
    return f"{state} ({fingerprint} sha256 {digest})"


# --- the options, the results and the page ------------------------------------------------


def options(doc: str | None, **specs: tuple[Any, str]) -> argparse.ArgumentParser:
    """The script's options: ``--render-only`` and, for each ``name=(default, help)``,
    ``--name`` of the default's type (a flag where it is a bool)."""
    parser = argparse.ArgumentParser(description=(doc or "").splitlines()[0])
    render_only = (False, "measure nothing: rewrite the page and charts from the results")
    for name, (default, text) in {"render_only": render_only, **specs}.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(default, bool):
            parser.add_argument(flag, action="store_true", help=text)
        elif isinstance(default, tuple):  # the choices, the first the default
            parser.add_argument(flag, choices=default, default=default[0], help=text)
        else:
            kind, text = type(default), f"{text} (default: %(default)r)"
            parser.add_argument(flag, type=kind, default=default, help=text)
    return parser


def command_line() -> str:
    """How this script was run: ``python benchmarks/bench_x.py --repeat 3``."""
    return " ".join(["python", f"benchmarks/{Path(sys.argv[0]).name}", *sys.argv[1:]])


def publish(
    args: argparse.Namespace,
    name: str,
    page_name: str,
    measure: Callable[[argparse.Namespace], dict[str, Any]],
    draw: Callable[[dict[str, Any]], None],
    render: Callable[[dict[str, Any]], dict[str, list[str]]],
) -> None:
    """Measure (or load, ``--render-only``) the results ``benchmarks/results/NAME.json``,
    write them, ``draw`` their charts and write the generated blocks of ``docs/PAGE_NAME.md``."""
    results_file, page = RESULTS / f"{name}.json", DOCS / f"{page_name}.md"
    if args.render_only:
        results = json.loads(results_file.read_text())
    else:
        began = time.time()
        # The date of the results, to the minute; the pages take it from there.
        date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(began))
        machine = (
            f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.system()} {platform.release()}"
        )
        results = {"date": date, "machine": machine, "cpus": os.cpu_count()}
        results.update(python=platform.python_version(), torch=version("torch"))
        results.update(command=command_line(), load_before=load_average())
        results.update(measure(args), load_after=load_average())
        results.update(wall_seconds=time.time() - began)
        results_file.parent.mkdir(parents=True, exist_ok=True)
        results_file.write_text(json.dumps(results, indent=2) + "\n")
    draw(results)
    text = page.read_text()
    for block, lines in render(results).items():
        begin, end = f"<!-- begin {block} -->", f"<!-- end {block} -->"
        head, found, rest = text.partition(begin)
        if not found or end not in rest:
            raise SystemExit(f"{page.relative_to(ROOT)}: no block {begin} ... {end} to fill")
        text = "\n".join([head + begin, "", *lines, "", end + rest.partition(end)[2]])
    page.write_text(text)
    written = [page] if args.render_only else [results_file, page]
    print("wrote " + ", ".join(str(path.relative_to(ROOT)) for path in written), flush=True)


def measured(results: dict[str, Any], *more: str) -> list[str]:
    """The bullets that open a page: when and where, then ``more``, then the command."""
    lines = [f"- Measured: {results['date']} on {results['machine']}", *more]
    return [*lines, f"- Command: `{results['command']}`"]


def table(header: str, rows: Iterable[str | Sequence[object]]) -> list[str]:
    """A markdown table: ``header`` and each row as cells, or as text, joined by `` | ``."""
    cells = [row if isinstance(row, str) else " | ".join(map(str, row)) for row in rows]
    return [f"| {header} |", "|" + "---|" * (header.count(" | ") + 1), *(f"| {c} |" for c in cells)]


def number(value: object, unit: str = "", digits: int = 2) -> str:
    """``1.23 s``; ``n/a`` for a value that was not measured."""
    return f"{value:.{digits}f}{unit}" if isinstance(value, (int, float)) else "n/a"


def figure(*args: Any, **kwargs: Any) -> tuple[Figure, Any]:
    """``pyplot.subplots`` on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(*args, **kwargs)  # type: ignore[no-any-return]


def save(chart: Figure, name: str) -> None:
    """Lay out, save (100 dpi) and close ``chart`` as docs/img/NAME."""
    import matplotlib.pyplot as plt

    (DOCS / "img").mkdir(parents=True, exist_ok=True)
    chart.tight_layout()
    chart.savefig(DOCS / "img" / name, dpi=100)
    plt.close(chart)
