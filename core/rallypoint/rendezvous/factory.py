"""Building the rendezvous handler a launch configuration asks for."""

from __future__ import annotations

from rallypoint.config import DEFAULT_MASTER_PORT, LaunchConfig
from rallypoint.errors import UsageError
from rallypoint.extensions import NodeSpec, RendezvousBackend, RendezvousRequest
from rallypoint.registry import RANK_ASSIGNERS, RENDEZVOUS_BACKENDS, Registry
from rallypoint.rendezvous.handler import RendezvousHandler
from rallypoint.rendezvous.store import CoordinationStore


def request_for(config: LaunchConfig, registry: Registry, node: NodeSpec) -> RendezvousRequest:
    """What a backend is told about this node's launch."""
    return RendezvousRequest(
        run_id=config.rdzv_id,
        endpoint=config.rdzv_endpoint,
        options=config.rdzv_conf,
        min_nodes=config.min_nodes,
        max_nodes=config.max_nodes,
        nproc_per_node=config.nproc_per_node,
        node=node,
        rank_assigner=registry.get(RANK_ASSIGNERS, config.rank_assigner),
        node_rank=config.node_rank,
        master_addr=config.master_addr,
        master_port=config.master_port,
    )


def create_handler(config: LaunchConfig, registry: Registry, node: NodeSpec) -> RendezvousHandler:
    """The handler that runs ``config``'s rendezvous for this node.

    A job of one node meets nobody, whatever the backend (as torchrun, whose default
    ``--nnodes 1`` is a standalone rendezvous): it runs the protocol on a store in this
    process's memory. Otherwise the backend gives a whole handler, or a store for the
    protocol.
    """
    request = request_for(config, registry, node)
    backend = registry.get(RENDEZVOUS_BACKENDS, config.rdzv_backend)
    if config.max_nodes == 1:
        from rallypoint.rendezvous.memory import MemoryStore

        if backend.name == "static":  # torchrun's: the given master address, a fixed port
            port = config.master_port or DEFAULT_MASTER_PORT
            return protocol_handler(MemoryStore(), request, config.master_addr, port)
        return protocol_handler(MemoryStore(), request, "localhost")
    if backend.create_handler is not None:
        return backend.create_handler(request)
    return protocol_handler(connect(backend, request), request)


def protocol_handler(
    store: CoordinationStore,
    request: RendezvousRequest,
    master_addr: str | None = None,
    master_port: int | None = None,
) -> RendezvousHandler:
    """Core's rendezvous protocol over ``store``, for the node ``request`` describes.

    The workers' master address is group rank 0's host and a free port it holds, unless
    ``master_addr`` and ``master_port`` fix them."""
    from rallypoint.rendezvous.protocol import Settings, StoreRendezvous

    assert request.rank_assigner is not None
    settings = Settings.from_conf(request.min_nodes, request.max_nodes, request.options)
    return StoreRendezvous(
        store,
        request.run_id,
        request.node,
        request.nproc_per_node,
        request.rank_assigner,
        settings,
        master_addr=master_addr,
        master_port=master_port,
    )


def connect(backend: RendezvousBackend, request: RendezvousRequest) -> CoordinationStore:
    """A client of ``backend``'s coordination store."""
    if backend.connect is None:
        raise UsageError(
            f"--rdzv-backend {backend.name}: has no coordination store to "
            f"{'inspect' if request.viewer else 'run the rendezvous protocol on'}."
        )
    return backend.connect(request)
