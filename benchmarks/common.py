"""What every benchmark records and writes alike: the machine, the commit measured, the load,
the results JSON and the charts of its page.

The scripts run as ``python benchmarks/bench_*.py``, so this directory is on ``sys.path``
and they import this module as ``common``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import time
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.figure import Figure

ROOT = Path(__file__).resolve().parents[1]
IMAGES = ROOT / "docs" / "img"


def machine() -> str:
    """``x86_64, 16 CPUs, Linux 6.1.0``: where the numbers were measured."""
    return f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.system()} {platform.release()}"


def measured_on(began: float | None = None) -> dict[str, str]:
    """The ``date`` (UTC, to the minute) a run began, default now, and the ``machine``."""
    return {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(began)), "machine": machine()}


def load_average() -> str:
    """The 1, 5 and 15 minute load averages: ``0.52 0.61 0.70``."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def git_state(watched: str, fingerprint: str | None = None) -> str:
    """The commit measured, and whether the code under ``watched`` differs from it.

    ``watched`` is a directory of the repository (``core/rallypoint/checkpoint``); with
    uncommitted changes there the state says so, and names the sha256 of ``fingerprint``,
    a file in that directory, so that two dirty runs can be told apart.
    """

    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
        return done.stdout.strip()

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    if not git("status", "--porcelain", "--", watched):
        return commit
    state = f"{commit} + uncommitted changes to {Path(watched).name}/"
    if fingerprint is None:
        return state
    digest = hashlib.sha256((ROOT / watched / fingerprint).read_bytes()).hexdigest()[:12]
    return f"{state} ({fingerprint} sha256 {digest})"


def add_render_only(parser: argparse.ArgumentParser, results: Path) -> None:
    """``--render-only``: rewrite the page and its chart from ``results``, measure nothing."""
    parser.add_argument(
        "--render-only",
        action="store_true",
        help=f"measure nothing: rewrite the report and chart from {results.relative_to(ROOT)}",
    )


def write_results(path: Path, results: dict[str, Any]) -> None:
    """``results`` as indented JSON, the directory made if need be."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2) + "\n")


def wrote(*paths: Path) -> None:
    """Say which files were written: ``wrote a, b and c``, relative to the repository."""
    names = [str(path.relative_to(ROOT)) for path in paths]
    print("wrote " + " and ".join(filter(None, [", ".join(names[:-1]), names[-1]])))


def pyplot() -> ModuleType:
    """matplotlib's pyplot on the Agg backend (no display needed), docs/img/ made."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    IMAGES.mkdir(parents=True, exist_ok=True)
    return plt


def save_chart(figure: Figure, path: Path) -> str:
    """Lay out, save (100 dpi) and close ``figure``; return its address from a docs/ page."""
    import matplotlib.pyplot as plt

    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return f"img/{path.name}"
