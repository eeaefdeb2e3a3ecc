"""``--numa-binding``: the CPUs each worker may run on, torchrun's four modes.

Each local rank is bound near its device: the NUMA node of the GPU whose index is the
local rank (among ``CUDA_VISIBLE_DEVICES``), read from sysfs through ``nvidia-smi``'s PCI
bus ids, so that no CUDA context is made in the agent. On a host without GPUs the local
ranks are spread evenly over the NUMA nodes in order. Then, as ``torch.numa.binding``:

* ``node``: every CPU of that NUMA node;
* ``socket``: every CPU of the NUMA nodes of that node's socket;
* ``exclusive``: the node's physical cores shared out among the ranks bound to the node,
  contiguous and without overlap (the first ones one core more when they do not divide);
* ``core-complex``: one group of cores sharing the last-level cache, a different one for
  each rank of the node while there are enough.

Only CPUs this agent may use count. The keeper applies the set in the worker before it
runs the script (``sched_setaffinity``), so every thread the worker starts inherits it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections import defaultdict
from collections.abc import Iterable, Mapping
from pathlib import Path

from rallypoint.errors import UsageError


class Topology:
    """The host's CPUs as sysfs describes them (``root`` is ``/sys``, or a copy's)."""

    def __init__(self, root: Path = Path("/sys"), allowed: Iterable[int] | None = None) -> None:
        self.root = root
        usable = set(os.sched_getaffinity(0) if allowed is None else allowed)
        nodes: dict[int, frozenset[int]] = {}
        for entry in sorted((root / "devices/system/node").glob("node[0-9]*")):
            cpus = frozenset(parse_cpu_list(_read(entry / "cpulist")) & usable)
            if cpus:
                nodes[int(entry.name[4:])] = cpus
        self.nodes = nodes or {0: frozenset(usable)}

    def cpu_file(self, cpu: int, name: str) -> str:
        return _read(self.root / f"devices/system/cpu/cpu{cpu}" / name)

    def socket(self, cpu: int) -> str:
        return self.cpu_file(cpu, "topology/physical_package_id")

    def core(self, cpu: int) -> int:
        """The physical core of ``cpu``, named by its lowest logical CPU."""
        siblings = parse_cpu_list(self.cpu_file(cpu, "topology/thread_siblings_list"))
        return min(siblings or {cpu})

    def complex(self, cpu: int) -> int:
        """The group of CPUs sharing ``cpu``'s last-level cache, named by its lowest."""
        best: tuple[int, set[int]] = (-1, {cpu})
        for index in sorted((self.root / f"devices/system/cpu/cpu{cpu}/cache").glob("index*")):
            if _read(index / "type") not in ("Unified", "Data"):
                continue
            level = int(_read(index / "level") or 0)
            if level > best[0]:
                best = (level, parse_cpu_list(_read(index / "shared_cpu_list")) or {cpu})
        return min(best[1])


def bindings(
    mode: str, nproc: int, device_nodes: list[int] | None, topology: Topology
) -> list[frozenset[int]]:
    """The CPUs of each local rank. ``device_nodes``: the NUMA node of each visible GPU, in
    device order (None: no GPUs, spread the ranks over the nodes).

    Raises:
        UsageError: fewer devices than workers, or fewer physical cores than ``exclusive``
            needs.
    """
    nodes = topology.nodes
    order = sorted(nodes)
    if device_nodes is None:
        placed = [order[rank * len(order) // nproc] for rank in range(nproc)]
        devices = placed
    else:
        if len(device_nodes) < nproc:
            raise UsageError(
                f"--numa-binding {mode}: {nproc} workers but {len(device_nodes)} GPUs visible; "
                "each worker is bound near the GPU of its local rank."
            )
        devices = [node if node in nodes else order[0] for node in device_nodes]
        placed = devices[:nproc]
    result = []
    for rank, node in enumerate(placed):
        # The devices bound to this node, and where this rank's is among them.
        sharing = [index for index, other in enumerate(devices) if other == node]
        position = sharing.index(rank)
        result.append(_cpus(mode, node, position, len(sharing), topology))
    return result


def _cpus(mode: str, node: int, position: int, sharing: int, topology: Topology) -> frozenset[int]:
    cpus = topology.nodes[node]
    if mode == "node":
        return cpus
    if mode == "socket":
        sockets = {topology.socket(cpu) for cpu in cpus}
        return frozenset(
            cpu
            for other in topology.nodes.values()
            for cpu in other
            if topology.socket(cpu) in sockets
        )
    if mode == "exclusive":
        cores = _group(cpus, topology.core)
        per, extra = divmod(len(cores), sharing)
        if per < 1:
            raise UsageError(
                f"--numa-binding exclusive: NUMA node {node} has {len(cores)} physical "
                f"cores for {sharing} workers; use node or socket."
            )
        start = position * per + min(position, extra)
        end = start + per + (1 if position < extra else 0)
        return frozenset(cpu for core in list(cores.values())[start:end] for cpu in core)
    if mode == "core-complex":
        complexes = _group(cpus, topology.complex)
        ranked = sorted(complexes.items(), key=lambda item: (-len(item[1]), item[0]))
        return frozenset(ranked[position % len(ranked)][1])
    raise ValueError(f"unknown --numa-binding mode {mode!r}")


def _group(cpus: Iterable[int], key: object) -> dict[int, frozenset[int]]:
    groups: defaultdict[int, set[int]] = defaultdict(set)
    for cpu in cpus:
        groups[key(cpu)].add(cpu)  # type: ignore[operator]
    return {name: frozenset(members) for name, members in sorted(groups.items())}


def gpu_numa_nodes(environ: Mapping[str, str], root: Path = Path("/sys")) -> list[int] | None:
    """The NUMA node of each GPU this host's workers see, in device order; None without
    NVIDIA GPUs (no ``nvidia-smi``, or it lists none)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        listed = subprocess.run(
            [smi, "--query-gpu=index,uuid,pci.bus_id", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    gpus = [tuple(field.strip() for field in line.split(",")) for line in listed.splitlines()]
    gpus = [gpu for gpu in gpus if len(gpu) == 3]
    if not gpus:
        return None
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        chosen = []
        for item in (part.strip() for part in visible.split(",") if part.strip()):
            chosen += [gpu for gpu in gpus if item in (gpu[0], gpu[1])]
        gpus = chosen
    nodes = []
    for _index, _uuid, bus in gpus:
        domain, _, rest = bus.lower().partition(":")
        address = f"{int(domain, 16):04x}:{rest}"
        text = _read(root / "bus/pci/devices" / address / "numa_node")
        nodes.append(max(0, int(text)) if text.lstrip("-").isdigit() else 0)
    return nodes


def parse_cpu_list(text: str) -> set[int]:
    """sysfs's ``0-3,8,10-11`` -> ``{0, 1, 2, 3, 8, 10, 11}``."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        low, sep, high = part.strip().partition("-")
        if low.isdigit() and (not sep or high.isdigit()):
            cpus.update(range(int(low), int(high if sep else low) + 1))
    return cpus


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""
