"""torchrun 2.13's last six flags, with torchrun's meaning, side by side with torchrun where
it runs here: ``--logs-specs``, ``--event-log-handler``, ``--duplicate-stdout-filters``,
``--duplicate-stderr-filters``, ``--numa-binding`` and ``--virtual-local-rank``. Where this
machine cannot show an effect (one NUMA node, no GPU), what the worker is given is tested:
its CPU affinity, ``CUDA_VISIBLE_DEVICES`` and ``LOCAL_RANK``; other topologies are tested
on sysfs trees written by the test."""

from __future__ import annotations

import json
import subprocess
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from launch import rallypoint, torchrun, worker
from rallypoint.agent.processes import numa
from rallypoint.errors import UsageError

LAUNCHERS = {"rallypoint": lambda *a, **k: rallypoint("run", *a, **k), "torchrun": torchrun}


def facts(stdout: str) -> list[dict[str, Any]]:
    rows = [
        json.loads(line.split("facts ", 1)[1]) for line in stdout.splitlines() if "facts " in line
    ]
    return sorted(rows, key=lambda row: int(row["rank"]))


def run(
    launcher: str, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    result = LAUNCHERS[launcher](*args, env=env)
    if launcher == "torchrun" and "torchrun: error: unrecognized arguments" in result.stderr:
        # make test-lowest: the torch installed is older than the flag (CI's has it).
        pytest.skip(f"torchrun {torch.__version__}: {result.stderr.splitlines()[-1]}")
    assert result.returncode == 0, result.stderr
    return result


# --- --logs-specs -----------------------------------------------------------------------------


@pytest.fixture
def flat_logs_specs(tmp_path: Path) -> dict[str, str]:
    """A distribution with a ``torchrun.logs_specs`` entry point ``flat``: each rank's
    stdout in ``<log dir>/flat-<rank>.out``, teed; the environment that installs it."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "flat_logs.py").write_text(
        textwrap.dedent(
            """
            import os

            from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs


            class FlatLogsSpecs(DefaultLogsSpecs):
                def reify(self, envs):
                    dest = super().reify(envs)
                    for rank in envs:
                        path = os.path.join(self.root_log_dir, f"flat-{rank}.out")
                        dest.stdouts[rank] = dest.tee_stdouts[rank] = path
                    return dest
            """
        )
    )
    info = site / "flat_logs-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: flat-logs\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        "[torchrun.logs_specs]\nflat = flat_logs:FlatLogsSpecs\n"
    )
    return {"PYTHONPATH": str(site)}


@pytest.mark.parametrize("launcher", ["rallypoint", "torchrun"])
def test_logs_specs_puts_the_logs_where_its_class_says(
    launcher: str, flat_logs_specs: dict[str, str], tmp_path: Path
) -> None:
    logs = tmp_path / launcher
    result = run(
        launcher, "--nproc-per-node", "2", "--logs-specs", "flat", "--log-dir", str(logs),
        worker("lines.py"), env=flat_logs_specs,
    )  # fmt: skip
    for rank in (0, 1):
        assert f"apple {rank}\n" in (logs / f"flat-{rank}.out").read_text()
        assert f"apple {rank}" in result.stdout  # teed
        assert f"apple err {rank}" in result.stderr  # not redirected: the console


def test_an_unknown_logs_specs_is_one_line() -> None:
    result = rallypoint("run", "--logs-specs", "nowhere", worker("lines.py"))
    assert result.returncode == 2
    assert result.stderr.startswith(
        "rallypoint: error: --logs-specs 'nowhere': no torchrun.logs_specs entry point"
    )


# --- --event-log-handler ----------------------------------------------------------------------


@pytest.mark.parametrize("launcher", ["rallypoint", "torchrun"])
def test_the_console_event_handler_prints_event_records(launcher: str) -> None:
    records = []
    for line in run(
        launcher, "--event-log-handler", "console", worker("lines.py")
    ).stderr.splitlines():
        if line.startswith("{") and '"source"' in line:
            records.append(json.loads(line))
    assert records, "no event record on stderr"
    assert all(record.keys() == {"name", "source", "timestamp", "metadata"} for record in records)
    assert {record["source"] for record in records} <= {"AGENT", "WORKER"}
    assert "AGENT" in {record["source"] for record in records}


def test_the_null_event_handler_prints_none() -> None:
    result = run("rallypoint", "--event-log-handler", "null", worker("lines.py"))
    assert '"source"' not in result.stderr
    refused = rallypoint("run", "--event-log-handler", "scuba", worker("lines.py"))
    assert (
        refused.returncode == 2
        and "choose one of console, dynamic_rendezvous, null" in refused.stderr
    )


# --- --duplicate-stdout-filters, --duplicate-stderr-filters ------------------------------------


def filtered(root: Path, name: str) -> list[str]:
    (path,) = root.glob(f"*/attempt_0/{name}")
    return sorted(path.read_text().splitlines())


def test_duplicate_filters_copy_matching_teed_lines_as_torchrun(tmp_path: Path) -> None:
    copies = {}
    for launcher in LAUNCHERS:
        logs = tmp_path / launcher
        run(
            launcher, "--nproc-per-node", "2", "--tee", "3", "--log-dir", str(logs),
            "--duplicate-stdout-filters", "apple,pear,,plum",
            "--duplicate-stderr-filters", "banana",
            worker("lines.py"),
        )  # fmt: skip
        copies[launcher] = (
            filtered(logs, "filtered_stdout.log"),
            filtered(logs, "filtered_stderr.log"),
        )
    assert copies["rallypoint"] == copies["torchrun"]
    stdout, stderr = copies["rallypoint"]
    assert stdout == [
        "[default0]:apple 0", "[default0]:pear,plum 0", "[default1]:apple 1", "[default1]:pear,plum 1",
    ]  # fmt: skip
    assert stderr == ["[default0]:banana err 0", "[default1]:banana err 1"]


def test_duplicate_filters_take_only_teed_streams(tmp_path: Path) -> None:
    run(
        "rallypoint", "--nproc-per-node", "2", "--tee", "0:1", "--log-dir", str(tmp_path),
        "--duplicate-stdout-filters", "apple", worker("lines.py"),
    )  # fmt: skip
    assert filtered(tmp_path, "filtered_stdout.log") == ["[default0]:apple 0"]


# --- --virtual-local-rank ---------------------------------------------------------------------


@pytest.mark.parametrize("visible", [None, "3,5"])
def test_virtual_local_rank_gives_each_worker_its_device_as_device_0(visible: str | None) -> None:
    env = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
    given = {}
    for launcher in LAUNCHERS:
        rows = facts(
            run(
                launcher,
                "--nproc-per-node",
                "2",
                "--virtual-local-rank",
                worker("lines.py"),
                env=env,
            ).stdout
        )
        given[launcher] = [(row["local_rank"], row["cuda_visible_devices"]) for row in rows]
    expected = [("0", "0"), ("0", "1")] if visible is None else [("0", "3"), ("0", "5")]
    assert given["rallypoint"] == given["torchrun"] == expected


def test_virtual_local_rank_with_too_few_devices_is_one_line() -> None:
    result = rallypoint(
        "run", "--nproc-per-node", "3", "--virtual-local-rank", worker("lines.py"),
        env={"CUDA_VISIBLE_DEVICES": "0,1"},
    )  # fmt: skip
    assert result.returncode == 2
    assert "--virtual-local-rank: 3 workers but CUDA_VISIBLE_DEVICES='0,1' names 2" in result.stderr


def test_the_watchdog_tells_virtual_local_ranks_apart(tmp_path: Path) -> None:
    """Progress reports carry the real local rank: both workers stay alive, neither is blamed."""
    script = tmp_path / "beats.py"
    script.write_text(
        "import time, rallypoint\nfor _ in range(30):\n    rallypoint.progress()\n    time.sleep(0.1)\n"
    )
    result = run(
        "rallypoint", "--nproc-per-node", "2", "--virtual-local-rank", "--watchdog-timeout", "2",
        str(script),
    )  # fmt: skip
    assert "made no progress" not in result.stderr


# --- --numa-binding ---------------------------------------------------------------------------


def test_numa_binding_sets_each_worker_s_cpus() -> None:
    node = numa.Topology().nodes
    everything = sorted(cpu for cpus in node.values() for cpu in cpus)
    for mode in ("node", "socket", "core-complex"):
        rows = facts(
            run(
                "rallypoint", "--nproc-per-node", "2", "--numa-binding", mode, worker("lines.py")
            ).stdout
        )
        assert [row["cpus"] for row in rows] == [everything, everything], mode  # one node here
    rows = facts(
        run(
            "rallypoint", "--nproc-per-node", "2", "--numa-binding", "exclusive", worker("lines.py")
        ).stdout
    )
    first, second = (set(row["cpus"]) for row in rows)
    assert first and second and not first & second and first | second <= set(everything)


def test_an_unknown_numa_mode_is_one_line() -> None:
    result = rallypoint("run", "--numa-binding", "rack", worker("lines.py"))
    assert result.returncode == 2
    assert "choose one of node, socket, exclusive, core-complex" in result.stderr


def fake_sysfs(root: Path) -> numa.Topology:
    """Two sockets, one NUMA node each, four cores of two threads per node (CPUs 0-7 on node
    0: cores (0,4) (1,5) (2,6) (3,7); 8-15 on node 1), two L3 groups of two cores per node."""
    for node, first in ((0, 0), (1, 8)):
        cpus = list(range(first, first + 8))
        (root / f"devices/system/node/node{node}").mkdir(parents=True)
        (root / f"devices/system/node/node{node}/cpulist").write_text(f"{first}-{first + 7}\n")
        for cpu in cpus:
            core = first + (cpu - first) % 4
            top = root / f"devices/system/cpu/cpu{cpu}/topology"
            top.mkdir(parents=True)
            (top / "physical_package_id").write_text(f"{node}\n")
            (top / "thread_siblings_list").write_text(f"{core},{core + 4}\n")
            l3 = core - (core - first) % 2  # cores first..first+1 and first+2..first+3
            for index, (level, kind, shared) in enumerate(
                ((1, "Data", f"{core},{core + 4}"), (1, "Instruction", f"{core},{core + 4}"),
                 (3, "Unified", f"{l3}-{l3 + 1},{l3 + 4}-{l3 + 5}"))
            ):  # fmt: skip
                cache = root / f"devices/system/cpu/cpu{cpu}/cache/index{index}"
                cache.mkdir(parents=True)
                (cache / "level").write_text(f"{level}\n")
                (cache / "type").write_text(f"{kind}\n")
                (cache / "shared_cpu_list").write_text(f"{shared}\n")
    return numa.Topology(root, allowed=range(16))


def sets(*groups: str) -> list[frozenset[int]]:
    return [frozenset(numa.parse_cpu_list(group)) for group in groups]


def test_numa_modes_on_two_sockets_with_gpus(tmp_path: Path) -> None:
    topology = fake_sysfs(tmp_path)
    gpus = [0, 0, 1, 1]  # the NUMA node of each GPU, as sysfs gives it for nvidia-smi's bus ids
    assert numa.bindings("node", 4, gpus, topology) == sets("0-7", "0-7", "8-15", "8-15")
    assert numa.bindings("socket", 2, [0, 1], topology) == sets("0-7", "8-15")
    # Two GPUs on a node of four cores: two cores (and their threads) each.
    assert numa.bindings("exclusive", 4, gpus, topology) == sets(
        "0-1,4-5", "2-3,6-7", "8-9,12-13", "10-11,14-15"
    )
    assert numa.bindings("core-complex", 4, gpus, topology) == sets(
        "0-1,4-5", "2-3,6-7", "8-9,12-13", "10-11,14-15"
    )
    # Three GPUs on node 0 share its four cores 2, 1, 1; the third GPU on node 0 gets its
    # own core complex again only when there is one left: here the first, in turn.
    three = numa.bindings("exclusive", 3, [0, 0, 0], topology)
    assert three == sets("0-1,4-5", "2,6", "3,7")
    assert numa.bindings("core-complex", 3, [0, 0, 0], topology)[2] == frozenset(
        numa.parse_cpu_list("0-1,4-5")
    )


def test_numa_modes_without_gpus_spread_the_ranks(tmp_path: Path) -> None:
    topology = fake_sysfs(tmp_path)
    assert numa.bindings("node", 4, None, topology) == sets("0-7", "0-7", "8-15", "8-15")
    assert numa.bindings("exclusive", 2, None, topology) == sets("0-7", "8-15")


def test_numa_errors_are_one_sentence(tmp_path: Path) -> None:
    topology = fake_sysfs(tmp_path)
    with pytest.raises(UsageError, match="NUMA node 0 has 4 physical cores for 5 workers"):
        numa.bindings("exclusive", 5, [0] * 5, topology)
    with pytest.raises(UsageError, match="3 workers but 2 GPUs visible"):
        numa.bindings("node", 3, [0, 1], topology)
