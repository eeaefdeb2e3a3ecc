"""Choosing the rendezvous handler for a launch configuration."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rallypoint.config import DEFAULT_MASTER_PORT, LaunchConfig
from rallypoint.errors import UsageError
from rallypoint.extensions import NodeSpec
from rallypoint.registry import RANK_ASSIGNERS, Registry
from rallypoint.rendezvous.handler import RendezvousHandler
from rallypoint.rendezvous.local import LocalRendezvous
from rallypoint.rendezvous.store import CoordinationStore


def create_handler(config: LaunchConfig, registry: Registry, node: NodeSpec) -> RendezvousHandler:
    """The handler that runs ``config``'s rendezvous for this node."""
    assigner = registry.get(RANK_ASSIGNERS, config.rank_assigner)
    if config.max_nodes == 1:
        # One node meets nobody, whatever the backend: as torchrun, whose default
        # `--nnodes 1` runs the same standalone rendezvous.
        if config.rdzv_backend == "static":
            # torchrun's static rendezvous: the given master address, the given or default port.
            return LocalRendezvous(
                node,
                config.nproc_per_node,
                assigner,
                master_addr=config.master_addr,
                master_port=config.master_port or DEFAULT_MASTER_PORT,
            )
        return LocalRendezvous(node, config.nproc_per_node, assigner)
    if config.rdzv_backend == "c10d":
        from rallypoint.rendezvous.protocol import Settings, StoreRendezvous

        store = connect_store(config.rdzv_backend, config.rdzv_endpoint, config.rdzv_conf)
        settings = Settings.from_conf(config.min_nodes, config.max_nodes, config.rdzv_conf)
        return StoreRendezvous(
            store, config.rdzv_id, node, config.nproc_per_node, assigner, settings
        )
    raise UsageError(
        f"--nnodes {_nnodes(config)} with --rdzv-backend {config.rdzv_backend}: jobs of more "
        "than one node run on the c10d backend in this version; the "
        f"{config.rdzv_backend} backend runs jobs of one node (--nnodes 1)."
    )


def connect_store(
    backend: str, endpoint: str, conf: Mapping[str, Any], *, host: bool | None = None
) -> CoordinationStore:
    """A client of ``backend``'s coordination store (only ``c10d`` has one in this version).

    ``host`` overrides the backend's ``is_host`` setting (``False`` for a read-only view).
    """
    if backend != "c10d":
        raise UsageError(
            f"--rdzv-backend {backend}: has no coordination store in this version; use c10d."
        )
    from rallypoint.builtins.rendezvous import C10D_DEFAULT_PORT
    from rallypoint.rendezvous.tcpstore import TCPStoreClient

    address, port = parse_endpoint(endpoint or "localhost", C10D_DEFAULT_PORT)
    return TCPStoreClient(
        address,
        port,
        is_host=conf.get("is_host") if host is None else host,
        timeout=float(conf.get("read_timeout", 60.0)),
    )


def parse_endpoint(endpoint: str, default_port: int) -> tuple[str, int]:
    """``"host:port"`` (or ``"host"``) -> ``("host", port)``."""
    host, sep, port = endpoint.strip().rpartition(":")
    if not sep:
        return endpoint.strip(), default_port
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(f"--rdzv-endpoint {endpoint!r}: expected host:port.")
    return host.strip("[]"), int(port)


def _nnodes(config: LaunchConfig) -> str:
    if config.min_nodes == config.max_nodes:
        return str(config.max_nodes)
    return f"{config.min_nodes}:{config.max_nodes}"
