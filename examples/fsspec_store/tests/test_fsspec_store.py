"""The fsspec checkpoint backend: its storage operations, rallypoint's checkpoint format on
top of it, its registration, and a real ``rallypoint run`` that saves and resumes.

Everything runs on real files through fsspec's local file system (``local://``, the
``rename`` way of writing). The storage operations also run on fsspec's in-process memory
file system, which takes the ``upload`` way, the one S3, GCS and Azure take. No object
store is reached from here: neither an S3-compatible server nor credentials are assumed.
"""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Callable, Iterator
from importlib.util import find_spec
from pathlib import Path

import fsspec
import pytest
import torch

from rallypoint.checkpoint import Checkpointer
from rallypoint.sdk import CheckpointError, UsageError
from rallypoint.testing.helpers import (
    CHECKPOINT_MANIFEST,
    PluginManager,
    build_plugin_manager,
    checkpoint_backend_for,
    checkpoint_directory,
    checkpoint_step,
)
from rallypoint_fsspec.storage import TEMPORARY, FsspecStorage

HERE = Path(__file__).parent
PLUGIN = HERE.parent
GUIDE = PLUGIN.parents[1] / "docs" / "checkpoint-storage.md"
RALLYPOINT = str(Path(sys.executable).parent / "rallypoint")
#: Bound on every subprocess and every wait for one.
TIMEOUT = 120


@pytest.fixture(autouse=True)
def _fresh_plugin_manager(rallypoint_pm: PluginManager) -> Iterator[None]:
    """Checkpointer(url) finds the store through the cached plugin manager: start clean."""
    yield


def memory_url() -> str:
    """A fresh place in fsspec's memory file system (one for the whole process)."""
    return f"memory://rallypoint-fsspec-test-{uuid.uuid4().hex}"


def remove(url: str) -> None:
    fs, root = fsspec.core.url_to_fs(url)
    if fs.exists(root):
        fs.rm(root, recursive=True)


@pytest.fixture(params=["local", "memory"])
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[FsspecStorage]:
    """A storage of each write mode: local (rename) and memory (upload)."""
    url = f"local://{tmp_path}/checkpoints" if request.param == "local" else memory_url()
    yield FsspecStorage(url)
    remove(url)


def write(storage: FsspecStorage, name: str, data: bytes) -> None:
    with storage.writer(name) as handle:
        handle.write(data)


def read(storage: FsspecStorage, name: str) -> bytes:
    with storage.reader(name) as handle:
        data: bytes = handle.read()
    return data


# --- storage -------------------------------------------------------------------------------


def test_each_file_system_gets_its_write_mode(tmp_path: Path) -> None:
    assert FsspecStorage(f"local://{tmp_path}").write_mode == "rename"
    assert FsspecStorage("memory://rallypoint-fsspec-mode").write_mode == "upload"


def test_an_exception_inside_writer_leaves_the_previous_object(storage: FsspecStorage) -> None:
    write(storage, "a/blob", b"old")
    with pytest.raises(RuntimeError), storage.writer("a/blob") as handle:
        handle.write(b"new, half")
        handle.flush()
        raise RuntimeError("the worker fails here")
    assert read(storage, "a/blob") == b"old"
    with pytest.raises(RuntimeError), storage.writer("a/fresh") as handle:
        handle.write(b"never finished")
        raise RuntimeError("the worker fails here")
    assert storage.names() == ["a/blob"]
    # Nothing is left behind either, not even a hidden temporary.
    assert storage.fs.find(storage.root) == [storage.path("a/blob")]


def test_names_never_show_an_unfinished_write(storage: FsspecStorage) -> None:
    write(storage, "step/old", b"old")
    with storage.writer("step/new") as new, storage.writer("step/old") as old:
        new.write(b"new" * 1000)
        old.write(b"replacement" * 1000)
        new.flush()
        old.flush()
        assert storage.names() == ["step/old"]
        assert read(storage, "step/old") == b"old"
    assert storage.names() == ["step/new", "step/old"]
    assert read(storage, "step/new") == b"new" * 1000
    assert read(storage, "step/old") == b"replacement" * 1000


def test_delete_removes_a_prefix_and_nothing_beside_it(storage: FsspecStorage) -> None:
    for name in ("step-1/a", "step-1/sub/b", "step-10/a", "step-1x"):
        write(storage, name, name.encode())
    storage.delete("step-1")
    assert storage.names() == ["step-10/a", "step-1x"]
    storage.delete("step-1x")
    storage.delete("step-1")  # nothing to remove is fine
    storage.delete("never-written")
    assert storage.names() == ["step-10/a"]
    assert read(storage, "step-10/a") == b"step-10/a"


