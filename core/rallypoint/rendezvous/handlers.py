"""Choosing the rendezvous handler for a launch configuration."""

from __future__ import annotations

from rallypoint.config import LaunchConfig
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
        static_port = config.master_port if config.rdzv_backend == "static" else None
        return LocalRendezvous(node, config.nproc_per_node, assigner, master_port=static_port)
    raise UsageError(
        f"--nnodes {config.min_nodes}:{config.max_nodes}: jobs of more than one node need the "
        "multi-node rendezvous, which this version does not have yet; use --nnodes 1 or "
        "--standalone."
    )
