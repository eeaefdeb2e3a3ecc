"""Built-in rendezvous backends: ``static`` and ``c10d`` (torchrun's names and options).

Both run core's rendezvous protocol on a torch TCPStore hosted by one of the agents:

* ``c10d``: the store is at ``--rdzv-endpoint`` (default port 29400), hosted by the agent
  on that host (or the one told ``is_host=true``); membership is elastic.
* ``static``: the store is at ``--master-addr:--master-port`` (default 29500), hosted by
  ``--node-rank 0``; membership is fixed, group ranks are the node ranks given, and a job
  of N nodes only runs when all N are there.

``--standalone`` and any job of one node run the same protocol on a store in the agent's
memory (``agent.rendezvous_handler.create_handler``).
"""

from __future__ import annotations

from collections.abc import Sequence

from rallypoint import hookimpl
from rallypoint.config import DEFAULT_MASTER_PORT
from rallypoint.errors import UsageError
from rallypoint.extensions import (
    COMMON_RENDEZVOUS_OPTIONS,
    DEFAULT_PREFIX,
    ConfigOption,
    NodeSpec,
    RankAssigner,
    RendezvousBackend,
    RendezvousRequest,
)
from rallypoint.interfaces import CoordinationStore, RendezvousHandler

C10D_DEFAULT_PORT = 29400
#: The label that carries a static node's ``--node-rank`` into the round.
NODE_RANK_LABEL = "rallypoint.node_rank"

_TCPSTORE_OPTIONS = (
    ConfigOption(
        "read_timeout",
        float,
        60.0,
        "seconds to wait for one store read",
        minimum=0,
        exclusive_minimum=True,
    ),
    ConfigOption(
        "is_host", bool, None, "host the store here (default: if the endpoint is this host)"
    ),
    # torch's c10d also offers a FileStore; a rendezvous across hosts needs the TCPStore.
    ConfigOption(
        "store_type", str, "tcp", "the store: tcp (a TCPStore), torch's key", choices=("tcp",)
    ),
)


def connect_c10d(request: RendezvousRequest) -> CoordinationStore:
    from rallypoint.rendezvous.endpoints import parse_endpoint

    host, port = parse_endpoint(request.endpoint or "localhost", C10D_DEFAULT_PORT)
    return _tcpstore(request, host, port, request.options.get("is_host"), "--rdzv-endpoint")


def connect_static(request: RendezvousRequest) -> CoordinationStore:
    from rallypoint.rendezvous.endpoints import parse_endpoint

    default_port = request.master_port or DEFAULT_MASTER_PORT
    if request.endpoint:  # `rallypoint rendezvous status` names the store this way
        host, port = parse_endpoint(request.endpoint, default_port)
        flag = "--rdzv-endpoint"
    else:
        host, port = request.master_addr, default_port
        flag = "--master-port"
    is_host = request.options.get("is_host")
    is_host = request.node_rank == 0 if is_host is None else is_host
    return _tcpstore(request, host, port, is_host, flag)


def _tcpstore(
    request: RendezvousRequest, host: str, port: int, is_host: bool | None, flag: str
) -> CoordinationStore:
    from rallypoint.rendezvous.keys import Keys
    from rallypoint.rendezvous.tcpstore import HostMark, TCPStoreClient

    if request.viewer:
        return TCPStoreClient(
            host, port, is_host=False, timeout=float(request.options["read_timeout"])
        )
    # The agent that hosts marks the store as this job's: one that was to host it but
    # finds the port taken joins only a store so marked (``HostMark``).
    keys = Keys(str(request.options.get("prefix") or DEFAULT_PREFIX), request.run_id)
    mark = HostMark(keys.host_key, request.node.node_id, request.token, flag)
    return TCPStoreClient(
        host, port, is_host=is_host, timeout=float(request.options["read_timeout"]), mark=mark
    )


def static_handler(request: RendezvousRequest) -> RendezvousHandler:
    """The protocol with fixed membership: MIN = MAX = --nnodes, ranks = node ranks."""
    from rallypoint.rendezvous.store_handler import protocol_handler

    node = request.node
    labels = {**node.labels, NODE_RANK_LABEL: str(request.node_rank)}
    fixed = RendezvousRequest(
        **{
            **vars(request),
            "node": NodeSpec(node.node_id, node.host, labels, node.previous_rank),
            "rank_assigner": RankAssigner("node-rank", "the --node-rank given", by_node_rank),
        }
    )
    return protocol_handler(
        connect_static(fixed), fixed, master_addr=request.master_addr, in_agent=True
    )


def by_node_rank(nodes: Sequence[NodeSpec]) -> list[int]:
    """Each node's ``--node-rank``; two nodes with the same one are a clear error."""
    ranks = [int(node.labels[NODE_RANK_LABEL]) for node in nodes]
    for rank in set(ranks):
        hosts = [n.host for n, r in zip(nodes, ranks, strict=True) if r == rank]
        if len(hosts) > 1:
            raise UsageError(
                f"--node-rank {rank} was given to {len(hosts)} nodes ({', '.join(hosts)}); "
                "give each node of a static job its own --node-rank"
            )
    return ranks


@hookimpl
def register_rendezvous_backends() -> list[RendezvousBackend]:
    return [
        RendezvousBackend(
            name="static",
            description="fixed membership: every node passes --node-rank; no elasticity",
            options=(*COMMON_RENDEZVOUS_OPTIONS, *_TCPSTORE_OPTIONS),
            endpoint_required=False,
            connect=connect_static,
            create_handler=static_handler,
            given_ranks=True,
            store_in_agent=True,
        ),
        RendezvousBackend(
            name="c10d",
            description=(
                "TCPStore hosted by one agent "
                f"(endpoint host:port, default port {C10D_DEFAULT_PORT})"
            ),
            options=(*COMMON_RENDEZVOUS_OPTIONS, *_TCPSTORE_OPTIONS),
            endpoint_required=False,
            connect=connect_c10d,
            store_in_agent=True,
        ),
    ]
