"""Asynchronous copies (rallypoint.checkpoint.copying) and the arena's life in a process: when
a copy is made safe from the loop's changes, what the host waits for, what the interpreter's
exit waits for, and that a process maps and pins a slot once. On the CPU here; the GPU check
(benchmarks/gpu-check.sh, its smoke part) runs the same on CUDA state."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from rallypoint.checkpoint import arena, copying, loading, pinning, slot
from rallypoint.checkpoint.copies import Copies
from rallypoint.interfaces import CheckpointError


@pytest.fixture
def hooks(monkeypatch: pytest.MonkeyPatch) -> copying._Hooks:
    """The process's hooks as after an eager optimizer step (each test sets its own)."""
    monkeypatch.setattr(copying._hooks, "seen_step", True)
    monkeypatch.setattr(copying._hooks, "hidden", False)
    return copying._hooks


def newest(memory: Path) -> Any:
    return loading.load_copy(Copies(memory / slot.ARENA).newest()[0])


def test_a_step_waits_for_the_cpu_copy_not_for_the_commit(
    tmp_path: Path, hooks: copying._Hooks
) -> None:
    """The optimizer's step waits for the tensors to be copied, never for the rest of the
    save (the commit, the agent told): default AdamW keeps a CPU ``step`` tensor beside
    CUDA state, and the loop must not stall on the whole save for it."""
    committing = threading.Event()
    memory = arena.Arena(tmp_path, 0, saved=lambda saved: committing.wait(30))
    model = torch.nn.Linear(32, 32)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    memory.save(model.state_dict(), 1, rank=0, world_size=1, asynchronous=True)
    model(torch.randn(2, 32)).sum().backward()
    stepped = threading.Thread(target=optimizer.step)
    stepped.start()
    stepped.join(10)
    assert not stepped.is_alive()  # while the save is still being committed
    committing.set()
    memory.wait()
    assert all(torch.equal(newest(tmp_path)[k], v) for k, v in before.items())
    memory.close()


def test_a_forward_through_batchnorm_waits_for_the_copy_instead_of_tearing_it(
    tmp_path: Path, hooks: copying._Hooks, gate: threading.Event
) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8))
    memory = arena.Arena(tmp_path, 0)
    statistics = model[1].running_mean.clone()
    memory.save(model.state_dict(), 1, rank=0, world_size=1, asynchronous=True)
    forward = threading.Thread(target=model, args=(torch.randn(4, 8),))
    forward.start()
    forward.join(0.3)
    assert forward.is_alive()  # BatchNorm's forward waits: it would change a saved buffer
    gate.set()
    forward.join(30)
    memory.wait()  # kept, not "changed while it was copied"
    assert torch.equal(newest(tmp_path)["1.running_mean"], statistics)
    assert not torch.equal(model[1].running_mean, statistics)
    memory.close()


def test_a_forward_holding_no_saved_buffer_does_not_wait(
    tmp_path: Path, hooks: copying._Hooks, gate: threading.Event
) -> None:
    memory = arena.Arena(tmp_path, 0)
    memory.save({"w": torch.ones(4)}, 1, rank=0, world_size=1, asynchronous=True)
    forward = threading.Thread(target=torch.nn.BatchNorm1d(4), args=(torch.randn(2, 4),))
    forward.start()
    forward.join(10)
    assert not forward.is_alive()
    gate.set()
    memory.wait()
    memory.close()


def asynchronous_copy(copier: copying.Copier, tensor: torch.Tensor) -> copying.Copy:
    """A copy in flight that watches ``tensor`` as it watches a CUDA source: until the
    caller's stream is ordered after it (no CUDA event here: the CPU has none)."""
    kept: list[str] = []
    copy = copying.Copy("checkpoint of step 1", kept.append, lambda copy: None)
    copy.asynchronous = True
    copy.copied.set()
    copy.watched = [("w", tensor, tensor._version)]
    copier.pending.append(copy)
    return copy


def test_a_change_after_the_copy_is_ordered_is_no_tear(hooks: copying._Hooks) -> None:
    """The versions are compared when the caller's stream is made to wait (the step's hook),
    not when the copy ends: the next step is issued long before a large DMA is done, and
    runs after it on the GPU."""
    copier, tensor = copying.Copier(), torch.zeros(4)
    copy = asynchronous_copy(copier, tensor)
    copier.before_change()
    tensor.add_(1)  # issued after the ordering
    copier._finish(copy)
    assert copy.error is None and copy.watched == []


def test_a_change_issued_before_the_copy_is_ordered_tears_it(hooks: copying._Hooks) -> None:
    copier, tensor = copying.Copier(), torch.zeros(4)
    copy = asynchronous_copy(copier, tensor)
    tensor.add_(1)  # issued while the copy could still be reading it
    copier.before_change()
    copier._finish(copy)
    assert isinstance(copy.error, CheckpointError)
    assert "'w' changed while it was copied" in str(copy.error)


def test_before_any_step_is_seen_a_save_copies_before_it_returns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gate: threading.Event
) -> None:
    """Until an optimizer's step has run the hook eagerly, nothing says the loop's changes
    will be seen before they are issued: the copy is made safe at once."""
    monkeypatch.setattr(copying._hooks, "seen_step", False)
    memory = arena.Arena(tmp_path, 0)
    state = {"w": torch.zeros(4)}
    memory.save(state, 1, rank=0, world_size=1, asynchronous=True)
    state["w"].add_(1)  # an update outside any optimizer
    gate.set()
    memory.wait()
    assert torch.equal(newest(tmp_path)["w"], torch.zeros(4))
    memory.close()


