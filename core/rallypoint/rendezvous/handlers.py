"""Choosing the rendezvous handler for a launch configuration."""

from __future__ import annotations

import socket

from rallypoint.config import DEFAULT_MASTER_PORT, LaunchConfig
from rallypoint.errors import UsageError
from rallypoint.extensions import NodeSpec, RendezvousBackend, RendezvousRequest
from rallypoint.redact import redact_endpoint
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


def parse_endpoint(endpoint: str, default_port: int) -> tuple[str, int]:
    """``"host:port"`` (or ``"host"``) -> ``("host", port)``."""
    if "@" in endpoint:  # no host name has one: credentials, which a store here never takes
        raise UsageError(
            f"--rdzv-endpoint {redact_endpoint(endpoint)!r}: expected host:port, "
            "without a user name or password."
        )
    host, sep, port = endpoint.strip().rpartition(":")
    if not sep:
        return endpoint.strip(), default_port
    if not port.isdigit() or not 0 < int(port) < 65536:
        shown = redact_endpoint(endpoint)  # "user:password@host:port" happens
        raise UsageError(f"--rdzv-endpoint {shown!r}: expected host:port.")
    return host.strip("[]"), int(port)


def node_address(local_addr: str | None, max_nodes: int) -> str:
    """How the other nodes reach this one: ``--local-addr``, else, as torchrun, this host's
    fully qualified name, or its plain name where that is the one that resolves (a
    ``localhost`` alias reaches no other host). Checked only when other nodes may need it.

    Raises:
        UsageError: neither name resolves: one sentence naming ``--local-addr``.
    """
    if local_addr:
        return local_addr
    hostname = socket.gethostname()
    if max_nodes == 1:
        return hostname
    names = [name for name in dict.fromkeys((socket.getfqdn(), hostname)) if name]
    resolved = [name for name in names if _resolves(name)]
    if not resolved:
        raise UsageError(
            f"this host's name {hostname!r} does not resolve to an address (nor does "
            f"{' or '.join(repr(n) for n in names if n != hostname) or 'its full name'}), "
            "so other nodes could not reach it: give --local-addr with an address they can "
            "reach."
        )
    named = [name for name in resolved if not name.startswith("localhost")]
    return (named or resolved)[0]


def _resolves(name: str) -> bool:
    try:
        return bool(socket.getaddrinfo(name, None))
    except (OSError, UnicodeError):
        return False
