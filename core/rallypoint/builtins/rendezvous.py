"""Built-in rendezvous backends: ``static`` and ``c10d`` (torchrun's names and options).

``--standalone`` is ``c10d`` on a free local port with a random run id, as in torchrun.
"""

from __future__ import annotations

from rallypoint import hookimpl
from rallypoint.extensions import COMMON_RENDEZVOUS_OPTIONS, ConfigOption, RendezvousBackend

C10D_DEFAULT_PORT = 29400


@hookimpl
def register_rendezvous_backends() -> list[RendezvousBackend]:
    return [
        RendezvousBackend(
            name="static",
            description="fixed membership: every node passes --node-rank; no elasticity",
            options=(ConfigOption("join_timeout", float, 600.0, "seconds to wait for every node"),),
            endpoint_required=False,
        ),
        RendezvousBackend(
            name="c10d",
            description=f"TCPStore hosted by one agent (endpoint host:port, default port {C10D_DEFAULT_PORT})",
            options=(
                *COMMON_RENDEZVOUS_OPTIONS,
                ConfigOption("read_timeout", float, 60.0, "seconds to wait for one store read"),
                ConfigOption(
                    "is_host",
                    bool,
                    None,
                    "host the store here (default: if the endpoint is this host)",
                ),
            ),
            endpoint_required=False,
        ),
    ]
