"""rallypoint-etcd: the ``etcd`` rendezvous backend, on etcd's v3 API.

Registering is all this module does at import time; the etcd client is imported only when
a run uses the backend, so an installed plugin costs the CLI nothing.
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
    UsageError,
    check_liveness_ttl,
    hookimpl,
    liveness_ttl,
    redact_endpoint,
)

__version__ = "0.1.0"

OPTIONS: tuple[ConfigOption, ...] = (
    *COMMON_RENDEZVOUS_OPTIONS,
    ConfigOption("prefix", str, "/rallypoint", "key prefix; the run id is appended"),
    ConfigOption(
        "lease_ttl",
        float,
        None,
        "seconds a dead agent's lease outlives it (default: 2/3 of heartbeat_timeout)",
        minimum=0,
        exclusive_minimum=True,
    ),
    ConfigOption(
        "connect_timeout",
        float,
        5.0,
        "seconds to reach an endpoint",
        minimum=0,
        exclusive_minimum=True,
    ),
    ConfigOption(
        "protocol",
        str,
        None,
        "https: TLS for endpoints given without a scheme (torch's key)",
        choices=("http", "https"),
    ),
    ConfigOption("ca_cert", str, None, "CA certificate file for TLS"),
    ConfigOption("cert", str, None, "client certificate file for TLS"),
    # Secret: a private key's path is not for logs and error messages either.
    ConfigOption("key", str, None, "client key file for TLS", secret=True),
    ConfigOption("user", str, None, "user name for etcd authentication"),
    ConfigOption("password", str, None, "password for etcd authentication", secret=True),
)


#: torch's etcd keys (its etcd and etcd-v2 backends) that have another name here.
TORCH_KEYS = {
    "etcd_prefix": "prefix",
    "cacert": "ca_cert",
    "ssl_cert": "cert",
    "ssl_cert_key": "key",
}


def connect(request: RendezvousRequest) -> CoordinationStore:
    """A client of the etcd cluster at ``request.endpoint``, checked within connect_timeout."""
    from rallypoint_etcd.config import EtcdConfig, parse_endpoints
    from rallypoint_etcd.store import EtcdStore

    options = request.options
    try:
        endpoints, tls = parse_endpoints(request.endpoint, options.get("protocol"))
    except ValueError as error:
        shown = redact_endpoint(request.endpoint)
        raise UsageError(f"--rdzv-endpoint {shown!r}: {error}.") from None
    connect_timeout = float(options["connect_timeout"])
    config = EtcdConfig(
        endpoints=endpoints,
        tls=tls,
        ca_cert=options.get("ca_cert"),
        cert=options.get("cert"),
        key=options.get("key"),
        user=options.get("user"),
        password=options.get("password"),
        connect_timeout=connect_timeout,
        # A request may take longer than a connection: etcd under load, a leader election.
        request_timeout=max(10.0, 2 * connect_timeout),
        lease_ttl=liveness_ttl(options, "lease_ttl"),
    )
    prefix = str(options["prefix"]).rstrip("/")
    return EtcdStore(config, probe_key=f"{prefix}/{request.run_id}/state")


def validate(options: Mapping[str, Any]) -> None:
    """Checks across the options, when the flags are parsed."""
    check_liveness_ttl(options, "lease_ttl")
    if (options["user"] is None) != (options["password"] is None):
        raise ValueError("user and password: give both, or neither.")


@hookimpl
def register_rendezvous_backends() -> list[RendezvousBackend]:
    return [
        RendezvousBackend(
            name="etcd",
            description="etcd v3: leases for liveness, watches for waiting (host:port[,host:port])",
            options=OPTIONS,
            connect=connect,
            torch_keys=TORCH_KEYS,
            validate=validate,
        )
    ]
