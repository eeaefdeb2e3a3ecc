"""Saves on notice: the step an agent picks, its notice file as a worker reads it, and one
real agent told to stop (its workers save at the step they reached, whatever the save
interval). Several nodes, on every backend: tests/faults/test_scale_notice.py."""

from __future__ import annotations

import re
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import launch
from launch import assert_no_worker_left, wait_for_text, worker
from rallypoint.agent.checkpoints.save_notice import SaveNotice, notice_step
from rallypoint.worker import channel, notice_watch


def test_the_notice_step_leaves_time_for_every_worker_to_hear_of_it() -> None:
    assert notice_step(100, None, several=False) == 102
    assert notice_step(100, None, several=True) == 103
    assert notice_step(100, 0.5, several=True) == 102  # one step covers the lead
    assert notice_step(100, 0.03, several=True) == 111  # 0.3 s of steps, and one more
    assert notice_step(100, 0.01, several=False) == 103


@pytest.fixture
def notice(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[SaveNotice]:
    made = SaveNotice(tmp_path)
    monkeypatch.setenv(notice_watch.ENV, str(made.path))
    monkeypatch.setattr(notice_watch, "_opened", False)
    monkeypatch.setattr(notice_watch, "_announced", False)
    monkeypatch.setattr(notice_watch, "_view", None)
    yield made
    made.close()
    notice_watch._view = None  # mapped from the closed file


def test_a_worker_saves_every_n_steps_and_at_the_notice(notice: SaveNotice) -> None:
    assert [s for s in range(1, 25) if notice_watch.should_save(s, every=10)] == [10, 20]
    notice.give(13)
    assert [s for s in range(11, 16) if notice_watch.should_save(s, every=10)] == [13, 14, 15]
    notice.reset()
    assert not notice_watch.should_save(13, every=10)


def test_outside_rallypoint_should_save_is_the_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(notice_watch.ENV, raising=False)
    monkeypatch.setattr(notice_watch, "_opened", False)
    monkeypatch.setattr(notice_watch, "_view", None)
    assert [s for s in range(1, 8) if notice_watch.should_save(s, every=3)] == [3, 6]
    assert not notice_watch.requested(5)


def test_the_agent_waits_for_the_workers_that_watch_until_they_hold(notice: SaveNotice) -> None:
    assert not notice.watched([0, 1])
    notice.message(channel.NOTICE_WATCHING, {"local_rank": 0})
    notice.message(channel.NOTICE_WATCHING, {"local_rank": 1})
    assert notice.watched([0, 1])
    notice.give(7)
    notice.message(channel.NOTICE_HELD, {"local_rank": 0, "step": 7})
    began = time.monotonic()
    late, held = notice.wait_held(7, lambda: [0, 1], timeout=0.3)
    assert (late, held) == ([1], 7)
    assert time.monotonic() - began >= 0.3
    notice.message(channel.NOTICE_HELD, {"local_rank": 1, "step": 8})  # heard it late
    assert notice.wait_held(7, lambda: [0, 1], timeout=5) == ([], 8)
    assert notice.wait_held(9, lambda: [], timeout=5) == ([], 8)  # none left running
    notice.reset()
    assert not notice.watched([0])


STEP = re.compile(r"step=(\d+) rank=0 world=2 at=")


def stopped(tmp_path: Path, once: str, *args: str, tag: str) -> str:
    """The output of ``rallypoint run ARGS`` sent SIGTERM once it printed ``once``; it must
    exit 143 and leave no worker (``tag``: in the workers' command lines, ``args``)."""
    log = tmp_path / "agent.log"
    agent = launch.start_rallypoint(
        "run", "--checkpoint-dir", str(tmp_path / "ckpt"), *args, log=log
    )
    try:
        wait_for_text(log, once)
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(timeout=60) == 128 + signal.SIGTERM, log.read_text()
    finally:
        launch.kill(agent)
    assert_no_worker_left(tag)
    return log.read_text()


def test_a_node_told_to_stop_saves_the_step_its_workers_reached(tmp_path: Path) -> None:
    tag = f"notice-{uuid.uuid4().hex}"
    text = stopped(
        tmp_path, "step=15 rank=0", "--nproc-per-node", "2", "--checkpoint-memory", "16MB",
        worker("notice_steps.py"), "0.05", "10", tag, tag=tag,
    )  # fmt: skip
    reached = max(int(s) for s in STEP.findall(text))
    saved = re.search(r"saved on notice at step (\d+)", text)
    assert saved and int(saved.group(1)) == reached, text
    newest = max(int(p.name.rsplit("-", 1)[1]) for p in (tmp_path / "ckpt").glob("step-*"))
    assert newest == reached, f"the newest durable checkpoint is {newest}:\n{text}"


def test_a_script_that_never_asks_stops_at_once(tmp_path: Path) -> None:
    tag = f"steps-{uuid.uuid4().hex}"
    text = stopped(
        tmp_path, "step rank=0", "--nproc-per-node", "1", worker("steps.py"), "60", tag,
        tag=tag,
    )  # fmt: skip
    assert "on notice" not in text, text


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (the GPU check)")
def test_a_cuda_worker_told_to_stop_saves_its_step_asynchronously(tmp_path: Path) -> None:
    """The state on the GPU, an asynchronous save (a pinned copy on a stream of its own):
    the hold waits for the copy, and the step reached is the one kept."""
    tag = f"notice-{uuid.uuid4().hex}"
    text = stopped(
        tmp_path, "step=15 rank=0", "--nproc-per-node", "1", "--checkpoint-memory", "64MB",
        worker("notice_steps.py"), "0.05", "10", tag, "cuda", tag=tag,
    )  # fmt: skip
    reached = max(int(s) for s in re.findall(r"step=(\d+) rank=0 world=1 at=", text))
    saved = re.search(r"saved on notice at step (\d+)", text)
    assert saved and int(saved.group(1)) == reached, text
