"""The agent's rendezvous: the handler its launch configuration asks for, on this node."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial

from rallypoint.config import DEFAULT_MASTER_PORT, LaunchConfig
from rallypoint.errors import UsageError
from rallypoint.extensions import NodeSpec, RendezvousRequest, WaitSource
from rallypoint.interfaces import RendezvousHandler
from rallypoint.registry import replace_registration
from rallypoint.rendezvous.readiness import Ready
from rallypoint.rendezvous.store_handler import connect, protocol_handler

Offer = Callable[[], Mapping[str, str]]
Pace = Callable[[], "float | None"]


def request_for(
    config: LaunchConfig,
    node: NodeSpec,
    offer: Offer | None = None,
    pace: Pace | None = None,
    ready: Ready | None = None,
    waits: WaitSource | None = None,
) -> RendezvousRequest:
    """What a backend is told about this node's launch (and what its agent provides)."""
    assigner = config.assigner.item
    if assigner.options:  # its --rank-conf values go with every call
        assigner = replace_registration(
            assigner, assign=partial(assigner.assign, options=config.assigner.options)
        )
    return RendezvousRequest(
        run_id=config.rdzv_id,
        endpoint=config.rdzv_endpoint,
        options=config.rdzv_conf,
        min_nodes=config.min_nodes,
        max_nodes=config.max_nodes,
        nproc_per_node=config.nproc_per_node,
        node=node,
        rank_assigner=assigner,
        node_rank=config.node_rank,
        master_addr=config.master_addr,
        master_port=config.master_port,
        offer=offer,
        pace=pace,
        waits=waits,
        ready=ready,
        token=config.job_token,
    )


def create_handler(
    config: LaunchConfig,
    node: NodeSpec,
    offer: Offer | None = None,
    pace: Pace | None = None,
    ready: Ready | None = None,
    waits: WaitSource | None = None,
) -> RendezvousHandler:
    """The handler that runs ``config``'s rendezvous for this node.

    A job of one node meets nobody, whatever the backend (as torchrun, whose default
    ``--nnodes 1`` is a standalone rendezvous): it runs the protocol on a store in this
    process's memory. Otherwise the backend gives a whole handler, or a store for the
    protocol.
    """
    request = request_for(config, node, offer, pace, ready, waits)
    backend = config.rendezvous.item
    if config.max_nodes == 1:
        from rallypoint.rendezvous.memory_store import MemoryStore

        if backend.given_ranks:  # torchrun's static: the given master address, a fixed port
            port = config.master_port or DEFAULT_MASTER_PORT
            return protocol_handler(MemoryStore(), request, config.master_addr, port)
        return protocol_handler(MemoryStore(), request, "localhost")
    if backend.create_handler is not None:
        return checked_handler(backend.name, backend.create_handler(request))
    return protocol_handler(connect(backend, request), request, in_agent=backend.store_in_agent)


def checked_handler(backend: str, handler: object) -> RendezvousHandler:
    """A backend's own handler, once checked to have every method the agent calls."""
    missing = [
        name for name in (*_REQUIRED, *_DEFAULTED) if not callable(getattr(handler, name, None))
    ]
    if missing:
        raise UsageError(
            f"--rdzv-backend {backend}: its create_handler returned a handler without "
            f"{', '.join(missing)}; a plugin's handler inherits from "
            "rallypoint.sdk.RendezvousHandler, which has every method the agent calls."
        )
    return handler  # type: ignore[return-value]


_REQUIRED = ("next_round", "nodes_waiting", "request_new_round", "exit_barrier", "close")
#: Those ``rallypoint.sdk.RendezvousHandler`` has defaults of: a handler that inherits has them.
_DEFAULTED = ("gone", "fail", "paces", "waits", "give_notice", "noticed")
