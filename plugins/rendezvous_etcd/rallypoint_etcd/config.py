"""Where etcd is and how to talk to it: ``EtcdConfig``, and the endpoints of
``--rdzv-endpoint`` parsed as etcdctl takes them."""

from __future__ import annotations

from dataclasses import dataclass

from rallypoint.sdk import redact_endpoint

DEFAULT_PORT = 2379


@dataclass(frozen=True)
class EtcdConfig:
    """Where etcd is and how to talk to it."""

    endpoints: tuple[tuple[str, int], ...]
    tls: bool = False
    ca_cert: str | None = None
    cert: str | None = None
    key: str | None = None
    user: str | None = None
    password: str | None = None
    connect_timeout: float = 5.0
    request_timeout: float = 10.0
    lease_ttl: float | None = None

    @property
    def names(self) -> str:
        return ", ".join(f"{host}:{port}" for host, port in self.endpoints)


def parse_endpoints(
    text: str, protocol: str | None = None
) -> tuple[tuple[tuple[str, int], ...], bool]:
    """``host:port[,host:port...]`` -> the endpoints, and whether a scheme asked for TLS.

    Each endpoint may be ``host``, ``host:port``, ``[v6]:port``, or any of these after
    ``http://`` or ``https://`` (etcdctl's form); the port defaults to 2379. ``protocol``
    (torch's ``--rdzv-conf protocol``) is the scheme of endpoints given without one.
    """
    endpoints: list[tuple[str, int]] = []
    schemes: set[str] = set()
    for raw in text.split(","):
        item = raw.strip()
        if not item:
            continue
        if "@" in item:  # a URL's user:password@ (etcdctl takes them as flags, so do we)
            raise ValueError(
                f"{redact_endpoint(item)!r}: give the user and password with --rdzv-conf "
                "user=...,password=..., not in the endpoint"
            )
        scheme, sep, rest = item.partition("://")
        if sep:
            if scheme not in ("http", "https"):
                raise ValueError(f"{item!r}: the scheme must be http:// or https://")
            schemes.add(scheme)
            item = rest.rstrip("/")
        host, port = item, DEFAULT_PORT
        if item.startswith("["):  # [v6] or [v6]:port
            host, _, after = item[1:].partition("]")
            if after:
                if not after.startswith(":") or not after[1:].isdigit():
                    raise ValueError(f"{raw.strip()!r}: expected [address]:port")
                port = int(after[1:])
        elif item.count(":") == 1:
            host, _, digits = item.partition(":")
            if not digits.isdigit():
                raise ValueError(f"{raw.strip()!r}: expected host:port")
            port = int(digits)
        if not host or not 0 < port < 65536:
            raise ValueError(f"{raw.strip()!r}: expected host:port")
        endpoints.append((host, port))
    if not endpoints:
        raise ValueError("no endpoint given; expected host:port[,host:port...]")
    if protocol and schemes - {protocol}:
        raise ValueError(f"its scheme is not --rdzv-conf protocol={protocol}")
    if len(schemes) > 1:
        raise ValueError("mixes http:// and https:// endpoints; one cluster uses one or the other")
    return tuple(endpoints), (schemes or {protocol or "http"}) == {"https"}
