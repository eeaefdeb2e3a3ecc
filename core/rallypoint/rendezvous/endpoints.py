"""Addresses: parsing ``--rdzv-endpoint``, and how the other nodes reach this one."""

from __future__ import annotations

import socket

from rallypoint.errors import UsageError
from rallypoint.redact import redact_endpoint


def parse_endpoint(endpoint: str, default_port: int) -> tuple[str, int]:
    """``"host:port"`` (or ``"host"``) -> ``("host", port)``."""
    if "@" in endpoint:  # no host name has one: credentials, which a store here never takes
        raise UsageError(
            f"--rdzv-endpoint {redact_endpoint(endpoint)!r}: expected host:port, "
            "without a user name or password."
        )
    host, sep, port = endpoint.strip().rpartition(":")
    if not sep:
        return endpoint.strip(), default_port
    if not port.isdigit() or not 0 < int(port) < 65536:
        shown = redact_endpoint(endpoint)  # "user:password@host:port" happens
        raise UsageError(f"--rdzv-endpoint {shown!r}: expected host:port.")
    return host.strip("[]"), int(port)


def node_address(local_addr: str | None, max_nodes: int) -> str:
    """How the other nodes reach this one: ``--local-addr``, else, as torchrun, this host's
    fully qualified name, or its plain name where that is the one that resolves (a
    ``localhost`` alias reaches no other host). Checked only when other nodes may need it.

    Raises:
        UsageError: neither name resolves: one sentence naming ``--local-addr``.
    """
    if local_addr:
        return local_addr
    hostname = socket.gethostname()
    if max_nodes == 1:
        return hostname
    names = [name for name in dict.fromkeys((socket.getfqdn(), hostname)) if name]
    resolved = [name for name in names if _resolves(name)]
    if not resolved:
        raise UsageError(
            f"this host's name {hostname!r} does not resolve to an address (nor does "
            f"{' or '.join(repr(n) for n in names if n != hostname) or 'its full name'}), "
            "so other nodes could not reach it: give --local-addr with an address they can "
            "reach."
        )
    named = [name for name in resolved if not name.startswith("localhost")]
    return (named or resolved)[0]


def _resolves(name: str) -> bool:
    try:
        return bool(socket.getaddrinfo(name, None))
    except (OSError, UnicodeError):
        return False
