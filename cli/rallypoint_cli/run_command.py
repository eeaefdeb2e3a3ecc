"""``rallypoint run``: torchrun's command line, checked against the installed plugins.

Every flag has torchrun's name and default, is also spelled with underscores, and can be set
from the environment as ``RALLYPOINT_<FLAG>`` or torchrun's ``PET_<FLAG>`` (Kubeflow's
PyTorchJob sets ``PET_*``); the command line wins over ``RALLYPOINT_*``, which wins over
``PET_*``. The command only parses: ``LaunchConfig.from_flags`` validates.
"""

from __future__ import annotations

from typing import Any

import typer
import typer.core

from rallypoint.config import LaunchConfig
from rallypoint.plugins import PluginManager
from rallypoint.registry import (
    METRICS_SINKS,
    RANK_ASSIGNERS,
    RENDEZVOUS_BACKENDS,
    RESTART_POLICIES,
    Kind,
    Registry,
)
from rallypoint_cli import abbreviations


def flag(name: str, default: Any, help: str, *, short: str | None = None, **extra: Any) -> Any:
    """A typer option spelled ``--a-b`` and ``--a_b``, read from ``RALLYPOINT_A_B`` / ``PET_A_B``."""
    dest = name.replace("-", "_")
    decls = [f"--{name}"]
    if dest != name:
        decls.append(f"--{dest}")
    if short:
        decls.append(short)
    env = [f"RALLYPOINT_{dest.upper()}", f"PET_{dest.upper()}"]
    return typer.Option(default, *decls, envvar=env, help=help, **extra)


