"""rallypoint beside the launchers users would pick instead: torchrun and each peer of
``peers.py`` (NVIDIA's ft_launcher, DLRover's dlrover-run, torchft) on the same jobs, the
same failures, in one run; docs/benchmarks-peers.md says how. Three workloads (``--workload``):

- ``recovery``: two nodes of two workers (``tests/workers/steps.py``, an all-reduce every
  0.2 s), ``bench_recovery.py``'s runs: one of the second node's workers SIGKILLed (the
  job restarts at world 4), the second node SIGKILLed with its workers (a machine lost)
  and its agent sent SIGTERM (a preemption); for each, the seconds to the survivors' first
  step in the new world, and from the first agent's start to the first step at world 4.
  Not torchft: its recovery is in the training loop, which that script does not have.
- ``goodput``: ``bench_goodput.py``'s runs (its training script, saving every step, and
  its schedule: workers SIGKILLed, the second node SIGKILLed and SIGTERMed, each time
  started again), under each launcher with ``torch.save`` and with the launcher's own fast
  checkpoint where it runs on a CPU (torchft: its live recovery alone); steps kept, steps
  redone, seconds to a new step and to the node's return, and the agent's memory.
- ``hang``: the same training, one of the second node's workers hanging outside any
  collective; the seconds to a new step, within the run.

    .venv/bin/python benchmarks/bench_peers.py [--workload recovery] [--repeat 3]
    .venv/bin/python benchmarks/bench_peers.py --workload goodput [--seconds 180]
    .venv/bin/python benchmarks/bench_peers.py --workload hang
    .venv/bin/python benchmarks/bench_peers.py --render-only

A workload run alone replaces its part of ``results/peers.json`` and keeps the others.
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import subprocess
import tempfile
import time
from dataclasses import asdict
from importlib import metadata
from pathlib import Path
from typing import Any

import bench_goodput
import bench_recovery
import common
import peers

#: The failures, in the page's order: bench_recovery's --kill of each.
FAILURES = {
    "worker": "a worker SIGKILLed",
    "node": "a node SIGKILLed",
    "preempt": "a node sent SIGTERM",
}
WORKLOADS = ("recovery", "goodput", "hang")
OPTIONS = {
    "workload": (("all", *WORKLOADS), "which workload to measure (all: each in turn)"),
    "repeat": (3, "recovery: runs per launcher and failure"),
    "cap": (120.0, "seconds after the failure before a run counts as not recovered"),
    "start_cap": (180.0, "seconds for the two agents to reach world=4 before it is given up"),
    "orphan_grace": (10.0, "seconds for orphans to go away before they are counted again"),
    "only_peer": (("", *(p.name for p in peers.PEERS)), "of the peers, run this one only"),
    "only_failure": (("", *FAILURES), "of the failures, this one only (for trying things out)"),
    "seconds": (180.0, "goodput: wall time of each run, from the job's first step"),
    "hang_seconds": (150.0, "hang: wall time of each run, from the job's first step"),
    "hang_at": (20.0, "hang: seconds from the first step when the worker hangs"),
}
#: Each peer's rendezvous settings, as bench_recovery sets rallypoint's and torchrun's: a
#: node taken for dead 3 s after its last heartbeat, a last call of 1 s. ft_launcher takes
#: torchrun's c10d keys; DLRover's rendezvous runs in its job master, whose last call is
#: its own key (``lastcall_timeout``, 60 s by default) and which finds a lost node itself.
PEER_RDZV_CONF = {
    "ft_launcher": bench_recovery.RDZV_CONF["torchrun"],
    "dlrover-run": "lastcall_timeout=1",
    "torchft": "",  # no rendezvous: its Lighthouse forms a quorum at every step
}
PEER_COLORS = {"ft_launcher": "#76b900", "dlrover-run": "#e8710a", "torchft": "#9467bd"}


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
        version = peers.ensure(peer)
        if version is None:
            continue
        common.COLORS[peer.name] = PEER_COLORS[peer.name]
        common.LAUNCHERS[peer.name] = peer.command
        if peer.name == "dlrover-run":
            register_dlrover(peer)
        if peer.name == "torchft":
            register_torchft(peer)
        bench_recovery.RDZV_CONF[peer.name] = PEER_RDZV_CONF[peer.name]
        found[peer.name] = {
            "version": f"{peer.distribution} {version}, torch {peer.torch}",
            # torch's elastic agent too; but torchft's single-node torchruns, where the
            # workaround leaves the store its Manager connects to unserved (the page says)
            "env": {} if peer.name == "torchft" else dict(bench_recovery.TORCHRUN_WORKAROUND),
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


def register_torchft(peer: peers.Peer) -> None:
    """torchft as its README runs it: one Lighthouse per job (``torchft_lighthouse
    --min_replicas 1 --quorum_tick_ms 100 --join_timeout_ms 10000``, on the run's port), and
    each node's replica groups under a torchrun each (``torchft_node.py``)."""

    def lighthouse(port: int, run_id: str, workdir: Path) -> subprocess.Popen[bytes]:
        command = [
            str(peer.home / "bin" / peer.script), "--min_replicas", "1",
            "--quorum_tick_ms", "100", "--join_timeout_ms", "10000",
            "--bind", f"{common.HOST}:{port}",
        ]  # fmt: skip
        return bench_recovery.start(command, {}, workdir / "lighthouse.log")

    common.LAUNCHERS[peer.name] = [
        str(peer.home / "bin" / "python"),
        str(common.ROOT / "benchmarks" / "torchft_node.py"),
    ]
    bench_recovery.HELPERS[peer.name] = lighthouse
    bench_recovery.NODE_ENV[peer.name] = lambda port, node: {
        "TORCHFT_LIGHTHOUSE": f"http://{common.HOST}:{port}",
        "NODE_RANK": str(node),
    }


#: Each launcher's own fast checkpoint (``train_checkpoint.py``'s way), besides torch.save.
FAST = {
    "rallypoint": "rallypoint", "ft_launcher": "nvidia-local", "dlrover-run": "flash",
    "torchft": "torchft",
}  # fmt: skip
#: Launchers measured with their own way alone: under torchft a group that comes back heals
#: from a live peer and reads no file unless every group is lost, which no run here does.
OWN_WAY_ONLY = ("torchft",)
WAY_NAMES = {
    "rallypoint": "memory checkpoint",
    "torch.save": "torch.save",
    "flash": "Flash Checkpoint",
    "nvidia-local": "local checkpointing",
    "torchft": "live recovery",
}
PROBE_WAIT = 180.0  # seconds for a fast checkpoint's trial run


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """The workloads asked for; a workload measured alone keeps the others' last results."""
    found = launchers(args)
    kept = common.RESULTS / "peers.json"
    results: dict[str, Any] = {}
    if args.workload != "all" and kept.exists():
        results = {k: v for k, v in json.loads(kept.read_text()).items() if k in WORKLOADS}
    results["launchers"] = {**results.get("launchers", {}), **found}
    for workload in WORKLOADS if args.workload == "all" else (args.workload,):
        began = time.time()
        part = {"recovery": measure_recovery, "goodput": measure_goodput,
                "hang": measure_hang}[workload](args, found)  # fmt: skip
        part["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(began))
        part["load_after"] = common.load_average()
        results[workload] = part
    return results


def goodput_launch(name: str, way: str, found: dict[str, dict[str, Any]]) -> bench_goodput.Launch:
    """``name``'s goodput run saving ``way``: on the c10d rendezvous its first node hosts,
    with the rendezvous settings of the recovery runs."""
    return bench_goodput.Launch(
        f"{name}, {WAY_NAMES[way]}", name, "c10d", bench_recovery.RDZV_CONF[name],
        checkpoint=way, env=found[name]["env"], node_env=bench_recovery.NODE_ENV.get(name),
        helper=bench_recovery.HELPERS.get(name),
    )  # fmt: skip


def probe(name: str, way: str) -> str | None:
    """Whether ``way`` saves and loads under ``name`` on this machine: a short standalone
    run of the training script; None, or its error in a line."""
    with tempfile.TemporaryDirectory(prefix="bench-peers-probe-") as scratch:
        command = [
            *common.LAUNCHERS[name], "--standalone", "--nproc-per-node", "2",
            str(bench_goodput.TRAIN), "--steps", "3", "--step-seconds", "0.05",
            "--checkpoint", way, "--checkpoint-dir", scratch,
        ]  # fmt: skip
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=PROBE_WAIT,
                                  env=common.clean_env(), cwd=scratch)  # fmt: skip
        except subprocess.TimeoutExpired:
            return f"a three-step run did not end within {PROBE_WAIT:.0f} s"
    if done.returncode == 0:
        return None
    lines = [line.partition("]: ")[2] or line for line in done.stdout.splitlines()
             + done.stderr.splitlines()]  # fmt: skip
    errors = [i for i, line in enumerate(lines) if re.match(r"\w+(Error|Exception)\b", line)]
    if not errors:
        return f"exit code {done.returncode}"
    last = errors[-1]
    return " ".join(x.strip() for x in lines[max(0, last - 1) : last + 1])


def measure_goodput(args: argparse.Namespace, found: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """bench_goodput's runs under every launcher: torch.save for each, then its own fast
    checkpoint where that runs here (a way that does not is said, with its error);
    torchft's own way alone."""
    launches, refused = [], {}
    for name in found:
        ways = ([] if name in OWN_WAY_ONLY else ["torch.save"]) + (
            [FAST[name]] if name in FAST else []
        )
        for way in ways:
            # A trial of a fast checkpoint under a launcher's standalone mode (torchft's
            # needs its Lighthouse: its runs show what fails)
            trial = way not in ("torch.save", "rallypoint") and name not in OWN_WAY_ONLY
            if trial and (error := probe(name, way)):
                print(f"{name}, {WAY_NAMES[way]}: {error}; left out", flush=True)
                refused[f"{name}, {WAY_NAMES[way]}"] = error
                continue
            launches.append(goodput_launch(name, way, found))
    run = goodput_args(args, seconds=args.seconds)
    return {**bench_goodput.measure_launches(launches, run), "refused": refused}


def measure_hang(args: argparse.Namespace, found: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One run per launcher, a worker hanging: rallypoint as it runs by default, torchft
    with its own way, the others with torch.save."""
    launches = [
        goodput_launch(name, FAST[name] if name in ("rallypoint", *OWN_WAY_ONLY) else "torch.save",
                       found)
        for name in found
    ]  # fmt: skip
    run = goodput_args(args, seconds=args.hang_seconds, hang_at=args.hang_at,
                       worker_every=0.0, node_every=0.0)  # fmt: skip
    return bench_goodput.measure_launches(launches, run, clean=False)


def goodput_args(args: argparse.Namespace, **chosen: Any) -> argparse.Namespace:
    """bench_goodput's options at their defaults, but for ``chosen``."""
    run = argparse.Namespace(**{k: v[0] if not isinstance(v[0], tuple) else v[0][0]
                                for k, v in bench_goodput.OPTIONS.items()})  # fmt: skip
    for key, value in chosen.items():
        setattr(run, key, value)
    return run


def measure_recovery(args: argparse.Namespace, found: dict[str, dict[str, Any]]) -> dict[str, Any]:
    # torchft's recovery is in the training loop (its Manager): the recovery runs' script
    # has none, and the goodput runs measure it under the same failures.
    names = [name for name in found if name not in OWN_WAY_ONLY]
    results: dict[str, Any] = {"repeat": args.repeat, "failures": {}}
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
    if "recovery" in results:
        chart_recovery(results)
    if "goodput" in results:
        chart_goodput(results["goodput"])


def recovery_names(results: dict[str, Any]) -> list[str]:
    """The launchers of the recovery runs (torchft has none), in the results' order."""
    failures = list(results["recovery"]["failures"].values())
    return [name for name in results["launchers"] if name in failures[0]["summary"]]


def chart_recovery(results: dict[str, Any]) -> None:
    names = recovery_names(results)
    failures = results["recovery"]["failures"]
    figure, axes = common.figure(1, len(failures), figsize=(10.5, 3.2), sharey=True)
    for axis, failure in zip(axes, failures.values(), strict=True):
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


def chart_goodput(part: dict[str, Any]) -> None:
    """Steps kept over the run with failures, one line per launch; the failures marked."""
    figure, axis = common.figure(1, 1, figsize=(10.5, 4.2))
    for run in part["runs"].values():
        if not run["faults"]:
            continue
        launcher = run["launcher"].partition(",")[0]
        style = "--" if run["checkpoint"] == "torch.save" else "-"
        axis.plot(range(len(run["by_second"])), run["by_second"], style,
                  color=common.COLORS.get(launcher, "#999999"),
                  label=f"{run['launcher']}: {run['steps']}", linewidth=1.5)  # fmt: skip
    bench_goodput.mark_schedule(axis, part["schedule"])
    axis.set_xlabel(
        "seconds from the job's first step (red dashed: a worker SIGKILLed; solid: the "
        "second node SIGKILLed, red, or SIGTERMed, orange; each time started again)"
    )
    axis.set_ylabel("steps kept (newest step done)")
    axis.set_title("Training progress under failures, two nodes of two workers "
                   "(solid: the launcher's own fast checkpoint; dashed: torch.save)",
                   fontsize=10)  # fmt: skip
    axis.legend(fontsize=8, loc="upper left")
    axis.grid(True, alpha=0.3)
    common.save(figure, "bench_peers_goodput.png")


def render(results: dict[str, Any]) -> dict[str, list[str]]:
    blocks: dict[str, list[str]] = {
        "results": [
            *common.measured(
                results,
                "- Workloads: "
                + ", ".join(f"{w} {results[w]['date']}" for w in WORKLOADS if w in results)
                + " (each part run by `--workload NAME` keeps the others)",
            ),
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
    if "recovery" in results:
        blocks |= render_recovery(results["recovery"], recovery_names(results))
    if "goodput" in results:
        blocks |= render_goodput(results["goodput"])
    if "hang" in results:
        blocks |= render_hang(results["hang"])
    return blocks


def render_recovery(part: dict[str, Any], names: list[str]) -> dict[str, list[str]]:
    blocks: dict[str, list[str]] = {}
    for kill, failure in part["failures"].items():
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
            f"{failure['title'][0].upper()}{failure['title'][1:]}: {part['repeat']} runs "
            f"per launcher, measured {part['date']}.",
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
    blocks["commands"] = ["```", *part["commands"].values(), "```"]
    return blocks


#: The process a launcher's job needs besides the agents, as the notes name it.
HELPERS = {"dlrover-run": "DLRover's job master", "torchft": "torchft's Lighthouse"}
#: The goodput row every other is compared with: rallypoint as it runs by default.
OURS = "rallypoint, memory checkpoint"
KINDS = ("worker SIGKILL", "node SIGKILL", "node SIGTERM")


def render_goodput(part: dict[str, Any]) -> dict[str, list[str]]:
    summary, settings = part["summary"], part["settings"]
    ours = summary.get(OURS, {}).get("goodput")
    rows = []
    for name, s in summary.items():
        events = s["by_event"]
        redone = [events[k]["redone"] for k in KINDS if k in events]
        rejoin = [events[k]["mean_seconds_to_rejoin"] for k in ("node SIGKILL", "node SIGTERM")
                  if k in events and events[k]["mean_seconds_to_rejoin"] is not None]  # fmt: skip
        memory = s["agent_memory"] or {}
        startup = part["runs"].get(f"{name}-clean", {}).get("startup_seconds")
        ratio = (
            "-" if name == OURS or not ours or not s["goodput"] else f"{s['goodput'] / ours:.2f}"
        )
        rows.append([
            name, common.number(startup, " s", 1), s["steps_clean"], s["steps_faults"],
            f"**{bench_goodput.percent(s['goodput'])}**", ratio,
            *(to_new_step(events.get(kind)) for kind in KINDS),
            common.number(sum(rejoin) / len(rejoin) if rejoin else None, " s", 1),
            "n/a" if not redone or None in redone else sum(redone),
            f"{common.number(memory.get('median_mb'), ' MB', 0)} "
            f"({common.number(memory.get('peak_mb'), ' MB', 0)})",
        ])  # fmt: skip
    helpers = {r["launcher"]: r["agent_memory"]["helper"] for r in part["runs"].values()
               if not r["faults"] and r["agent_memory"].get("helper")}  # fmt: skip
    notes = [
        f"- Measured {part['date']}; {settings['seconds']:.0f} s per run from the job's first "
        f"step; {bench_goodput.described(part['schedule'])}; {settings['step_seconds']} s "
        "steps, saved every step.",
        "- Goodput: the steps kept with failures ÷ the steps kept without, the same launcher "
        "and checkpoint; ratio: of the row's goodput to rallypoint's by default. Seconds to a "
        "new step: the mean, from the signal to the job's first step it had not done; "
        "never: not before the next failure.",
        "- Agent memory: the PSS of the first node's launcher processes (the agent and all "
        f"below it but the workers), sampled every {bench_goodput.SAMPLE_EVERY:.0f} s of the "
        "run without failures: median (peak).",
    ]
    for name, helper in helpers.items():
        what = HELPERS.get(name.partition(",")[0], "its helper")
        notes.append(f"- {name}: {what}, one per job, besides: "
                     f"{helper['median_mb']:.0f} MB ({helper['peak_mb']:.0f} MB).")  # fmt: skip
    for name, error in part.get("refused", {}).items():
        notes.append(f"- {name}: not run, its trial run on this machine failed: `{error}`")
    for name, run in part["runs"].items():
        if run.get("error") or run["leftovers"]:
            notes.append(f"- {name}: {run.get('error') or ''} {run['leftovers']} processes "
                         "left after the cleanup")  # fmt: skip
    commands = ["```", *(part["runs"][f"{n}-faults"]["command"] for n in summary), "```"]
    return {
        "goodput": [
            *common.table(
                "launcher, checkpoint | seconds to the first step | steps, no failures | "
                "steps, failures | goodput | "
                "÷ rallypoint's | worker SIGKILL: seconds to a new step | node SIGKILL | "
                "node SIGTERM | seconds from a node's return to a step with it | "
                "steps redone | agent memory",
                rows,
            ),
            "",
            *notes,
        ],
        "goodput-commands": commands,
    }


def to_new_step(entry: dict[str, Any] | None) -> str:
    if entry is None:
        return "not reached"
    never = f" ({entry['never']} never)" if entry["never"] else ""
    if entry["mean_seconds_to_new_step"] is None:
        return f"never{never}" if entry["never"] else "n/a"
    return f"{entry['mean_seconds_to_new_step']:.1f} s{never}"


def render_hang(part: dict[str, Any]) -> dict[str, list[str]]:
    settings, rows = part["settings"], []
    for name, s in part["summary"].items():
        run = part["runs"][f"{name}-faults"]
        hang = next((k for k in run["kills"] if k["kind"] == "hang" and "at" in k), None)
        seconds = None if hang is None else hang.get("seconds_to_new_step")
        left = settings["seconds"] - (hang["at"] if hang else settings["hang_at"])
        rows.append([
            name,
            f"{seconds:.1f} s" if seconds is not None else f"none in the {left:.0f} s left",
            "n/a" if hang is None or hang.get("redone") is None else hang["redone"],
            s["steps_faults"],
        ])  # fmt: skip
    return {
        "hang": [
            f"Measured {part['date']}: one run per launcher, {settings['seconds']:.0f} s from "
            f"the job's first step; a worker of the second node hangs at "
            f"{settings['hang_at']:.0f} s (every flag at its default but the rendezvous's).",
            "",
            *common.table(
                "launcher, checkpoint | seconds from the hang to a new step | steps redone | "
                "steps kept in the run",
                rows,
            ),
        ]
    }


def main() -> None:
    args = common.options(__doc__, **OPTIONS).parse_args()
    common.publish(args, "peers", "benchmarks-peers", measure, chart, render)


if __name__ == "__main__":
    main()
