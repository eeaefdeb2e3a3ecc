"""The launchers a team would pick instead of rallypoint, for ``bench_peers.py``: each in a
virtual environment of its own under ``.bench-peers/`` (git-ignored), installed from the
package index as its documentation says, beside the torch it runs with.

A peer is a benchmark's dependency only: nothing in core or the plugins imports it, and
``make test`` neither installs nor runs one. A peer that cannot be installed (no network)
is said in one line and left out.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from common import ROOT

HOME = ROOT / ".bench-peers"
#: The project's torch (a CPU build on this machine's disk, as the project's lock has it).
OUR_TORCH = "2.13.0"


@dataclass(frozen=True)
class Peer:
    """One peer launcher: its name in the tables, what pip installs, its console script,
    the torch it runs with and why, where not ours, and how its documentation starts it."""

    name: str
    install: tuple[str, ...]  # as the peer's documentation says, and what it lacks
    distribution: str  # whose version the tables show
    script: str  # the launcher's console script
    docs: str
    torch: str = OUR_TORCH
    why_torch: str = ""

    @property
    def home(self) -> Path:
        return HOME / self.distribution

    @property
    def command(self) -> list[str]:
        return [str(self.home / "bin" / self.script)]


PEERS = (
    Peer(
        "ft_launcher",
        ("nvidia-resiliency-ext",),
        "nvidia-resiliency-ext",
        "ft_launcher",
        "https://nvidia.github.io/nvidia-resiliency-ext/fault_tolerance/usage_guide.html",
    ),
    Peer(
        "dlrover-run",
        # Its agent talks to its job master over gRPC: without the k8s extra's grpcio it
        # fails at import (No module named 'grpc'), and without protobuf, which no extra
        # names, its rendezvous backend is never registered.
        ("dlrover[k8s,torch]", "protobuf"),
        "dlrover",
        "dlrover-run",
        "https://github.com/intelligent-machine-learning/dlrover/blob/master/docs/"
        "tutorial/torch_elastic_run.md",
        torch="2.7.1",
        why_torch=(
            "dlrover 0.6.1's launcher builds torch's SubprocessHandler without its "
            "numa_options argument, new in torch 2.8: with torch 2.13 every start fails "
            "(TypeError: SubprocessHandler.__init__() missing 1 required positional "
            "argument: 'numa_options'), so its environment has torch 2.7.1, the newest "
            "before it (PyPI's build, which runs on the CPU too)"
        ),
    ),
    Peer(
        "torchft",
        ("torchft",),
        "torchft",
        # Not a launcher: each replica group runs under torchrun, beside one Lighthouse.
        "torchft_lighthouse",
        "https://github.com/pytorch/torchft#running",
    ),
)


def ensure(peer: Peer) -> str | None:
    """The peer's installed version, installing it first where its environment is new;
    None (after one line saying why) where it cannot be installed."""
    stamp = peer.home / ".installed"
    if not stamp.exists():
        what = " ".join(peer.install)
        print(f"installing {what} with torch {peer.torch} in {peer.home}", flush=True)
        made = subprocess.run([sys.executable, "-m", "venv", str(peer.home)], capture_output=True)
        pip = [str(peer.home / "bin" / "python"), "-m", "pip", "install", "-q"]
        done = made.returncode == 0 and _quiet([*pip, f"torch=={peer.torch}", "numpy"])
        done = done and _quiet([*pip, *peer.install])
        if not done:
            print(f"{peer.name}: could not install {' '.join(peer.install)}; left out")
            return None
        stamp.touch()
    found = subprocess.run(
        [str(peer.home / "bin" / "python"), "-c",
         f"import importlib.metadata as m; print(m.version({peer.distribution!r}))"],
        capture_output=True, text=True,
    )  # fmt: skip
    return found.stdout.strip() or None


def _quiet(command: list[str]) -> bool:
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        print((result.stderr or result.stdout).strip().splitlines()[-1], flush=True)
    return result.returncode == 0