class _RunCommand(typer.core.TyperCommand):
    """``run``, taking abbreviated long options as torchrun's argparse does."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        expanded = abbreviations.expand(self, args, self.get_help_option_names(ctx))
        return list(super().parse_args(ctx, expanded))


def _choices(registry: Registry, kind: Kind[Any]) -> str:
    return ", ".join(registry.names(kind)) or "(none installed)"


def register(app: typer.Typer, pm: PluginManager) -> None:
    """Add ``run`` to ``app``; its help lists the names the plugins of ``pm`` register."""
    registry = pm.registry
    backends = _choices(registry, RENDEZVOUS_BACKENDS)
    policies = _choices(registry, RESTART_POLICIES)
    assigners = _choices(registry, RANK_ASSIGNERS)
    sinks = _choices(registry, METRICS_SINKS)

    @app.command(
        "run",
        cls=_RunCommand,
        context_settings={"allow_interspersed_args": False, "ignore_unknown_options": True},
    )
    def run(
        ctx: typer.Context,
        training_script: str = typer.Argument(
            "",
            metavar="SCRIPT",
            show_default=False,
            help="The training script (or module with -m).",
        ),
        training_script_args: list[str] = typer.Argument(
            None, metavar="[ARGS]...", show_default=False, help="Arguments for the script."
        ),
        nnodes: str = flag(
            "nnodes",
            "1:1",
            "Number of nodes N, a range MIN:MAX for an elastic job, or auto (Slurm).",
        ),
        nproc_per_node: str = flag(
            "nproc-per-node", "1", "Workers per node: a number, or auto, cpu, gpu, xpu."
        ),
        rdzv_backend: str = flag("rdzv-backend", "static", f"Rendezvous backend: {backends}."),
        rdzv_endpoint: str = flag("rdzv-endpoint", "", "Rendezvous endpoint, usually host:port."),
        rdzv_id: str = flag("rdzv-id", "none", "Job id shared by every node of the job."),
        rdzv_conf: str = flag("rdzv-conf", "", "Backend settings as key=value,key=value."),
        standalone: bool = flag(
            "standalone", False, "Single node: local c10d store on a free port, fresh run id."
        ),
        max_restarts: str = flag("max-restarts", "0", "Worker group restarts before failing."),
        monitor_interval: str = flag("monitor-interval", "0.1", "Seconds between worker checks."),
        start_method: str = flag("start-method", "spawn", "Accepted for torchrun compatibility."),
        role: str = flag("role", "default", "User-defined role of the workers."),
        module: bool = flag("module", False, "Run SCRIPT as a module, like python -m.", short="-m"),
        no_python: bool = flag("no-python", False, "Run SCRIPT directly, not with python."),
        run_path: bool = flag(
            "run-path", False, "Run SCRIPT (an absolute path) with runpy.run_path."
        ),
        log_dir: str | None = flag("log-dir", None, "Base directory for worker log files."),
        redirects: str = flag(
            "redirects", "0", "Redirect streams to files: 0-3 or LOCAL_RANK:0-3,...", short="-r"
        ),
        tee: str = flag(
            "tee", "0", "Copy streams to files and the console (like --redirects).", short="-t"
        ),
        local_ranks_filter: str = flag(
            "local-ranks-filter", "", "Show console output only from these local ranks (0,1,...)."
        ),
        node_rank: str = flag("node-rank", "0", "This node's rank (static rendezvous)."),
        master_addr: str = flag(
            "master-addr", "127.0.0.1", "Rank 0's address (static rendezvous)."
        ),
        master_port: str | None = flag(
            "master-port", None, "Rank 0's port (static rendezvous; default 29500)."
        ),
        local_addr: str | None = flag(
            "local-addr", None, "This node's address, as others reach it."
        ),
        signals_to_handle: str = flag(
            "signals-to-handle", "SIGTERM,SIGINT,SIGHUP,SIGQUIT", "Signals forwarded to workers."
        ),
        shutdown_timeout: str | None = flag(
            "shutdown-timeout", None, "Seconds workers get to stop before SIGKILL (default 30)."
        ),
        exit_barrier_timeout: str = flag(
            "exit-barrier-timeout", "300", "Seconds to wait for other nodes to finish."
        ),
        restart_policy: str = flag(
            "restart-policy", "max-restarts", f"Restart policy: {policies}."
        ),
        restart_conf: str = flag("restart-conf", "", "Restart policy settings as key=value,..."),
        rank_assigner: str = flag("rank-assigner", "ordered", f"Rank assignment: {assigners}."),
        rank_conf: str = flag("rank-conf", "", "Rank assigner settings as key=value,..."),
        node_label: list[str] = flag(
            "node-label", None, "KEY=VALUE label of this node (repeatable), for rank assignment."
        ),
        metrics: str = flag("metrics", "", f"Metrics sinks, comma-separated: {sinks}."),
        metrics_conf: str = flag("metrics-conf", "", "Metrics sink settings as key=value,..."),
        metrics_port: str | None = flag(
            "metrics-port",
            None,
            "Port of the metrics endpoint (0: a free one); --metrics-conf port=N.",
        ),
        checkpoint_dir: str | None = flag(
            "checkpoint-dir", None, "Where workers save checkpoints: a path or URL."
        ),
        checkpoint_memory: str | None = flag(
            "checkpoint-memory",
            None,
            "Save checkpoints to this node's shared memory, at most SIZE (4GB); the agent "
            "copies them to --checkpoint-dir.",
        ),
        checkpoint_memory_keep: str | None = flag(
            "checkpoint-memory-keep", None, "Memory checkpoints kept per node (default 1)."
        ),
        checkpoint_persist_every: str | None = flag(
            "checkpoint-persist-every",
            None,
            "Copy every Nth memory checkpoint to --checkpoint-dir (default 10).",
        ),
        event_log: str | None = flag("event-log", None, "Append a JSON-lines log of every phase."),
        straggler_factor: str | None = flag(
            "straggler-factor",
            None,
            "Name a node whose workers work this many times longer per step than the "
            "others' median (default 1.5; 0: never).",
        ),
        watchdog_timeout: str | None = flag(
            "watchdog-timeout",
            None,
            "Restart a worker silent this many seconds after a rallypoint.heartbeat() "
            "(default: off).",
        ),
        logs_specs: str | None = flag(
            "logs-specs", None, "A torchrun.logs_specs entry point: where worker logs go."
        ),
        event_log_handler: str = flag(
            "event-log-handler", "null", "torch's event handler: null, console, dynamic_rendezvous."
        ),
        duplicate_stdout_filters: str = flag(
            "duplicate-stdout-filters",
            "",
            "Also copy teed stdout lines containing one of these (a,b; ,, for a comma) to a file.",
        ),
        duplicate_stderr_filters: str = flag(
            "duplicate-stderr-filters", "", "The same for stderr."
        ),
        numa_binding: str | None = flag(
            "numa-binding",
            None,
            "Bind workers near their device: node, socket, exclusive, core-complex.",
        ),
        virtual_local_rank: bool = flag(
            "virtual-local-rank",
            False,
            "LOCAL_RANK=0 in every worker, CUDA_VISIBLE_DEVICES its own device.",
        ),
        warm_start: str = flag(
            "warm-start",
            "on",
            "on: fork workers from an interpreter that imported torch already; off: a fresh one each.",
        ),
        preload: str = flag(
            "preload", "", "Modules to import before forking workers, besides torch (a,b)."
        ),
    ) -> None:
        """Launch SCRIPT on this node's workers, like torchrun, and keep it running."""
        flags = dict(ctx.params)
        flags["node_labels"] = flags.pop("node_label") or ()
        config = LaunchConfig.from_flags(pm.registry, **flags)
        from rallypoint.agent.elastic import Agent

        raise typer.Exit(Agent(config, pm).run_job())
