"""The examples run as documented: examples/train_digits.py survives a crash, resumes from its
checkpoint and learns the digits."""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

import pytest

from launch import rallypoint

ROOT = Path(__file__).resolve().parent.parent
TRAIN_DIGITS = str(ROOT / "examples" / "train_digits.py")


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
