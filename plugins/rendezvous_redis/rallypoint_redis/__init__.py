"""rallypoint-redis: the ``redis`` rendezvous backend.

Registering is all this module does at import time; redis-py is imported only when a run
uses the backend, so an installed plugin costs the CLI nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rallypoint.sdk import (
    COMMON_RENDEZVOUS_OPTIONS,
    ConfigOption,
    CoordinationStore,
    RendezvousBackend,
    RendezvousRequest,
    check_liveness_ttl,
    hookimpl,
)

__version__ = "0.1.0"

OPTIONS: tuple[ConfigOption, ...] = (
    *COMMON_RENDEZVOUS_OPTIONS,
    ConfigOption("prefix", str, "rallypoint", "key prefix; the run id is appended"),
    ConfigOption(
        "key_ttl",
        float,
        None,
        "seconds a dead agent's liveness key outlives it (default: 2/3 of heartbeat_timeout)",
        minimum=0,
        exclusive_minimum=True,
    ),
    ConfigOption(
        "connect_timeout",
        float,
        5.0,
        "seconds to reach the server",
        minimum=0,
        exclusive_minimum=True,
    ),
    ConfigOption("db", int, 0, "database number", minimum=0),
    ConfigOption("username", str, None, "ACL user name"),
    ConfigOption("password", str, None, "password (default: $REDIS_PASSWORD)", secret=True),
    ConfigOption("ssl_ca_certs", str, None, "CA certificate file for TLS"),
    ConfigOption("ssl_certfile", str, None, "client certificate file for TLS"),
    # Secret: a private key's path is not for logs and error messages either.
    ConfigOption("ssl_keyfile", str, None, "client key file for TLS", secret=True),
    ConfigOption("sentinel_master", str, None, "master name, with sentinel:// endpoints"),
)


def connect(request: RendezvousRequest) -> CoordinationStore:
    """A client of the Redis that ``--rdzv-endpoint`` names (redis-py loads here)."""
    from rallypoint_redis.store import connect_store

    return connect_store(request)


def validate(options: Mapping[str, Any]) -> None:
    """Checks across the options, when the flags are parsed."""
    check_liveness_ttl(options, "key_ttl")


@hookimpl
def register_rendezvous_backends() -> list[RendezvousBackend]:
    return [
        RendezvousBackend(
            name="redis",
            description="Redis: key TTLs for liveness, blocking calls for waiting (host:port or URL)",
            options=OPTIONS,
            connect=connect,
            validate=validate,
        )
    ]
