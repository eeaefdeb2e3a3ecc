"""Choosing the rendezvous handler for a launch configuration."""

from __future__ import annotations

from rallypoint.config import DEFAULT_MASTER_PORT, LaunchConfig
from rallypoint.errors import UsageError
from rallypoint.extensions import NodeSpec
from rallypoint.registry import RANK_ASSIGNERS, Registry
from rallypoint.rendezvous.handler import RendezvousHandler
from rallypoint.rendezvous.local import LocalRendezvous


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
    raise UsageError(
        f"--nnodes {_nnodes(config)}: jobs of more than one node need the multi-node "
        "rendezvous, which this version does not have yet; run on one node (--nnodes 1)."
    )


def _nnodes(config: LaunchConfig) -> str:
    if config.min_nodes == config.max_nodes:
        return str(config.max_nodes)
    return f"{config.min_nodes}:{config.max_nodes}"
