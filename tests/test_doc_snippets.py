"""Shell snippets of the docs, run as written (ports, directories and the length of the
training changed to the test's), and their shown output checked against the run's."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

from launch import BIN, clean_environment
from servers import free_ports, require_binary

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "docs" / "deploy.md"


def block_after(text: str, marker: str, fence: str = "```sh") -> str:
    """The fenced block that follows ``marker`` in ``text``."""
    start = text.index(fence, text.index(marker)) + len(fence)
    return text[start : text.index("```", start)].strip("\n")


def test_the_laptop_snippet_of_deploy_md_runs_and_shows_the_world_size(tmp_path: Path) -> None:
    require_binary("etcd", "etcd-server")
    text = DEPLOY.read_text()
    snippet = block_after(text, "Then what a cluster does, on one machine")
    shown = block_after(text, "Then what a cluster does, on one machine", "```text")
    client, peer, metrics = free_ports(3)
    script = (
        snippet.replace(
            "etcd --data-dir /tmp/etcd",
            f"etcd --data-dir {tmp_path}/etcd --listen-client-urls http://127.0.0.1:{client} "
            f"--advertise-client-urls http://127.0.0.1:{client} "
            f"--listen-peer-urls http://127.0.0.1:{peer} "
            f"--initial-advertise-peer-urls http://127.0.0.1:{peer} "
            f"--initial-cluster default=http://127.0.0.1:{peer}",
        )
        .replace("/tmp/etcd.log", f"{tmp_path}/etcd.log")
        .replace("localhost:2379", f"127.0.0.1:{client}")
        .replace("9400", str(metrics))
        .replace("/tmp/digits", str(tmp_path / "digits"))
        .replace("--epochs 40", "--epochs 3 --step-seconds 0.05")
        .replace("examples/train_digits.py", str(ROOT / "examples" / "train_digits.py"))
    )
    env = clean_environment({"PATH": f"{BIN}:{os.environ['PATH']}"})
    shell = subprocess.Popen(
        ["bash", "-c", script],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = shell.communicate(timeout=120)
    finally:
        os.killpg(shell.pid, signal.SIGKILL)
        time.sleep(0.5)  # the agents' keepers clear their workers
    assert shell.returncode == 0, output + (tmp_path / "node0.log").read_text()
    pattern = re.escape(shown.strip()).replace("vm_4242_1a2b3c4d", r"\S+")
    assert re.fullmatch(pattern.replace(r"2\.0", r"[12]\.0"), output.strip()), output
