"""The examples run as documented: examples/train_digits.py survives a crash, resumes from its
checkpoint and learns the digits; examples/elastic_demo.py (``make demo``) grows from one
node to two and goes on after one dies; examples/dcp_train.py (FSDP2 with DCP into the
memory tier) resumes from memory as if it never failed, and reshards at another size."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from launch import clean_environment, events, rallypoint, wait_gone

ROOT = Path(__file__).resolve().parent.parent
TRAIN_DIGITS = str(ROOT / "examples" / "train_digits.py")
ELASTIC_DEMO = str(ROOT / "examples" / "elastic_demo.py")
DCP_TRAIN = str(ROOT / "examples" / "dcp_train.py")


def require_scikit_learn() -> None:
    """Skip without scikit-learn (the ``examples`` extra); under CI, fail instead."""
    if importlib.util.find_spec("sklearn") is not None:
        return
    message = "scikit-learn is not installed: pip install -e '.[examples]'"
    if os.environ.get("CI"):
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


def test_train_digits_resumes_after_a_crash_and_learns(tmp_path: Path) -> None:
    require_scikit_learn()
    result = rallypoint(
        "run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        "--checkpoint-dir",
        str(tmp_path / "checkpoints"),
        TRAIN_DIGITS,
        "--epochs",
        "5",
        "--save-every",
        "10",
        "--crash-at",
        "25",
        cwd=tmp_path,
        timeout=240,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "simulated crash of rank 1 at step 25" in output
    # The newest checkpoint before the crash is the one of step 20; the run goes on from it.
    assert "attempt 0: starting from scratch, world size 2" in output
    assert "attempt 1: resuming from the checkpoint of step 20" in output
    accuracy = re.search(r"held-out accuracy ([\d.]+)%", output)
    assert accuracy is not None, output
    assert float(accuracy.group(1)) > 85.0, output


def test_the_demo_scales_up_and_goes_on_without_a_killed_node(tmp_path: Path) -> None:
    require_scikit_learn()
    demo = tmp_path / "demo"
    result = subprocess.run(
        [sys.executable, ELASTIC_DEMO, "--dir", str(demo)],
        capture_output=True,
        text=True,
        timeout=400,
        env=clean_environment(),
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    node_a, node_b = demo / "events-a.jsonl", demo / "events-b.jsonl"
    rounds = [e["world_size"] for e in events(node_a, "rendezvous_completed")]
    assert rounds == [2, 4, 2], output
    # Neither the arrival nor the loss of node b used up a restart.
    restarts = {(e["cause"], e["restart_count"]) for e in events(node_a, "workers_restarted")}
    assert restarts == {("membership", 0)}, output
    # Each round went on from the newest checkpoint: at world size 4, then at 2 again.
    assert re.search(
        r"node a \| .*resuming from the checkpoint of step \d+ in memory "
        r"\(saved at world size 2, now 4\)",
        output,
    ), output
    assert re.search(
        r"node a \| .*resuming from the checkpoint of step \d+ in memory "
        r"\(saved at world size 4, now 2\)",
        output,
    ), output
    assert re.search(r"held-out accuracy ([\d.]+)%", output), output
    # A save every step, to memory: node b's loss cost node a no step.
    assert "demo: node a resumed from memory, 0 steps lost" in output, output
    # Node b was SIGKILLed: its workers died with it, and node a's are gone too.
    pids = [
        pid for log in (node_a, node_b) for e in events(log, "workers_started") for pid in e["pids"]
    ]
    assert len(pids) == 8, pids  # a: 3 rounds x 2 workers; b: 1 round x 2
    wait_gone(pids, timeout=10)
    shown = [line.replace(".demo/", f"{demo}/") for line in readme_demo_output()]
    assert_shown_in_order(shown, output)


def readme_demo_output() -> list[str]:
    """The lines of the demo's output the README shows."""
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    start = text.index("```text", text.index("`make demo` runs two nodes")) + len("```text")
    return text[start : text.index("```", start)].strip().splitlines()


def assert_shown_in_order(shown: list[str], output: str) -> None:
    """Every shown line is a line of ``output``, in order: numbers, node ids and what the
    README cut short (``...``) may differ."""
    lines = output.splitlines()
    at = 0
    for line in shown:
        pattern = re.escape(line).replace(re.escape("..."), ".*")  # where the README cuts
        pattern = re.sub(r"[a-z]+_\d+_[0-9a-f]{8}", r"\\S+", pattern)  # node ids
        pattern = re.sub(r"\d+(?:\\\.\d+)?", r"\\d+(?:\\.\\d+)?", pattern)
        for index in range(at, len(lines)):
            if re.fullmatch(pattern, lines[index]):
                at = index + 1
                break
        else:
            raise AssertionError(f"the README's demo line is not in the output: {line}\n{output}")


def test_the_dcp_example_resumes_from_memory_as_if_it_never_failed(tmp_path: Path) -> None:
    """FSDP2 + AdamW saving with ``dcp.save(storage_writer=RallypointWriter(step))`` every
    step: rank 1 fails at step 30, both ranks load step 29 from node memory with
    ``RallypointReader``, and every later loss is the one of a run that did not fail. Then
    3 ranks reshard the end's checkpoint from --checkpoint-dir and go on."""

    def run(ckpt: Path, nproc: int, *args: str) -> str:
        done = rallypoint(
            "run", "--nproc-per-node", str(nproc), "--max-restarts", "1",
            "--checkpoint-memory", "64MB", "--checkpoint-dir", str(ckpt), DCP_TRAIN, *args,
            timeout=240,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    def losses(out: str) -> list[tuple[int, int, str]]:
        """(rank, step, loss) of each logged step (every 10th), in order."""
        found = re.findall(r"\[default(\d)\]:step (\d+) loss (\S+)", out)
        return sorted((int(rank), int(step), loss) for rank, step, loss in found)

    failed = run(tmp_path / "a", 2, "--crash-at", "30")
    assert (
        sorted(re.findall(r"resumed from step (\d+) \((\w+)\)", failed)) == [("29", "memory")] * 2
    ), failed
    clean = run(tmp_path / "b", 2)
    assert losses(failed) == losses(clean) and len(losses(clean)) == 12, failed
    resharded = run(tmp_path / "a", 3, "--steps", "70")
    assert re.findall(r"resumed from step (\d+) \((\w+)\)", resharded) == [("59", "durable")] * 3, (
        resharded
    )
    assert len(re.findall(r"step 60 loss", resharded)) == 3
