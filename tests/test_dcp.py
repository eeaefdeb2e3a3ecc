"""rallypoint's writer and reader for torch.distributed.checkpoint (``rallypoint.checkpoint.dcp``)
in one process, with the environment a ``--checkpoint-memory`` worker gets; the FSDP2
example's test (tests/test_examples.py) runs them under ``rallypoint run``."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from rallypoint.checkpoint import Checkpointer, CheckpointError, slot
from rallypoint.checkpoint.dcp import RallypointReader, RallypointWriter


class Opaque:
    """An object a load with weights_only refuses."""


@pytest.fixture
def worker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    memory = tmp_path / "memory"
    (memory / slot.ARENA).mkdir(parents=True)
    env = {"RALLYPOINT_MEMORY_TIER_DIR": str(memory), "RANK": "0", "WORLD_SIZE": "1"}
    for name, value in {**env, "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(name, value)
    warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
    return memory


def state(value: float) -> dict:
    return {"model": {"w": torch.full((4, 3), value)}, "meta": {"lr": value, "name": "adam"}}


def test_a_state_saved_by_the_writer_loads_through_the_reader(worker: Path) -> None:
    assert RallypointReader().step is None  # nothing saved yet
    checkpointer = Checkpointer()
    for step in (1, 2):
        dcp.save(state(float(step)), storage_writer=RallypointWriter(step, checkpointer))
    reader = RallypointReader()
    assert reader.step == 2 and reader.checkpoint is not None
    assert reader.checkpoint.source == "memory"
    target = state(0.0)
    dcp.load(target, storage_reader=reader)
    assert torch.equal(target["model"]["w"], torch.full((4, 3), 2.0))
    assert target["meta"] == {"lr": 2.0, "name": "adam"}


def test_the_writer_refuses_an_object_a_safe_load_would_refuse(worker: Path) -> None:
    from torch.distributed.checkpoint.api import CheckpointException

    with pytest.raises(CheckpointException) as raised:  # DCP's wrapping of each rank's error
        dcp.save({"meta": {"thing": Opaque()}}, storage_writer=RallypointWriter(1))
    ((error, _traceback),) = raised.value.failures.values()
    assert isinstance(error, CheckpointError)
    assert str(error) == (
        "'meta.thing' is neither a tensor nor a plain value (numbers, strings, lists, dicts), "
        "so it cannot go to a memory checkpoint"
    )


def test_the_writer_needs_the_memory_tier(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("RALLYPOINT_MEMORY_TIER_DIR", raising=False)
    with pytest.raises(CheckpointError, match="RallypointWriter saves to node memory"):
        RallypointWriter(1, Checkpointer(str(tmp_path / "ckpt")))
