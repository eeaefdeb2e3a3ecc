"""Hook specifications: every way a plugin can extend rallypoint.

A plugin is a module (or object) with functions marked ``@hookimpl`` (``rallypoint.sdk``)
whose names and parameters match the specifications below; it may implement any subset and
may leave out parameters it does not need. Installed plugins are found through the ``rallypoint``
entry-point group::

    [project.entry-points.rallypoint]
    mything = "rallypoint_mything"

The ``register_*`` hooks declare named implementations of the five extension points; each
returns a list (or any iterable) of the registration dataclasses of ``rallypoint.sdk``. The
``on_*`` hooks are told about each phase of a run; their return values are ignored.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import pluggy

from rallypoint.events import RoundInfo, RunInfo, WorkerFailure
from rallypoint.extensions import (
    CheckpointBackend,
    MetricsSink,
    RankAssigner,
    RendezvousBackend,
    RestartPolicy,
)

if TYPE_CHECKING:
    import typer

PROJECT_NAME = "rallypoint"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


# --- extension points: named implementations ----------------------------------------------


@hookspec
def register_rendezvous_backends() -> Iterable[RendezvousBackend]:
    """Declare rendezvous backends, the values ``--rdzv-backend`` accepts.

    Returns:
        The backends this plugin provides. Each gives ``connect(request)``, a client of its
        coordination store (rallypoint runs its rendezvous protocol on it), or
        ``create_handler(request)``, a whole rendezvous of its own. A name another plugin
        also registers is an error that names both distributions.

    Example::

        from rallypoint.sdk import COMMON_RENDEZVOUS_OPTIONS, ConfigOption, RendezvousBackend, hookimpl

        def connect(request):
            from consul_rendezvous.store import ConsulStore  # a CoordinationStore

            return ConsulStore(request.endpoint, token=request.options["token"])

        @hookimpl
        def register_rendezvous_backends():
            return [
                RendezvousBackend(
                    name="consul",
                    description="Consul KV sessions",
                    options=(*COMMON_RENDEZVOUS_OPTIONS, ConfigOption("token", str, "", secret=True)),
                    connect=connect,
                )
            ]
    """


@hookspec
def register_restart_policies() -> Iterable[RestartPolicy]:
    """Declare restart policies, the values ``--restart-policy`` accepts.

    Returns:
        The policies this plugin provides. ``decide`` gets a ``RestartRequest`` after every
        worker failure and answers with a ``RestartDecision``.

    Example::

        from rallypoint.sdk import ConfigOption, RestartDecision, RestartPolicy, hookimpl

        def _decide(request):
            if request.failure and request.failure.exit_code == 3:
                return RestartDecision(False, reason="exit code 3 means bad input; not retrying")
            limit = request.options["limit"]
            return RestartDecision(request.restarts_done < limit, delay=5.0)

        @hookimpl
        def register_restart_policies():
            return [
                RestartPolicy(
                    name="skip-bad-input",
                    description="restart unless the script exited with 3",
                    decide=_decide,
                    options=(ConfigOption("limit", int, 10),),
                )
            ]
    """


@hookspec
def register_rank_assigners() -> Iterable[RankAssigner]:
    """Declare rank assigners, the values ``--rank-assigner`` accepts.

    Returns:
        The assigners this plugin provides. ``assign`` gets the round's nodes in join order
        and returns their group ranks, a permutation of ``0..N-1``, deterministically: every
        agent computes it and all must agree.

    Example::

        from rallypoint.sdk import RankAssigner, hookimpl

        def _by_host(nodes):
            order = sorted(range(len(nodes)), key=lambda i: (nodes[i].host, nodes[i].node_id))
            ranks = [0] * len(nodes)
            for rank, index in enumerate(order):
                ranks[index] = rank
            return ranks

        @hookimpl
        def register_rank_assigners():
            return [RankAssigner("by-host", "ranks in host-name order", _by_host)]
    """


@hookspec
def register_checkpoint_backends() -> Iterable[CheckpointBackend]:
    """Declare checkpoint backends, chosen by the URL scheme of ``--checkpoint-dir``.

    Returns:
        The stores this plugin provides; each lists the URL schemes it serves and gives
        ``open(url)``, the ``CheckpointStorage`` at that URL, on which the workers'
        ``rallypoint.checkpoint`` builds checkpoints. Two stores claiming one scheme is an
        error that names both distributions.

    Example::

        from rallypoint.sdk import CheckpointBackend, hookimpl

        def open_storage(url):
            from my_s3_store.storage import S3Storage  # a CheckpointStorage

            return S3Storage(url)

        @hookimpl
        def register_checkpoint_backends():
            return [
                CheckpointBackend(
                    "s3", "objects in S3 via fsspec", schemes=("s3",), open=open_storage
                )
            ]
    """


@hookspec
def register_metrics_sinks() -> Iterable[MetricsSink]:
    """Declare metrics sinks, the values ``--metrics`` accepts (several may be chosen).

    Returns:
        The sinks this plugin provides. ``create`` gets a ``SinkContext`` and returns an
        object with ``emit(event)`` and ``close()``; it receives every ``rallypoint.sdk.Event``.

    Example::

        import sys
        from rallypoint.sdk import MetricsSink, hookimpl

        class _Stderr:
            def emit(self, event):
                print(event.to_json(), file=sys.stderr)

            def close(self):
                pass

        @hookimpl
        def register_metrics_sinks():
            return [MetricsSink("stderr", "every event as JSON on stderr", lambda ctx: _Stderr())]
    """


# --- command line -------------------------------------------------------------------------


@hookspec
def register_commands(app: typer.Typer) -> None:
    """Add commands to the ``rallypoint`` command line.

    Args:
        app: the top-level typer application. A command whose name is already taken by a
            built-in command is refused and the plugin is reported as broken.

    Example::

        import typer
        from rallypoint.sdk import hookimpl

        @hookimpl
        def register_commands(app):
            @app.command()
            def hello(name: str = "world") -> None:
                "Say hello."
                typer.echo(f"hello {name}")
    """


# --- lifecycle: one call per phase of a run, results ignored -------------------------------


@hookspec
def on_agent_started(run: RunInfo) -> None:
    """The agent on this node has started and is about to join the rendezvous.

    Args:
        run: the run id, this node's id, host name and role.

    Example::

        @hookimpl
        def on_agent_started(run):
            print(f"agent {run.node_id} joining {run.run_id}")
    """


@hookspec
def on_rendezvous_completed(run: RunInfo, round_info: RoundInfo) -> None:
    """A rendezvous round completed: membership, ranks and master address are agreed.

    Args:
        run: the run.
        round_info: the round's number, this node's group rank, the world sizes and members.

    Example::

        @hookimpl
        def on_rendezvous_completed(run, round_info):
            r = round_info
            print(f"round {r.round}: node rank {r.group_rank} of {r.group_world_size}")
    """


@hookspec
def on_workers_started(run: RunInfo, round_info: RoundInfo, pids: tuple[int, ...]) -> None:
    """This node's workers were started for a round.

    Args:
        run: the run.
        round_info: the round the workers belong to.
        pids: the process ids of the workers, ordered by local rank.

    Example::

        @hookimpl
        def on_workers_started(run, round_info, pids):
            print(f"started {len(pids)} workers: {pids}")
    """


@hookspec
def on_worker_failed(run: RunInfo, failure: WorkerFailure) -> None:
    """A worker on this node ended with a non-zero exit code or a signal.

    Args:
        run: the run.
        failure: which worker, how it ended and the root-cause message.

    Example::

        import logging

        @hookimpl
        def on_worker_failed(run, failure):
            how = failure.signal or f"exit code {failure.exit_code}"
            logging.getLogger("oncall").error("%s: rank %d died (%s)", run.run_id, failure.rank, how)
    """


@hookspec
def on_workers_restarted(run: RunInfo, restart_count: int, cause: str) -> None:
    """This node's workers are being restarted.

    Args:
        run: the run.
        restart_count: restarts made so far, counting this one (membership changes excluded).
        cause: ``"failure"`` (uses up a restart) or ``"membership"`` (a node joined or left).

    Example::

        @hookimpl
        def on_workers_restarted(run, restart_count, cause):
            print(f"restart #{restart_count} because of {cause}")
    """


@hookspec
def on_scale_changed(run: RunInfo, old_nodes: int, new_nodes: int) -> None:
    """The number of nodes in the job changed between two rounds.

    Args:
        run: the run.
        old_nodes: nodes in the previous round.
        new_nodes: nodes in the new round.

    Example::

        @hookimpl
        def on_scale_changed(run, old_nodes, new_nodes):
            print(f"scaled from {old_nodes} to {new_nodes} nodes")
    """


@hookspec
def on_agent_stopping(run: RunInfo, exit_code: int, reason: str) -> None:
    """The agent is about to exit.

    Args:
        run: the run.
        exit_code: the exit code the agent will return (0 on success).
        reason: one line saying why it stops (finished, failed with the root cause, signalled).

    Example::

        @hookimpl
        def on_agent_stopping(run, exit_code, reason):
            print(f"agent exiting with {exit_code}: {reason}")
    """
