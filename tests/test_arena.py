"""The arena (rallypoint.checkpoint.arena, .slot, .tree, .copies): memory checkpoints as raw
tensor bytes in slot files with a commit record, on the CPU here; the CUDA tests run where
a GPU is (the GPU check), and skip elsewhere."""

from __future__ import annotations

import collections
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from rallypoint.checkpoint import arena, copying, loading, slot, tree
from rallypoint.checkpoint.copies import Copies
from rallypoint.checkpoint.manifest import Damaged
from rallypoint.interfaces import CheckpointError
from servers import wait_until

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (the GPU check)")


def model_state() -> dict[str, Any]:
    """A model with buffers and its AdamW state after a step, and leaves of every kind."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.BatchNorm1d(16))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 16)).sum().backward()
    optimizer.step()
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "step": 7,
        "loss": 0.25,
        "best": float("inf"),
        "name": "run",
        "shape": torch.Size([2, 3]),
        "dtype": torch.bfloat16,
        "pair": (1, [2, None]),
        "odd": {
            "half": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3),
            "flags": torch.tensor([True, False]),
            "complex": torch.tensor([1 + 2j]),
            "scalar": torch.tensor(3.5),
            "empty": torch.zeros(0, 4),
            "strided": torch.arange(12.0).reshape(3, 4).t(),
        },
    }


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and bool(torch.equal(a, b))
        )
    if isinstance(a, dict):
        return type(a) is type(b) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    return bool(a == b) or (a != a and b != b)


def loaded(memory: Path, step: int | None = None, **options: Any) -> Any:
    copies = Copies(memory / slot.ARENA).newest()
    copy = copies[0] if step is None else next(c for c in copies if c.step == step)
    return loading.load_copy(copy, **options)


def test_a_state_round_trips_through_a_slot(tmp_path: Path) -> None:
    state = model_state()
    saves: list[arena.Saved] = []
    memory = arena.Arena(tmp_path, 0, saved=saves.append)
    memory.save(state, 7, rank=0, world_size=1)
    back = loaded(tmp_path)
    assert same(state, back)
    assert back["model"]._metadata == state["model"]._metadata  # a module's versions
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.BatchNorm1d(16))
    model.load_state_dict(back["model"])
    torch.optim.AdamW(model.parameters()).load_state_dict(back["optimizer"])
    assert [s.step for s in saves] == [7] and not saves[0].asynchronous
    memory.close()


def test_a_loaded_state_is_its_own(tmp_path: Path) -> None:
    """What a load returns does not share memory with the slot the next save writes."""
    memory = arena.Arena(tmp_path, 0)
    memory.save({"w": torch.ones(8)}, 1, rank=0, world_size=1)
    first = loaded(tmp_path)
    for step in (2, 3):
        memory.save({"w": torch.full((8,), float(step))}, step, rank=0, world_size=1)
    assert torch.equal(first["w"], torch.ones(8))
    memory.close()


def test_saves_take_turns_and_the_newest_keep_are_never_written_over(tmp_path: Path) -> None:
    for keep in (1, 2):
        root = tmp_path / f"keep{keep}"
        memory = arena.Arena(root, 0, keep=keep)
        for step in range(6):
            memory.save({"w": torch.full((4,), float(step))}, step, rank=0, world_size=1)
        assert len(slot.slots(memory.folder)) == keep + 1
        steps = [c.step for c in Copies(root / slot.ARENA).newest()]
        assert steps == list(range(5, 4 - keep, -1))
        memory.close()


#: A child that saves step 1, then step 2 of 64 MB, and says where it is in step 2's save.
CHILD = """
import sys, time
from pathlib import Path
import torch
from rallypoint.checkpoint import arena

root, mode = Path(sys.argv[1]), sys.argv[2]
memory = arena.Arena(root, 0)
memory.save({"w": torch.ones(16)}, 1, rank=0, world_size=1)
state = {"w": torch.full((16 << 20,), 2.0)}
if mode == "mid-copy":
    copy_ = torch.Tensor.copy_
    def slow(self, other, *args, **kwargs):
        (root / "copying").touch()
        time.sleep(60)  # killed here, the record saying WRITING
    torch.Tensor.copy_ = slow
