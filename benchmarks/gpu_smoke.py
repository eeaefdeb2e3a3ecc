"""The GPU check's first part: what a CPU cannot show about the memory checkpoint arena's CUDA
path, in five cases, each in a process of its own, under five minutes on one GPU. One line
per result: ``PASS name: detail``, ``FAIL name: why`` or ``SKIP name: why`` (case 4 on a
machine with one GPU); the exit status is 1 when any failed.

    python benchmarks/gpu_smoke.py                      # every case, on the GPU
    python benchmarks/gpu_smoke.py --case 3             # one case, in this process
    python benchmarks/gpu_smoke.py --device cpu         # a dry run of cases 1, 2 and 5

Everything it writes to /dev/shm goes to one temporary folder (under ``--shm``), removed at
the end; ``gpu-check.sh`` removes its own ``--shm`` folder too, if this is killed.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import faulthandler
import json
import logging
import mmap
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

#: Each case's names (the lines it prints) and how long its process may take, in seconds.
CASES: dict[int, tuple[tuple[str, ...], float]] = {
    1: (("fused-adamw-batchnorm", "adamw-cpu-step"), 120),
    2: (("dcp-saves-steady",), 60),
    3: (("failed-pin-then-kernel",), 30),
    4: (("other-gpu-no-context",), 60),
    5: (("async-save-then-exit",), 60),
}
CPU_CASES = (1, 2, 5)  # the dry run's: 3 and 4 need CUDA
BUDGET = 270.0  # seconds for all the cases together (gpu-check.sh bounds it at 290)
STEPS = 50  # case 1's training steps, a save after each
PROBES = 5  # case 1's saves each followed at once by a step
Result = tuple[str, str, str]  # ("PASS" | "FAIL" | "SKIP", name, detail)


# --- case 1: training with a save after every step ------------------------------------------


def model_with_batchnorm(device: str) -> Any:
    """Convolutions and linear layers with BatchNorm between them: about 200 MB of state
    with AdamW on a GPU (its running statistics change in every forward pass)."""
    import torch
    from torch import nn

    wide = 4096 if device == "cuda" else 512
    return nn.Sequential(
        nn.Conv2d(3, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
        nn.Conv2d(64, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
        nn.AdaptiveAvgPool2d(4), nn.Flatten(),
        nn.Linear(1024, wide), nn.BatchNorm1d(wide), nn.ReLU(),
        nn.Linear(wide, wide // 2), nn.BatchNorm1d(wide // 2), nn.ReLU(),
        nn.Linear(wide // 2, wide // 2), nn.BatchNorm1d(wide // 2), nn.ReLU(),
        nn.Linear(wide // 2, 10),
    ).to(torch.device(device))  # fmt: skip


def train_and_save(device: str, fused: bool, shm: Path) -> dict[str, Any]:
    """STEPS steps of forward, backward, ``optimizer.step()`` and an asynchronous save of
    the model's and the optimizer's state; then PROBES saves each followed at once by a
    step (its copy is surely in flight). What happened, for ``judge_training``."""
    import torch

    from rallypoint.checkpoint import arena, copies, loading, slot

    torch.manual_seed(0)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    model = model_with_batchnorm(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True if fused else None)
    inputs = torch.randn(32, 3, 16, 16, device=device)
    targets = torch.randint(0, 10, (32,), device=device)
    saved: list[arena.Saved] = []
    errors = _Errors()
    memory = arena.Arena(shm, 0, saved=saved.append)
    found: dict[str, Any] = {"committed": 0, "error": "", "differs": "", "copy": []}
    found.update(alone=[], in_step=[], probes=[])  # the host's seconds inside step()

    def backward() -> None:
        torch.nn.functional.cross_entropy(model(inputs), targets).backward()

    def update(times: list[float]) -> None:
        began = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - began)
        optimizer.zero_grad(set_to_none=True)

    def state() -> dict[str, Any]:
        return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}

    try:
        for _ in range(5):  # no save: the first makes the optimizer's state
            backward()
            update(found["alone"])
        sync()
        for number in range(1, STEPS + 1):  # a save of the step before in flight from 2 on
            backward()
            update(found["in_step"])
            memory.save(state(), number, rank=0, world_size=1, asynchronous=True)
        memory.wait()
        sync()
        found["committed"] = len(saved)
        newest = copies.Copies(shm / slot.ARENA).newest()
        if not newest or newest[0].step != STEPS:
            found["differs"] = f"the newest copy is of step {newest[0].step if newest else None}"
        else:
            found["differs"] = differs(state(), loading.load_copy(newest[0], map_location=device))
        for number in range(STEPS + 1, STEPS + 1 + PROBES):  # a step while a copy surely runs
            backward()
            sync()
            before = len(saved)
            memory.save(state(), number, rank=0, world_size=1, asynchronous=True)
            update(found["probes"])
            memory.wait()
            sync()
            found["copy"] += [done.seconds for done in saved[before:]]
    except Exception as error:  # the case's failure
        found["error"] = f"{type(error).__name__}: {error}"
        found["committed"] = found["committed"] or len(saved)
    finally:
        with contextlib.suppress(Exception):
            memory.close()
        errors.close()
    found["error"] = found["error"] or errors.first
    found["in_step"] = found["in_step"][1:]  # step 1: no save in flight yet
    found["alone"] = found["alone"][1:]  # the step that made the optimizer's state
    return found


def judge_training(device: str, shm: Path) -> list[Result]:
    """Case 1. Fused AdamW (its ``step`` a CUDA tensor) on a model with BatchNorm, an
    asynchronous save after every step: every save is committed and the newest equals the
    state. Proves absent: saves refused or lost because the next forward pass changed the
    BatchNorm statistics (or the next step the parameters) while the GPU's copy, which
    the loop's stream orders, was still running; an error of a save in flight; a copy
    that is not the state that was saved. Then the default AdamW, whose ``step`` is a CPU
    tensor: the host's time inside ``optimizer.step()`` stays far below a save's copy time.
    Proves absent: a step that holds the host until the GPU's copy is done (the CPU
    tensor's copy waited for with the GPU's)."""
    results = []
    for fused, name in ((True, "fused-adamw-batchnorm"), (False, "adamw-cpu-step")):
        found = train_and_save(device, fused, _fresh(shm, name))
        results.append(_training_result(name, found, judge_step=not fused, device=device))
    return results


def _training_result(name: str, found: dict[str, Any], judge_step: bool, device: str) -> Result:
    ms = {key: 1000 * max(found[key] or [0.0]) for key in ("alone", "in_step", "probes")}
    copy = 1000 * statistics.median(found["copy"] or [0.0])
    timing = (
        f"longest host time in step() {ms['in_step']:.1f} ms with a save of the step before "
        f"in flight, {ms['probes']:.1f} ms right after a save, {ms['alone']:.1f} ms with "
        f"no save; a save's copy {copy:.1f} ms (median)"
    )
    if found["committed"] != STEPS or found["error"] or found["differs"]:
        why = found["error"] or found["differs"] or "no error said"
        return "FAIL", name, f"{found['committed']} of {STEPS} saves committed; {why}"
    if judge_step and device == "cuda" and ms["probes"] >= copy / 2:
        return "FAIL", name, f"step() waits for the copy: {timing}"
    return "PASS", name, f"{STEPS} saves committed, the newest equals the state; {timing}"


def differs(expected: Any, found: Any, path: str = "state") -> str:
    """Where ``found`` differs from ``expected`` (tensors by value, on either's device);
    "" when it does not."""
    import torch

    if torch.is_tensor(expected):
        if not torch.is_tensor(found) or found.shape != expected.shape:
            return f"{path}: {found!r:.80} where a tensor of {tuple(expected.shape)} was saved"
        if found.dtype != expected.dtype or not torch.equal(found.to(expected.device), expected):
            return f"{path}: other values than the state's"
        return ""
    if isinstance(expected, dict):
        if not isinstance(found, dict) or set(found) != set(expected):
            return (
                f"{path}: keys {sorted(map(str, found))[:5]} where {sorted(map(str, expected))[:5]}"
            )
        return next(
            (d for k in expected if (d := differs(expected[k], found[k], f"{path}[{k!r}]"))), ""
        )
    if isinstance(expected, (list, tuple)):
        if not isinstance(found, (list, tuple)) or len(found) != len(expected):
            return f"{path}: {found!r:.80} where {expected!r:.80}"
        pairs = zip(expected, found, strict=True)
        return next(
            (d for i, (e, f) in enumerate(pairs) if (d := differs(e, f, f"{path}[{i}]"))), ""
        )
    return "" if expected == found else f"{path}: {found!r:.80} where {expected!r:.80}"


class _Errors(logging.Handler):
    """The first error the checkpoint code logs (an asynchronous save's, from its thread)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.first = ""
        logging.getLogger("rallypoint.checkpoint").addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.first = self.first or record.getMessage()

    def close(self) -> None:
        logging.getLogger("rallypoint.checkpoint").removeHandler(self)
        super().close()


# --- case 2: DCP saves, one after another ---------------------------------------------------


def dcp_saves(device: str, shm: Path) -> list[Result]:
    """Case 2. Twenty ``torch.distributed.checkpoint.save`` calls through
    ``RallypointWriter`` in one process (a world of one, the environment of a ``rallypoint
    run --checkpoint-memory`` worker), of a CUDA state: as many open file descriptors after
    the 20th as after the 2nd, and as many pinned registrations live. Proves absent: an
    arena (its slot files' descriptors, mappings and page-locked ranges) made anew by each
    writer and never closed, which exhausts the descriptors and pinned memory of a long
    run."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from rallypoint.checkpoint import copies, slot

    name = "dcp-saves-steady"
    os.environ.update(worker_environment(shm, 0, 2 << 30))
    backend = "cpu:gloo,cuda:nccl" if device == "cuda" else "gloo"
    dist.init_process_group(backend, rank=0, world_size=1)
    counts = {}
    try:
        from rallypoint.checkpoint.dcp import RallypointWriter

        layer = torch.nn.Linear(2048, 2048, device=device)
        with _counting_pins() as live:
            for step in range(1, 21):
                with torch.no_grad():
                    layer.weight.add_(1.0)
                dcp.save({"model": layer.state_dict()}, storage_writer=RallypointWriter(step))
                if step in (2, 20):
                    counts[step] = (len(os.listdir("/proc/self/fd")), sum(live.values()))
        newest = copies.Copies(shm / slot.ARENA).newest(sharded=True)
    finally:
        dist.destroy_process_group()
    (fds2, pins2), (fds20, pins20) = counts[2], counts[20]
    detail = f"open descriptors {fds2} after save 2, {fds20} after save 20"
    detail += f"; pinned ranges live {pins2}, {pins20}"
    if not newest or newest[0].step != 20:
        newest_step = newest[0].step if newest else None
        return [("FAIL", name, f"the newest copy is of step {newest_step}; {detail}")]
    if fds20 != fds2 or pins20 != pins2:
        return [("FAIL", name, f"they grow: {detail}")]
    if device == "cuda" and pins2 == 0:
        return [("FAIL", name, f"no range pinned through rallypoint.checkpoint.pinning: {detail}")]
    return [("PASS", name, detail)]


@contextlib.contextmanager
def _counting_pins() -> Iterator[dict[int, int]]:
    """``rallypoint.checkpoint.pinning``'s ``register`` and ``unregister`` counted while the
    block runs: the registrations live, by pointer."""
    from rallypoint.checkpoint import pinning

    live: dict[int, int] = {}
    register, unregister = pinning.register, pinning.unregister

    def counted_register(pointer: int, size: int, device: Any, what: str) -> None:
        register(pointer, size, device, what)
        live[pointer] = live.get(pointer, 0) + 1

    def counted_unregister(pointer: int, device: Any) -> None:
        unregister(pointer, device)
        live[pointer] = live.get(pointer, 0) - 1

    pinning.register, pinning.unregister = counted_register, counted_unregister
    try:
        yield live
    finally:
        pinning.register, pinning.unregister = register, unregister


def worker_environment(shm: Path, local_rank: int, budget: int) -> dict[str, str]:
    """What ``rallypoint run --checkpoint-memory`` gives a worker for its memory checkpoints
    (``rallypoint.agent.processes.environment``), with ``shm`` as the agent's memory
    directory, and a world of one on a free loopback port."""
    from rallypoint.worker import variables

    (shm / "arena").mkdir(parents=True, exist_ok=True)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return {
        variables.CHECKPOINT_MEMORY_DIR: str(shm),
        variables.CHECKPOINT_MEMORY_BYTES: str(budget),
        variables.CHECKPOINT_MEMORY_KEEP: "1",
        variables.LOCAL_RANK: str(local_rank),
        variables.NODE_LOCAL_RANK: str(local_rank),
        variables.RANK: "0",
        variables.WORLD_SIZE: "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }


# --- case 3: a refused registration, then a kernel ------------------------------------------


def failed_pin(device: str, shm: Path) -> list[Result]:
    """Case 3. 4 MiB of a /dev/shm file, mapped and registered with ``pinning.register``
    twice: the second raises ``CheckpointError`` naming CUDA's error 712, and a kernel
    launched next runs. Proves absent: a refusal that is not said in a sentence, and the
    runtime's sticky last error left behind, which the next kernel launch would raise as
    its own."""
    import torch

    from rallypoint.checkpoint import pinning
    from rallypoint.interfaces import CheckpointError

    name, size = "failed-pin-then-kernel", 4 << 20
    path = shm / "range"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.ftruncate(fd, size)
        mapped = mmap.mmap(fd, size, mmap.MAP_SHARED)
    finally:
        os.close(fd)
    data = torch.frombuffer(mapped, dtype=torch.uint8)
    pointer, gpu = data.data_ptr(), torch.device("cuda", 0)
    said, result, refused = "", "", ""
    try:
        pinning.register(pointer, size, gpu, "the test range")
        try:
            pinning.register(pointer, size, gpu, "the test range")
            said = "the second registration raised nothing"
        except CheckpointError as error:
            said = "" if "712" in str(error) else f"the error does not name 712: {error}"
            refused = str(error)
        try:
            result = str((torch.ones(1024, device="cuda") * 2).sum().item())
        except Exception as error:
            result = f"the kernel after it failed: {type(error).__name__}: {error}"
        pinning.unregister(pointer, gpu)
    finally:
        del data
        mapped.close()
    if said:
        return [("FAIL", name, said)]
    if result != "2048.0":
        return [("FAIL", name, result)]
    return [("PASS", name, f"the kernel after it ran (2048.0); said: {refused}")]


# --- case 4: a worker of the second GPU -----------------------------------------------------


def other_gpu(device: str, shm: Path) -> list[Result]:
    """Case 4. A worker with LOCAL_RANK=1 that never calls ``torch.cuda.set_device`` saves a
    state of cuda:1 through an arena and loads it back to cuda:1: its current device is
    still 0 and it has no CUDA context on GPU 0 (the driver's primary context there is
    inactive, and nvidia-smi lists the process on GPU 1 only). Proves absent: pinning or
    loading on the current device (GPU 0) rather than the tensors', which gives every
    worker of a node a context, and its memory, on GPU 0."""
    import torch

    name = "other-gpu-no-context"
    if torch.cuda.device_count() < 2:
        return [("SKIP", name, f"{torch.cuda.device_count()} GPU here: it needs two")]
    buses = {index: _bus(torch.cuda.get_device_properties(index)) for index in (0, 1)}
    env = {**os.environ, "LOCAL_RANK": "1", "RALLYPOINT_LOCAL_RANK": "1"}
    command = [sys.executable, __file__, "--child", "other-gpu", "--shm", str(shm)]
    # In this case's process group: killed with it.
    child = subprocess.Popen(
        command, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        before = _answer(child)  # the state made, nothing saved yet
        seen_before = _apps(child.pid)
        child.stdin.write("go\n")  # type: ignore[union-attr]
        child.stdin.flush()  # type: ignore[union-attr]
        after = _answer(child)  # saved and loaded back
        seen_after = _apps(child.pid)
        child.stdin.close()  # type: ignore[union-attr]
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
    return [_other_gpu_result(name, buses, before, seen_before, after, seen_after)]


def _other_gpu_result(
    name: str, buses: dict[int, Any], before: dict[str, Any], seen_before: set[Any] | None,
    after: dict[str, Any], seen_after: set[Any] | None,
) -> Result:  # fmt: skip
    def on_gpu0(seen: set[Any] | None) -> bool:
        return seen is not None and buses[0] in seen

    if before["context_on_0"] or on_gpu0(seen_before):
        return "FAIL", name, "torch made a context on GPU 0 before any save: the check cannot judge"
    listed = (
        "nvidia-smi does not list the process (another pid namespace?)"
        if not seen_after
        else f"nvidia-smi lists it on GPU {sorted(i for i, b in buses.items() if b in seen_after)}"
    )
    if after.get("error"):
        return "FAIL", name, after["error"]
    if not after["equal"]:
        return "FAIL", name, "the state loaded back to cuda:1 is not the state saved"
    if after["current"] != 0:
        return "FAIL", name, f"the current device became {after['current']}"
    if after["context_on_0"] or on_gpu0(seen_after):
        return "FAIL", name, f"the save or the load made a context on GPU 0; {listed}"
    return "PASS", name, f"current device 0, no context on GPU 0 (the driver's word); {listed}"


def other_gpu_child(shm: Path) -> None:
    """Case 4's worker (LOCAL_RANK=1): a state on cuda:1, saved and loaded back; it says
    how things stand before and after, each time waiting for a line on stdin."""
    import torch

    from rallypoint.checkpoint import arena, copies, loading, slot

    local = int(os.environ["LOCAL_RANK"])
    gpu = torch.device("cuda", local)
    state = {"weight": torch.randn(1024, 1024, device=gpu), "step": torch.tensor(3, device=gpu)}
    print(json.dumps({"context_on_0": _primary_context_active(0)}), flush=True)
    sys.stdin.readline()
    found: dict[str, Any] = {"equal": False, "current": None}
    try:
        memory = arena.Arena(shm, local)
        memory.save(state, 3, rank=local, world_size=local + 1)
        copy = copies.Copies(shm / slot.ARENA).newest(rank=local)[0]
        back = loading.load_copy(copy, map_location=f"cuda:{local}")
        found["equal"] = differs(state, back) == "" and back["weight"].device == gpu
        memory.close()
    except Exception as error:
        found["error"] = f"{type(error).__name__}: {error}"
    found["context_on_0"] = _primary_context_active(0)
    found["current"] = torch.cuda.current_device()
    print(json.dumps(found), flush=True)
    sys.stdin.readline()


def _primary_context_active(ordinal: int) -> bool:
    """Whether this process's primary CUDA context on device ``ordinal`` is active (the
    driver's ``cuDevicePrimaryCtxGetState``): what a CUDA runtime call on it makes."""
    driver = ctypes.CDLL("libcuda.so.1")
    device, flags, active = ctypes.c_int(), ctypes.c_uint(), ctypes.c_int()
    driver.cuInit(0)
    driver.cuDeviceGet(ctypes.byref(device), ordinal)
    driver.cuDevicePrimaryCtxGetState(device, ctypes.byref(flags), ctypes.byref(active))
    return bool(active.value)


def _answer(child: subprocess.Popen[str]) -> dict[str, Any]:
    line = child.stdout.readline()  # type: ignore[union-attr]
    if not line:
        raise RuntimeError(f"case 4's worker ended (exit {child.wait(timeout=10)}) before it said")
    return json.loads(line)  # type: ignore[no-any-return]


def _bus(properties: Any) -> tuple[int, int, int]:
    return (properties.pci_domain_id, properties.pci_bus_id, properties.pci_device_id)


def _apps(pid: int) -> set[tuple[int, int, int]] | None:
    """The GPUs (PCI domain, bus, device) nvidia-smi lists process ``pid`` on; None without
    nvidia-smi."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    listed = subprocess.run(
        [smi, "--query-compute-apps=pid,gpu_bus_id", "--format=csv,noheader"],
        capture_output=True, text=True, timeout=30, check=False,
    ).stdout  # fmt: skip
    found = set()
    for line in listed.splitlines():
        fields = [field.strip() for field in line.split(",")]
        bus = re.match(r"([0-9a-fA-F]+):([0-9a-fA-F]+):([0-9a-fA-F]+)\.", fields[-1])
        if len(fields) == 2 and fields[0] == str(pid) and bus:
            found.add((int(bus[1], 16), int(bus[2], 16), int(bus[3], 16)))
    return found


# --- case 5: an asynchronous save, then the end of the script -------------------------------


def save_then_exit(device: str, shm: Path) -> list[Result]:
    """Case 5. A script makes about 1 GB of state on the GPU, saves it asynchronously as
    step 7 and returns at once (no wait, no close): it exits 0, and its arena holds a
    committed copy of step 7 with the state's bytes. Proves absent: a save in flight
    dropped, or a crash, when the interpreter ends (a daemon thread stopped, the CUDA
    memory freed under the copy)."""
    from rallypoint.checkpoint import copies, loading, slot

    name = "async-save-then-exit"
    gigabytes = "1" if device == "cuda" else "0.25"
    command = [sys.executable, __file__, "--child", "save-then-exit", "--shm", str(shm)]
    done = subprocess.run(
        [*command, "--device", device, "--gb", gigabytes],
        capture_output=True, text=True, timeout=CASES[5][1] - 10, check=False,
    )  # fmt: skip
    sys.stderr.write(done.stderr)
    said = [line for line in done.stdout.splitlines() if line.startswith("SUMS ")]
    if done.returncode != 0 or not said:
        tail = done.stderr.strip().splitlines()[-1:] or ["nothing on stderr"]
        return [("FAIL", name, f"the script exited {done.returncode}: {tail[0]}")]
    sums = json.loads(said[-1].removeprefix("SUMS "))
    newest = copies.Copies(shm / slot.ARENA).newest()
    if not newest or newest[0].step != 7:
        return [
            (
                "FAIL",
                name,
                f"no committed copy of step 7 (the newest: {newest[0].step if newest else None})",
            )
        ]
    loaded = loading.load_copy(newest[0], map_location="cpu")
    found = {key: _checksum(tensor) for key, tensor in loaded.items()}
    if found != sums:
        return [("FAIL", name, f"the copy's bytes differ: checksums {found} where {sums}")]
    size = sum(t.numel() * t.element_size() for t in loaded.values()) / 1e9
    return [("PASS", name, f"exit 0, step 7 committed, {size:.2f} GB with the state's bytes")]


def save_then_exit_child(device: str, shm: Path, gigabytes: float) -> None:
    """Case 5's script: the state, its checksums, an asynchronous save; then it returns."""
    import torch

    from rallypoint.checkpoint import arena

    count = int(gigabytes * 2**30 / 4 / 4)
    state = {f"t{index}": torch.randn(count, device=device) for index in range(4)}
    sums = {key: _checksum(tensor) for key, tensor in state.items()}
    print("SUMS " + json.dumps(sums), flush=True)
    arena.Arena(shm, 0).save(state, 7, rank=0, world_size=1, asynchronous=True)


def _checksum(tensor: Any) -> int:
    """The sum of a float32 tensor's words as integers: exact, on any device."""
    import torch

    return int(tensor.view(torch.int32).sum(dtype=torch.int64).item())


# --- running the cases ----------------------------------------------------------------------

RUNS: dict[int, Callable[[str, Path], list[Result]]] = {
    1: judge_training,
    2: dcp_saves,
    3: failed_pin,
    4: other_gpu,
    5: save_then_exit,
}


def _fresh(shm: Path, name: str) -> Path:
    folder = shm / name
    folder.mkdir(parents=True)
    return folder


def run_case(number: int, device: str, shm: Path) -> list[Result]:
    """Case ``number`` in this process, its /dev/shm folder under ``shm``."""
    folder = Path(tempfile.mkdtemp(prefix=f"case{number}-", dir=shm))
    try:
        return RUNS[number](device, folder)
    except Exception as error:
        return [("FAIL", CASES[number][0][0], f"{type(error).__name__}: {error}")]
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def in_own_process(number: int, device: str, shm: Path, seconds: float) -> list[str]:
    """Case ``number`` in a process (and session) of its own, killed after ``seconds``:
    its result lines, or a FAIL line for each of its names when it said none."""
    command = [sys.executable, __file__, "--case", str(number), "--device", device]
    command += ["--shm", str(shm)]
    began = time.monotonic()
    child = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = child.communicate(timeout=seconds)
        why = f"its process exited {child.returncode}"
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        out, err = child.communicate()
        why = f"still running after {seconds:.0f} s: killed"
    finally:  # this process stopped (SIGTERM, gpu-check.sh's timeout): the case too
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
    sys.stderr.write(err)
    lines = [line for line in out.splitlines() if line.split(" ", 1)[0] in ("PASS", "FAIL", "SKIP")]
    said = {line.split(" ", 2)[1].rstrip(":") for line in lines}
    tail = (err.strip().splitlines() or ["nothing on stderr"])[-1]
    for name in CASES[number][0]:
        if name not in said:
            lines.append(f"FAIL {name}: {why} without a word of it ({tail})")
    return [f"{line} [case {number}, {time.monotonic() - began:.1f} s]" for line in lines]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", type=int, choices=sorted(CASES), help="run only this case, here")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a dry run")
    parser.add_argument("--shm", default="/dev/shm", help="where its temporary folder goes")
    parser.add_argument("--child", choices=("other-gpu", "save-then-exit"), help=argparse.SUPPRESS)
    parser.add_argument("--gb", type=float, default=1.0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child == "other-gpu":
        other_gpu_child(Path(args.shm))
        return 0
    if args.child == "save-then-exit":
        save_then_exit_child(args.device, Path(args.shm), args.gb)
        return 0
    if args.case is not None:
        faulthandler.enable()  # a crash of the case says where
        results = run_case(args.case, args.device, Path(args.shm))
        for verdict, name, detail in results:
            print(f"{verdict} {name}: {detail}", flush=True)
        return int(any(verdict == "FAIL" for verdict, _, _ in results))
    return run_all(args.device, Path(args.shm))


def run_all(device: str, base: Path) -> int:
    """Every case (the dry run's on the CPU), each in its own process, within BUDGET."""
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("FAIL cuda: no CUDA GPU here (--device cpu for a dry run)")
            return 1
    numbers = sorted(CASES) if device == "cuda" else list(CPU_CASES)
    if device == "cpu":
        print(f"a dry run on the CPU: cases {', '.join(map(str, numbers))}", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the cleanups run
    shm = Path(tempfile.mkdtemp(prefix="rallypoint-gpu-smoke-", dir=base))
    deadline = time.monotonic() + BUDGET
    failed = False
    try:
        for number in numbers:
            left = deadline - time.monotonic()
            if left < 10:
                lines = [
                    f"FAIL {n}: not run, the {BUDGET:.0f} s were spent" for n in CASES[number][0]
                ]
            else:
                lines = in_own_process(number, device, shm, min(CASES[number][1], left))
            for line in lines:
                print(line, flush=True)
                failed = failed or line.startswith("FAIL")
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    return int(failed)


if __name__ == "__main__":
    sys.exit(main())