def test_a_compiled_step_is_seen_and_later_saves_are_made_safe_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torch.compile over a step traces the hook; the compiled code would not run it
    eagerly, so the copier stops trusting it. (torch's optimizers break the graph inside
    ``step`` themselves, so ``fullgraph=True`` over one is refused by torch.)"""
    monkeypatch.setattr(copying._hooks, "seen_step", True)
    monkeypatch.setattr(copying._hooks, "hidden", False)
    copying.Copier()  # the hook is installed before the step is compiled
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()

    @torch.compile(backend="eager")
    def step() -> None:
        optimizer.step()

    step()
    assert copying._hooks.hidden and not copying._hooks.trusted()


EXITING = """
import sys, time, torch
from rallypoint.checkpoint import arena, copying
finish = copying.Copier._finish
def slow(self, copy):
    time.sleep(float(sys.argv[2]))  # a large copy or a slow disk
    finish(self, copy)
copying.Copier._finish = slow
copying.EXIT_WAIT = float(sys.argv[3])
memory = arena.Arena(sys.argv[1], 0)
memory.save({"w": torch.full((256,), 7.0)}, 7, rank=0, world_size=1, asynchronous=True)
print("returning", flush=True)
"""


def run_script(tmp_path: Path, delay: float, most: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", EXITING, str(tmp_path), str(delay), str(most)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_an_asynchronous_save_still_in_flight_when_the_script_returns_is_kept(
    tmp_path: Path,
) -> None:
    done = run_script(tmp_path, delay=1.0, most=60.0)
    assert done.returncode == 0, done.stderr
    assert "waiting up to 60 s for checkpoint of step 7" in done.stderr
    assert torch.equal(newest(tmp_path)["w"], torch.full((256,), 7.0))


def test_the_exit_waits_for_a_save_a_bounded_time_and_says_it_is_lost(tmp_path: Path) -> None:
    began = time.monotonic()
    done = run_script(tmp_path, delay=30.0, most=0.5)
    assert time.monotonic() - began < 20
    assert "checkpoint of step 7 lost: not saved 0 s after the exit began" in done.stderr
    assert not Copies(tmp_path / slot.ARENA).newest()


# --- the arena's life in a process -------------------------------------------------------------


def test_every_dcp_save_of_a_process_shares_one_arena(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``RallypointWriter(step)`` per ``dcp.save`` (as docs/checkpointing.md shows it) maps
    the slots once: no file descriptor and no mapping more per save."""
    from rallypoint.checkpoint.dcp import RallypointWriter

    memory = tmp_path / "memory"
    (memory / slot.ARENA).mkdir(parents=True)
    for name, value in {"RALLYPOINT_MEMORY_TIER_DIR": str(memory), "RANK": "0", "WORLD_SIZE": "1",
                        "LOCAL_RANK": "0"}.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
    mapped = []
    monkeypatch.setattr(arena._Mapped, "_map", counted(arena._Mapped._map, mapped))
    opened = {}
    for step in range(1, 21):
        dcp.save({"w": torch.full((64, 64), float(step))}, storage_writer=RallypointWriter(step))
        opened[step] = len(os.listdir("/proc/self/fd"))
    assert opened[20] == opened[3]
    assert len(mapped) <= 3  # one per slot: keep (1) + in flight + the one being read
    assert len({id(a) for a in arena._ARENAS.values() if a.root == memory / slot.ARENA}) == 1


def counted(method: Any, calls: list[Any]) -> Any:
    def wrapper(self: Any, *args: Any) -> Any:
        calls.append(self)
        return method(self, *args)

    return wrapper


def test_a_slot_is_pinned_once_and_unpinned_before_it_is_unmapped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through a registration that counts its calls (no GPU here): a grown slot is
    unregistered, then registered again over its new mapping; a closed one is unregistered
    while still mapped, so no registration outlives its mapping."""
    calls: list[tuple[str, int, bool]] = []
    slot_file = tmp_path / "slot-0"
    slot_file.touch()

    def register(pointer: int, size: int, device: Any, what: str) -> None:
        calls.append(("register", pointer, mapped.mm is not None and not mapped.mm.closed))

    def unregister(pointer: int, device: Any) -> None:
        calls.append(("unregister", pointer, mapped.mm is not None and not mapped.mm.closed))

    monkeypatch.setattr(pinning, "register", register)
    monkeypatch.setattr(pinning, "unregister", unregister)
    mapped = arena._Mapped(slot_file)
    mapped.grow(1 << 20)
    for _ in range(3):
        mapped.pin(torch.device("cuda", 3))
    first = mapped.buffer.data_ptr()
    mapped.grow(2 << 20)
    mapped.close()
    assert [(op, alive) for op, _, alive in calls] == [
        ("register", True), ("unregister", True), ("register", True), ("unregister", True),
    ]  # fmt: skip
    assert calls[0][1] == calls[1][1] == first


def test_a_refused_registration_is_one_sentence_with_its_cause() -> None:
    text = pinning.refusal(712, "memory checkpoint slot /dev/shm/x/slot-0", 3 << 30, "name")
    assert text.startswith("cannot pin memory checkpoint slot /dev/shm/x/slot-0 (3.2 GB)")
    assert "error 712 (name)" in text and "registered already" in text
    assert "ulimit" not in pinning.refusal(2, "a slot", 1, "out of memory")


def test_the_cudart_torch_loaded_is_found_in_the_process_maps() -> None:
    maps = (
        "7f00-7f01 r-xp 00000000 08:01 12 /usr/lib/libc.so.6\n"
        "7f02-7f03 r-xp 00000000 08:01 13 /venv/nvidia/cuda_runtime/lib/libcudart.so.12\n"
    )
    assert pinning.cudart_path(maps) == "/venv/nvidia/cuda_runtime/lib/libcudart.so.12"
    assert pinning.cudart_path("7f00-7f01 rw-p 00000000 00:00 0 \n") is None