def test_reading_a_missing_name_raises_file_not_found(storage: FsspecStorage) -> None:
    with pytest.raises(FileNotFoundError), storage.reader("nothing"):
        pass
    assert storage.names() == []


def test_a_process_killed_mid_write_leaves_the_previous_object(tmp_path: Path) -> None:
    url = f"local://{tmp_path}/checkpoints"
    storage = FsspecStorage(url)
    write(storage, "step/blob", b"old")
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
                import time
                from rallypoint_fsspec.storage import FsspecStorage
                with FsspecStorage({url!r}).writer("step/blob") as handle:
                    handle.write(b"new" * 100_000)
                    handle.flush()
                    print("writing", flush=True)
                    time.sleep({TIMEOUT})
            """),
        ],
        stdout=subprocess.PIPE,
    )
    try:
        assert child.stdout is not None
        ready, _, _ = select.select([child.stdout], [], [], TIMEOUT)
        assert ready and child.stdout.readline() == b"writing\n"
        child.send_signal(signal.SIGKILL)
        assert child.wait(timeout=TIMEOUT) == -signal.SIGKILL
    finally:
        child.kill()
        child.wait(timeout=TIMEOUT)
    assert storage.names() == ["step/blob"]
    assert read(storage, "step/blob") == b"old"
    leftovers = [p.name for p in (tmp_path / "checkpoints" / "step").iterdir()]
    assert len(leftovers) == 2 and any(n.startswith(TEMPORARY + "blob-") for n in leftovers)


def test_a_missing_backend_is_one_clear_error() -> None:
    with pytest.raises(CheckpointError, match="'nosuchfs://bucket/run'"):
        FsspecStorage("nosuchfs://bucket/run")


# --- registration --------------------------------------------------------------------------


def test_the_plugin_serves_local_and_the_object_stores_installed_here() -> None:
    pm = build_plugin_manager({})
    assert pm.infos["fsspec"].status == "active", pm.infos["fsspec"].error
    assert checkpoint_backend_for("local:///data/ckpt", pm).name == "fsspec"
    assert checkpoint_backend_for("file:///data/ckpt", pm).name == "file"
    assert checkpoint_backend_for("/data/ckpt", pm).name == "file"
    if find_spec("s3fs") is None:
        with pytest.raises(UsageError, match="local://"):
            checkpoint_backend_for("s3://bucket/run42", pm)
    else:
        assert checkpoint_backend_for("s3://bucket/run42", pm).name == "fsspec"


# --- the checkpoint format on top ----------------------------------------------------------

MakeCheckpointer = Callable[..., Checkpointer]


@pytest.fixture(params=["local", "memory"])
def make_checkpointer(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[MakeCheckpointer]:
    """Checkpointers on one storage. ``local`` is opened by URL, as a worker opens it;
    ``memory`` (no URL: it would be another store in each process) is handed its storage."""
    url = f"local://{tmp_path}/run" if request.param == "local" else memory_url()

    def make(keep_last: int = 3) -> Checkpointer:
        if request.param == "memory":
            storage = FsspecStorage(url)
            return Checkpointer(storage=storage, keep_last=keep_last, rank=0, world_size=2)
        checkpointer = Checkpointer(url, keep_last=keep_last, rank=0, world_size=2)
        assert isinstance(checkpointer.storage, FsspecStorage)
        return checkpointer

    yield make
    remove(url)


def state_of(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((4,), value)}


def files_by_step(names: list[str]) -> dict[int, set[str]]:
    """The files of each checkpoint, by step; each must hold a payload and its manifest
    (the format may add files of its own)."""
    steps: dict[int, set[str]] = {}
    for name in names:
        directory, file = name.split("/", 1)
        step = checkpoint_step(directory)
        assert step is not None, name
        steps.setdefault(step, set()).add(file)
    for files in steps.values():
        assert {CHECKPOINT_MANIFEST, "state.pt"} <= files
    return steps


def test_save_load_and_keep_last(make_checkpointer: MakeCheckpointer) -> None:
    checkpointer = make_checkpointer(keep_last=2)
    assert checkpointer.load_latest() is None
    for step in range(5):
        checkpointer.save(state_of(step), step)
    assert checkpointer.steps() == [3, 4]
    assert files_by_step(checkpointer.storage.names()).keys() == {3, 4}
    loaded = make_checkpointer(keep_last=2).load_latest()  # a fresh one, as after a restart
    assert loaded is not None
    assert (loaded.step, loaded.world_size, loaded.skipped) == (4, 2, ())
    assert torch.equal(loaded.state["w"], state_of(4)["w"])


@pytest.mark.parametrize(
    "damage, reason",
    [
        (lambda data: data[: len(data) // 2], "has"),  # truncated: "has N bytes"
        (lambda data: data[:-1] + bytes([data[-1] ^ 1]), "does not match its checksum"),
    ],
    ids=["truncated", "bad-checksum"],
)
def test_a_damaged_checkpoint_is_skipped_for_the_previous_one(
    make_checkpointer: MakeCheckpointer,
    damage: Callable[[bytes], bytes],
    reason: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    checkpointer = make_checkpointer()
    checkpointer.save(state_of(1.0), 1)
    checkpointer.save(state_of(2.0), 2)
    name = f"{checkpoint_directory(2)}/state.pt"
    with checkpointer.storage.reader(name) as handle:
        data = handle.read()
    with checkpointer.storage.writer(name) as handle:
        handle.write(damage(data))
    loaded = checkpointer.load_latest()
    assert loaded is not None and loaded.step == 1
    assert torch.equal(loaded.state["w"], state_of(1.0)["w"])
    assert len(loaded.skipped) == 1
    assert loaded.skipped[0].startswith(f"{checkpoint_directory(2)}: state.pt {reason}")
    assert f"checkpoint {checkpoint_directory(2)} skipped" in caplog.text


def test_an_unfinished_checkpoint_is_skipped(make_checkpointer: MakeCheckpointer) -> None:
    checkpointer = make_checkpointer()
    checkpointer.save(state_of(1.0), 1)
    with checkpointer.storage.writer(f"{checkpoint_directory(2)}/state.pt") as handle:
        torch.save(state_of(2.0), handle)  # the payload of step 2, never its manifest
    assert checkpointer.steps() == [1]
    loaded = checkpointer.load_latest()
    assert loaded is not None and loaded.step == 1
    assert loaded.skipped == (f"{checkpoint_directory(2)}: unfinished (no manifest)",)


# --- a real run ----------------------------------------------------------------------------


def rallypoint(*args: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """``rallypoint`` as a user runs it, without this process's launcher settings."""
    agent_tmp = tmp_path / "agent-tmp"
    agent_tmp.mkdir(exist_ok=True)
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("RALLYPOINT_", "PET_", "TORCHELASTIC_"))
        and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    return subprocess.run(
        [RALLYPOINT, *args],
        env={**env, "TMPDIR": str(agent_tmp)},
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )


