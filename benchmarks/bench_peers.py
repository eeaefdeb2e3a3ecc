"""Recovery beside the launchers users would pick instead: rallypoint, torchrun and each
peer of ``peers.py`` (NVIDIA's ft_launcher, DLRover's dlrover-run) on the same job, the
same failures, in one run; docs/benchmarks-peers.md says how.

Two nodes of two workers (``tests/workers/steps.py``, an all-reduce every 0.2 s), as in
``bench_recovery.py``, whose runs these are: one of the second node's workers SIGKILLed
(the job restarts at world 4), the second node SIGKILLed with its workers (a machine
lost) and its agent sent SIGTERM (a preemption); for each, the seconds to the survivors'
first step in the new world, and the seconds from the first agent's start to the first
step at world 4.

    .venv/bin/python benchmarks/bench_peers.py [--repeat 3] [--only-peer ft_launcher]
    .venv/bin/python benchmarks/bench_peers.py --render-only
"""

from __future__ import annotations

import argparse
import copy
import subprocess
from dataclasses import asdict
from importlib import metadata
from pathlib import Path
from typing import Any

import bench_recovery
import common
import peers

#: The failures, in the page's order: bench_recovery's --kill of each.
FAILURES = {
    "worker": "a worker SIGKILLed",
    "node": "a node SIGKILLed",
    "preempt": "a node sent SIGTERM",
}
OPTIONS = {
    "repeat": (3, "runs per launcher and failure"),
    "cap": (120.0, "seconds after the failure before a run counts as not recovered"),
    "start_cap": (180.0, "seconds for the two agents to reach world=4 before it is given up"),
    "orphan_grace": (10.0, "seconds for orphans to go away before they are counted again"),
    "only_peer": (("", *(p.name for p in peers.PEERS)), "of the peers, run this one only"),
    "only_failure": (("", *FAILURES), "of the failures, this one only (for trying things out)"),
}
#: Each peer's rendezvous settings, as bench_recovery sets rallypoint's and torchrun's: a
#: node taken for dead 3 s after its last heartbeat, a last call of 1 s. ft_launcher takes
#: torchrun's c10d keys; DLRover's rendezvous runs in its job master, whose last call is
#: its own key (``lastcall_timeout``, 60 s by default) and which finds a lost node itself.
PEER_RDZV_CONF = {
    "ft_launcher": bench_recovery.RDZV_CONF["torchrun"],
    "dlrover-run": "lastcall_timeout=1",
}
PEER_COLORS = {"ft_launcher": "#76b900", "dlrover-run": "#e8710a"}


