"""Core's rendezvous protocol on a backend's store: the handler a request gets."""

from __future__ import annotations

from typing import Protocol, cast

from rallypoint.errors import UsageError
from rallypoint.extensions import RendezvousBackend, RendezvousRequest
from rallypoint.interfaces import CoordinationStore, RendezvousHandler


class InAgent(CoordinationStore, Protocol):
    """The store of a backend whose store lives in an agent's process and ends with it
    (``RendezvousBackend.store_in_agent``): it says whether this process hosts it."""

    hosting: bool


def protocol_handler(
    store: CoordinationStore,
    request: RendezvousRequest,
    master_addr: str | None = None,
    master_port: int | None = None,
    *,
    in_agent: bool = False,
) -> RendezvousHandler:
    """Core's rendezvous protocol over ``store``, for the node ``request`` describes.

    The workers' master address is group rank 0's host and a free port it holds, unless
    ``master_addr`` and ``master_port`` fix them. ``in_agent``: the backend's
    ``store_in_agent``; then ``store`` says whether this process hosts it (``InAgent``)."""
    from rallypoint.rendezvous.protocol import StoreRendezvous
    from rallypoint.rendezvous.settings import Settings

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
        offer=request.offer,
        pace=request.pace,
        waits=request.waits,
        ready=request.ready,
        token=request.token,
        host=cast(InAgent, store).hosting if in_agent else None,
    )


def connect(backend: RendezvousBackend, request: RendezvousRequest) -> CoordinationStore:
    """A client of ``backend``'s coordination store."""
    if backend.connect is None:
        raise UsageError(
            f"--rdzv-backend {backend.name}: has no coordination store to "
            f"{'inspect' if request.viewer else 'run the rendezvous protocol on'}."
        )
    return backend.connect(request)
