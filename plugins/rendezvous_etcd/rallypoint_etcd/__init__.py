"""rallypoint-etcd: the ``etcd`` rendezvous backend, on etcd's v3 API.

Registering is all this module does at import time; the etcd client is imported only when
a run uses the backend, so an installed plugin costs the CLI nothing.
"""

from __future__ import annotations

from rallypoint import hookimpl
from rallypoint.extensions import COMMON_RENDEZVOUS_OPTIONS, ConfigOption, RendezvousBackend

__version__ = "0.1.0"

OPTIONS: tuple[ConfigOption, ...] = (
    *COMMON_RENDEZVOUS_OPTIONS,
    ConfigOption("prefix", str, "/rallypoint", "key prefix; the run id is appended"),
    ConfigOption("lease_ttl", float, 10.0, "seconds a dead agent's keys outlive it"),
    ConfigOption("connect_timeout", float, 5.0, "seconds to reach an endpoint"),
    ConfigOption("ca_cert", str, None, "CA certificate file for TLS"),
    ConfigOption("cert", str, None, "client certificate file for TLS"),
    ConfigOption("key", str, None, "client key file for TLS"),
    ConfigOption("user", str, None, "user name for etcd authentication"),
    ConfigOption("password", str, None, "password for etcd authentication", secret=True),
)


@hookimpl
def register_rendezvous_backends() -> list[RendezvousBackend]:
    return [
        RendezvousBackend(
            name="etcd",
            description="etcd v3: leases for liveness, watches for waiting (host:port[,host:port])",
            options=OPTIONS,
        )
    ]