def test_a_run_saves_to_local_urls_and_the_next_run_resumes(tmp_path: Path) -> None:
    url = f"local://{tmp_path}/checkpoints"

    def run(name: str) -> tuple[list[dict[str, object]], list[dict[str, object]]]:
        out = tmp_path / name
        out.mkdir()
        events = tmp_path / f"{name}.jsonl"
        result = rallypoint(
            "run", "--standalone", "--nproc-per-node", "2", "--checkpoint-dir", url,
            "--event-log", str(events), str(HERE / "checkpoint_worker.py"), "5", str(out),
            tmp_path=tmp_path,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        reports = [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]
        records = [json.loads(line) for line in events.read_text().splitlines()]
        return reports, records

    first, records = run("first")
    for report in first:
        assert report == {
            "url": url,
            "storage": "FsspecStorage",
            "loaded_step": None,
            "state": None,
        }
    saves = [r for r in records if r["event"] == "checkpoint_saved"]
    assert [r["step"] for r in saves] == [0, 1, 2, 3, 4]
    # The files are real, in the directory the URL names; keep_last (3) held.
    root = tmp_path / "checkpoints"
    names = [p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()]
    assert files_by_step(names).keys() == {2, 3, 4}
    assert not [name for name in names if TEMPORARY in name]

    second, records = run("second")
    for report in second:
        assert report == {
            "url": url,
            "storage": "FsspecStorage",
            "loaded_step": 4,
            "state": [4.0, 4.0, 4.0],
        }
    loads = [r for r in records if r["event"] == "checkpoint_loaded"]
    assert sorted((r["rank"], r["step"]) for r in loads) == [(0, 4), (1, 4)]
    assert not [r for r in records if r["event"] == "checkpoint_saved"]


# --- the guide -----------------------------------------------------------------------------


def test_the_guide_quotes_this_plugin_as_it_is() -> None:
    """Every excerpt in docs/checkpoint-storage.md headed ``# rallypoint_fsspec/<file>``,
    and the pyproject.toml one, is a verbatim piece of that file."""
    blocks = re.findall(
        r"^```(python|toml)\n(.*?)^```", GUIDE.read_text(), re.DOTALL | re.MULTILINE
    )
    quoted = []
    for language, block in blocks:
        if language == "toml":
            quoted.append(("pyproject.toml", block))
            continue
        heading, _, body = block.partition("\n")
        if heading.startswith("# rallypoint_fsspec/"):
            quoted.append((heading.removeprefix("# "), body))
    assert len(quoted) == 6
    for path, body in quoted:
        assert body in (PLUGIN / path).read_text(), f"the guide's excerpt of {path} differs"