memory.save(state, 2, rank=0, world_size=1)
(root / "returned").touch()
time.sleep(60)
"""


@pytest.mark.parametrize(("mode", "marker", "newest"), [
    ("mid-copy", "copying", 1),
    ("after", "returned", 2),
])  # fmt: skip
def test_a_sigkill_mid_copy_keeps_the_copy_before_and_after_save_keeps_this_one(
    tmp_path: Path, mode: str, marker: str, newest: int
) -> None:
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(CHILD), str(tmp_path), mode])
    try:
        assert wait_until(lambda: (tmp_path / marker).exists(), 60)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(30)
    copies = Copies(tmp_path / slot.ARENA).newest()
    assert copies[0].step == newest
    state = loaded(tmp_path)
    assert torch.equal(state["w"], torch.full_like(state["w"], float(newest)))
    # The next worker's arena takes over the slots, the unfinished one first.
    memory = arena.Arena(tmp_path, 0)
    memory.save({"w": torch.zeros(4)}, 3, rank=0, world_size=1)
    assert [c.step for c in Copies(tmp_path / slot.ARENA).newest()] == [3, newest]
    memory.close()


def test_a_torn_record_or_header_is_no_copy(tmp_path: Path) -> None:
    memory = arena.Arena(tmp_path, 0)
    memory.save({"w": torch.ones(4)}, 1, rank=0, world_size=1)
    memory.save({"w": torch.ones(4)}, 2, rank=0, world_size=1)
    memory.close()
    newest = Copies(tmp_path / slot.ARENA).newest()[0]
    for offset in (20, slot.PAGE + 30):  # the record's generation; the header's JSON
        data = bytearray(newest.path.read_bytes())
        data[offset] ^= 0x01
        newest.path.write_bytes(bytes(data))
        assert [c.step for c in Copies(tmp_path / slot.ARENA).newest()] == [1]
        data[offset] ^= 0x01
        newest.path.write_bytes(bytes(data))
    with open(newest.path, "rb") as handle:
        handle.seek(0)
        assert slot.read(handle)[0].step == 2


def test_a_save_that_does_not_fit_the_budget_says_so(tmp_path: Path) -> None:
    memory = arena.Arena(tmp_path, 0, budget=8 << 20)
    memory.save({"w": torch.ones(1 << 20)}, 1, rank=0, world_size=1)  # 4 MB
    with pytest.raises(CheckpointError, match="does not fit in the node memory given"):
        memory.save({"w": torch.ones(4 << 20)}, 2, rank=0, world_size=1)  # 16 MB
    assert [c.step for c in Copies(tmp_path / slot.ARENA).newest()] == [1]
    memory.close()


def test_the_node_s_arenas_share_one_budget(tmp_path: Path) -> None:
    first, second = (
        arena.Arena(tmp_path, 0, budget=12 << 20),
        arena.Arena(tmp_path, 1, budget=12 << 20),
    )
    first.save({"w": torch.ones(1 << 20)}, 1, rank=0, world_size=2)  # a 6 MB slot
    with pytest.raises(CheckpointError, match=r"taken by the node's slots"):
        second.save({"w": torch.ones(2 << 20)}, 1, rank=1, world_size=2)
    first.close()
    second.close()


def test_a_held_copy_is_not_written_over(tmp_path: Path) -> None:
    """The agent holds step 2's copy (to send it): the saves after it use a third slot."""
    memory = arena.Arena(tmp_path, 0)
    for step in (1, 2):
        memory.save({"w": torch.full((4,), float(step))}, step, rank=0, world_size=1)
    copies = Copies(tmp_path / slot.ARENA)
    with copies.hold(2) as held:
        for step in (3, 4, 5):
            memory.save({"w": torch.full((4,), float(step))}, step, rank=0, world_size=1)
        assert len(slot.slots(memory.folder)) == 3
        assert held.manifest.step == 2 and held.manifest.format == "arena"
        [(name, entry)] = held.manifest.files.items()
        with held.open(name) as handle:
            assert len(handle.read()) == entry.size
    assert torch.equal(loaded(tmp_path, 5)["w"], torch.full((4,), 5.0))
    memory.close()


