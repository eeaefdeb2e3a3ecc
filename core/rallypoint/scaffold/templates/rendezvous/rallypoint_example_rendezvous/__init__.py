"""rallypoint-example-rendezvous: the ``example-rendezvous`` rendezvous backend.

Chosen with ``rallypoint run --rdzv-backend example-rendezvous``.
"""

from __future__ import annotations

from rallypoint.sdk import (
    COMMON_RENDEZVOUS_OPTIONS,
    DEFAULT_PREFIX,
    ConfigOption,
    CoordinationStore,
    RendezvousBackend,
    RendezvousRequest,
    hookimpl,
)


def connect(request: RendezvousRequest) -> CoordinationStore:
    # Imported here, only when a run uses this backend: so is your client library.
    from rallypoint_example_rendezvous.store import ExampleRendezvousStore

    return ExampleRendezvousStore(request.endpoint)


@hookimpl
def register_rendezvous_backends() -> list[RendezvousBackend]:
    return [
        RendezvousBackend(
            name="example-rendezvous",
            description="rendezvous through the example-rendezvous service",
            options=(
                *COMMON_RENDEZVOUS_OPTIONS,
                ConfigOption("prefix", str, DEFAULT_PREFIX, "key prefix; the run id is appended"),
            ),
            connect=connect,
        )
    ]