def launchers(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Every launcher of the run: its version and environment; peers installed on demand,
    and registered with bench_recovery (its command, its rendezvous settings)."""
    found: dict[str, dict[str, Any]] = {
        "rallypoint": {"version": common.git_state("core"), "env": {}},
        "torchrun": {"version": f"torch {metadata.version('torch')}",
                     "env": dict(bench_recovery.TORCHRUN_WORKAROUND)},
    }  # fmt: skip
    for peer in peers.PEERS:
        if args.only_peer and peer.name != args.only_peer:
            continue
        if peer.name not in PEER_RDZV_CONF:
            print(f"{peer.name}: no two-node run of it on this machine yet; left out")
            continue
        version = peers.ensure(peer)
        if version is None:
            continue
        common.LAUNCHERS[peer.name] = peer.command
        if peer.name == "dlrover-run":
            register_dlrover(peer)
        common.COLORS[peer.name] = PEER_COLORS[peer.name]
        bench_recovery.RDZV_CONF[peer.name] = PEER_RDZV_CONF[peer.name]
        found[peer.name] = {
            "version": f"{peer.distribution} {version}, torch {peer.torch}",
            "env": dict(bench_recovery.TORCHRUN_WORKAROUND),  # torch's elastic agent too
            "why_torch": peer.why_torch,
        }
    return found


def register_dlrover(peer: peers.Peer) -> None:
    """dlrover-run off Kubernetes, as DLRover's docs run it on bare machines: a job master
    of its own (``dlrover.python.master.main --platform local``, for 2 nodes) on the run's
    port, which every node's agent is given with its node rank."""

    def master(port: int, run_id: str, workdir: Path) -> subprocess.Popen[bytes]:
        command = [
            str(peer.home / "bin" / "python"), "-u", "-m", "dlrover.python.master.main",
            "--port", str(port), "--node_num", "2", "--job_name", run_id,
            "--platform", "local",
        ]  # fmt: skip
        return bench_recovery.start(command, {}, workdir / "master.log")

    bench_recovery.HELPERS[peer.name] = master
    bench_recovery.NODE_ENV[peer.name] = lambda port, node: {
        "DLROVER_MASTER_ADDR": f"{common.HOST}:{port}",
        "NODE_RANK": str(node),
        "NODE_NUM": "2",
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    found = launchers(args)
    names = list(found)
    results: dict[str, Any] = {"launchers": found, "repeat": args.repeat, "failures": {}}
    for kill, title in FAILURES.items():
        if args.only_failure and kill != args.only_failure:
            continue
        run = copy.copy(args)
        run.kill = kill
        once = lambda name, run=run: bench_recovery.measure_once(  # noqa: E731
            name, run, found[name]["env"]
        )
        samples = common.rounds(args.repeat, names, once, bench_recovery.show)
        results["failures"][kill] = {
            "title": title,
            "summary": {name: bench_recovery.summarise(samples[name]) for name in names},
            "first_step": {
                name: common.median(
                    s.seconds_to_world4 for s in samples[name] if s.seconds_to_world4 is not None
                )
                for name in names
            },
            "samples": {name: [asdict(s) for s in samples[name]] for name in names},
        }
    results["commands"] = {
        name: " ".join(
            bench_recovery.agent_command(
                name, 0, "RUN_ID", bench_recovery.worker_seconds(args), "TAG"
            )
        )
        .replace(str(common.ROOT) + "/", "")
        .replace(f"{common.HOST}:0", f"{common.HOST}:PORT")
        for name in names
    }
    return results


def chart(results: dict[str, Any]) -> None:
    names = list(results["launchers"])
    figure, axes = common.figure(1, len(FAILURES), figsize=(10.5, 3.2), sharey=True)
    for axis, failure in zip(axes, results["failures"].values(), strict=True):
        for row, name in enumerate(names):
            median = failure["summary"][name]["median_recovery_seconds"]
            if median is not None:
                axis.barh(row, median, color=common.COLORS.get(name, "#999999"), height=0.6)
                axis.annotate(f"{median:.1f} s", (median, row), xytext=(4, -3),
                              textcoords="offset points", fontsize=8)  # fmt: skip
            else:
                axis.annotate("did not recover", (0, row), xytext=(4, -3),
                              textcoords="offset points", fontsize=8, color="#d62728")  # fmt: skip
        axis.set_title(failure["title"], fontsize=10)
        axis.set_xlabel("seconds to a step in the new world")
        axis.margins(x=0.25)
        axis.grid(True, axis="x", alpha=0.3)
    axes[0].set_yticks(range(len(names)))
    axes[0].set_yticklabels(names)
    axes[0].invert_yaxis()
    figure.suptitle("Recovery, median of runs (lower is better)", fontsize=11)
    common.save(figure, "bench_peers_recovery.png")


def render(results: dict[str, Any]) -> dict[str, list[str]]:
    names = list(results["launchers"])
    blocks: dict[str, list[str]] = {
        "results": [
            *common.measured(results),
            "",
            *common.table(
                "launcher | version | environment",
                [
                    (n, v["version"], " ".join(f"`{k}={x}`" for k, x in v["env"].items()) or "-")
                    for n, v in results["launchers"].items()
                ],
            ),
        ]
    }
    for kill, failure in results["failures"].items():
        summary, first = failure["summary"], failure["first_step"]
        ours = summary["rallypoint"]["median_recovery_seconds"]
        rows = []
        for name in names:
            mine = summary[name]
            median = mine["median_recovery_seconds"]
            ratio = (
                f"{ours / median:.2g}x" if ours is not None and median and name != "rallypoint"
                else "-"
            )  # fmt: skip
            samples = failure["samples"][name]
            lingered = sum("still running" in (s["error"] or "") for s in samples)
            rows.append((
                name,
                common.number(median, " s") if median is not None else "did not recover",
                f"{mine['recovered']} of {mine['runs']}",
                ratio,
                common.number(first[name], " s"),
                f"{mine['runs_with_orphans']} of {mine['runs']}",
                *([f"{lingered} of {len(samples)}"] if kill == "preempt" else []),
            ))  # fmt: skip
        blocks[kill] = [
            f"{failure['title'][0].upper()}{failure['title'][1:]}: {results['repeat']} runs "
            "per launcher.",
            "",
            *common.table(
                "launcher | median seconds to a step in the new world | recovered | "
                "rallypoint / launcher | median seconds from start to the first step at "
                "world 4 | runs leaving a worker of the lost node"
                + (
                    f" | runs whose agent still ran {bench_recovery.LEAVE_WAIT:.0f} s after "
                    "SIGTERM (then SIGKILLed)"
                    if kill == "preempt"
                    else ""
                ),
                rows,
            ),
        ]
    blocks["commands"] = ["```", *results["commands"].values(), "```"]
    return blocks


def main() -> None:
    args = common.options(__doc__, **OPTIONS).parse_args()
    common.publish(args, "peers", "benchmarks-peers", measure, chart, render)


if __name__ == "__main__":
    main()