def test_holding_a_copy_written_over_meanwhile_is_refused(tmp_path: Path) -> None:
    memory = arena.Arena(tmp_path, 0)
    memory.save({"w": torch.ones(4)}, 1, rank=0, world_size=1)
    copy = Copies(tmp_path / slot.ARENA).newest()[0]
    memory.save({"w": torch.ones(4)}, 2, rank=0, world_size=1)
    memory.save({"w": torch.ones(4)}, 3, rank=0, world_size=1)  # into step 1's slot
    with pytest.raises(slot.Busy), slot.lease(copy):
        pass
    with pytest.raises(Damaged), Copies(tmp_path / slot.ARENA).hold(1):
        pass
    memory.close()


def test_an_asynchronous_save_holds_the_optimizer_s_step_until_it_is_copied(
    tmp_path: Path, gate: threading.Event
) -> None:
    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    memory = arena.Arena(tmp_path, 0)
    model(torch.randn(2, 64)).sum().backward()
    optimizer.step()  # seen by the hook: the next saves' copies run while the loop goes on
    before = collections.OrderedDict((k, v.clone()) for k, v in model.state_dict().items())
    memory.save(model.state_dict(), 1, rank=0, world_size=1, asynchronous=True)
    model(torch.randn(2, 64)).sum().backward()
    stepped = threading.Thread(target=optimizer.step)
    stepped.start()
    time.sleep(0.2)
    assert stepped.is_alive()  # the step waits for the copy
    gate.set()
    stepped.join(30)
    memory.wait()
    assert same(loaded(tmp_path), before)
    assert not torch.equal(model.weight, before["weight"])
    memory.close()


def test_an_asynchronous_copy_whose_tensor_changed_is_not_kept(
    tmp_path: Path,
    gate: threading.Event,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(copying._hooks, "seen_step", True)  # the copy runs in the thread
    monkeypatch.setattr(copying._hooks, "hidden", False)
    memory = arena.Arena(tmp_path, 0)
    state = {"running_mean": torch.zeros(8)}
    memory.save(state, 1, rank=0, world_size=1)
    memory.save(state, 2, rank=0, world_size=1, asynchronous=True)
    state["running_mean"].add_(1)  # a forward pass updating a buffer, before the copy
    gate.set()
    with pytest.raises(CheckpointError, match="'running_mean' changed while it was copied"):
        memory.wait()
    assert [c.step for c in Copies(tmp_path / slot.ARENA).newest()] == [1]
    memory.close()


def test_two_asynchronous_saves_at_most_are_copied_at_once(
    tmp_path: Path, gate: threading.Event
) -> None:
    memory = arena.Arena(tmp_path, 0)
    for step in (1, 2):
        memory.save({"w": torch.ones(4)}, step, rank=0, world_size=1, asynchronous=True)
    third = threading.Thread(
        target=memory.save, args=({"w": torch.ones(4)}, 3), kwargs={"rank": 0, "world_size": 1}
    )
    third.start()
    time.sleep(0.2)
    assert third.is_alive()
    gate.set()
    third.join(30)
    memory.wait()
    assert [c.step for c in Copies(tmp_path / slot.ARENA).newest()][:2] == [3, 2]
    memory.close()


def test_the_tree_keeps_what_json_cannot_hold_apart() -> None:
    state = model_state()
    node, tensors, others = tree.encode(state)
    assert len(tensors) == len(tree.paths(node))
    assert "model.0.weight" in tree.paths(node)
    assert torch.Size([2, 3]) in others and torch.bfloat16 in others
    assert same(tree.decode(node, tensors, others), state)


def test_a_sparse_tensor_is_refused_with_one_sentence(tmp_path: Path) -> None:
    memory = arena.Arena(tmp_path, 0)
    with pytest.raises(CheckpointError, match=r"'w': a torch\.sparse_coo tensor cannot go"):
        memory.save({"w": torch.eye(3).to_sparse()}, 1, rank=0, world_size=1)
    memory.close()


def test_map_location_moves_the_tensors(tmp_path: Path) -> None:
    memory = arena.Arena(tmp_path, 0)
    memory.save({"w": torch.ones(2)}, 1, rank=0, world_size=1)
    assert loaded(tmp_path, map_location=None)["w"].device.type == "cpu"
    assert loaded(tmp_path, map_location={"cpu": "meta"})["w"].device.type == "meta"
    with pytest.raises(CheckpointError, match="map_location as a function"):
        loaded(tmp_path, map_location=lambda storage, location: storage)
    memory.close()


@CUDA
def test_cuda_state_is_copied_pinned_and_loads_to_the_gpu(tmp_path: Path) -> None:
    model = torch.nn.Linear(256, 256).cuda()
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(8, 256, device="cuda")).sum().backward()
    optimizer.step()
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    memory = arena.Arena(tmp_path, 0)
    memory.save(state, 1, rank=0, world_size=1)
    assert all(m.pinned for m in memory._mapped.values() if m.size)
    back = loaded(tmp_path, map_location="cuda")
    assert back["model"]["weight"].is_cuda and same(back, state)
    memory.save(state, 2, rank=0, world_size=1, asynchronous=True)
    model(torch.randn(8, 256, device="cuda")).sum().backward()
    optimizer.step()  # its stream waits for the copy
    memory.wait()
    assert not torch.equal(loaded(tmp_path, map_location="cuda")["model"]["weight"], model.weight)
    memory.close()


def test_a_slot_file_is_readable_without_torch(tmp_path: Path) -> None:
    """What the agent needs of a copy: the record and the header, stdlib only."""
    memory = arena.Arena(tmp_path, 0)
    memory.save({"a": torch.ones(3), "b": {"c": torch.zeros(2, 2)}}, 4, rank=0, world_size=2)
    memory.close()
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from pathlib import Path\n"
        "from rallypoint.checkpoint import slot\n"
        f"[copy] = slot.committed(Path({str(tmp_path / slot.ARENA)!r}))\n"
        "handle = open(copy.path, 'rb')\n"
        "record, raw = slot.read(handle)\n"
        "header, others = slot.Header.decode(raw)\n"
        "print(record.step, record.world_size, [t.shape for t in header.tensors], others)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "4 2 [(3,), (2, 2)] b''", out.stderr


def test_an_ordered_dict_and_metadata_survive(tmp_path: Path) -> None:
    state = collections.OrderedDict([("w", torch.ones(1))])
    state._metadata = {"": {"version": 2}}  # type: ignore[attr-defined]
    memory = arena.Arena(tmp_path, 0)
    memory.save(state, 1, rank=0, world_size=1)
    back = loaded(tmp_path)
    assert type(back) is collections.OrderedDict and back._metadata == {"": {"version": 2}}
    memory.close()


def test_without_room_for_a_third_slot_a_save_waits_for_the_reader(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    memory = arena.Arena(tmp_path, 0, budget=4 << 20)  # two 2 MB slots
    for step in (1, 2):
        memory.save({"w": torch.full((1024,), float(step))}, step, rank=0, world_size=1)
    copies = Copies(tmp_path / slot.ARENA)
    third = threading.Thread(
        target=memory.save,
        args=({"w": torch.full((1024,), 3.0)}, 3),
        kwargs={"rank": 0, "world_size": 1},
    )
    with copies.hold(1):
        third.start()
        time.sleep(0.3)
        assert third.is_alive()  # step 2's slot is the newest, step 1's is held
    third.join(30)
    assert [c.step for c in copies.newest()] == [3, 2]
    assert "room for 3 copies per worker that saves" in caplog.text
    memory.close()


FULL = """
import sys, torch
from rallypoint.checkpoint import arena
from rallypoint.interfaces import CheckpointError
try:
    arena.Arena(sys.argv[1], 0).save({"w": torch.ones(2 << 20)}, 1, rank=0, world_size=1)
except CheckpointError as error:
    print(error)
"""


def test_a_full_shared_memory_fails_the_save_with_a_sentence_not_sigbus(tmp_path: Path) -> None:
    """A slot's space is reserved when it is made: in a 4 MB tmpfs (its own mount
    namespace) an 8 MB save says so, where a sparse slot would SIGBUS at its first write."""
    small = tmp_path / "shm"
    small.mkdir()
    done = subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
         'mount -t tmpfs -o size=4m tmpfs "$1" && exec "$2" -c "$3" "$1"', "-",
         str(small), sys.executable, FULL],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "cannot reserve 10 MB of shared memory for the memory checkpoint slot" in done.stdout
    assert "No space left on device" in done.stdout
