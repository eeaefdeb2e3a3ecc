"""Which Redis a job uses and how to reach it: ``--rdzv-endpoint`` and the ``--rdzv-conf``
options as a ``Target`` (standalone, TLS, or a Sentinel master), checked before anything
connects."""

from __future__ import annotations

import inspect
import os
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from rallypoint.sdk import RendezvousRequest, UsageError, parse_endpoint, redact_endpoint

DEFAULT_PORT = 6379
DEFAULT_SENTINEL_PORT = 26379
#: The least time to wait for a reply (``connect_timeout`` bounds connecting only).
READ_TIMEOUT_FLOOR = 10.0

# No CLIENT SETINFO on connect: two round trips fewer for every new connection
# (redis-py >= 7 takes driver_info=None; older ones lib_name and lib_version).
_NO_CLIENT_SETINFO: dict[str, Any] = (
    {"driver_info": None}
    if "driver_info" in inspect.signature(redis.Redis.__init__).parameters
    else {"lib_name": None, "lib_version": None}
)


@dataclass(frozen=True)
class Target:
    """How to reach one Redis deployment; ``client()`` opens a new connection pool."""

    describe: str  # "Redis at 127.0.0.1:6379", for messages
    client: Callable[[], Any]  # a redis.Redis; redis-py's own annotations are partial
    socket_timeout: float
    user: str | None = None
    tls: bool = False
    options: dict[str, Any] = field(default_factory=dict)


def target_for(request: RendezvousRequest) -> Target:
    """Parse ``--rdzv-endpoint`` and the ``--rdzv-conf`` options into a ``Target``.

    Endpoints: ``host[:port]``, ``redis://[user[:password]@]host[:port][/db]``,
    ``rediss://...`` (TLS) and ``sentinel://host[:port][,host[:port]...][/db]`` (with the
    ``sentinel_master`` option). ``--rdzv-conf`` values override what the URL says.
    """
    options = dict(request.options)
    endpoint = request.endpoint.strip()
    if not endpoint:
        raise UsageError("--rdzv-backend redis: give --rdzv-endpoint host:port or a redis:// URL.")
    shown = redact_endpoint(endpoint)  # what messages show: never the URL's password
    scheme, _, rest = endpoint.partition("://") if "://" in endpoint else ("", "", endpoint)
    scheme = scheme.lower()
    if scheme not in ("", "redis", "rediss", "sentinel"):
        raise UsageError(
            f"--rdzv-endpoint {shown!r}: unsupported scheme {scheme!r}; use host:port, "
            "redis://, rediss:// or sentinel://."
        )
    if not scheme and "@" in rest:
        raise UsageError(
            f"--rdzv-endpoint {shown!r}: a user name or password needs a redis:// URL "
            "(user:password@ after redis://), or --rdzv-conf username and password keys."
        )
    url_user = url_password = None
    url_db: int | None = None
    if scheme:
        try:
            parsed = urllib.parse.urlsplit(endpoint)
        except ValueError as error:  # "Invalid IPv6 URL", say
            raise UsageError(f"--rdzv-endpoint {shown!r}: {error}.") from None
        if parsed.query or parsed.fragment:
            raise UsageError(
                f"--rdzv-endpoint {shown!r}: give settings with --rdzv-conf, not in the URL."
            )
        url_user = urllib.parse.unquote(parsed.username) if parsed.username else None
        url_password = urllib.parse.unquote(parsed.password) if parsed.password else None
        db_text = parsed.path.strip("/")
        if db_text:
            if not (db_text.isascii() and db_text.isdigit()):
                raise UsageError(f"--rdzv-endpoint {shown!r}: the path must be a database number.")
            url_db = int(db_text)
        rest = parsed.netloc.rpartition("@")[2]
    username = options.get("username") or url_user
    password = options.get("password") or url_password or os.environ.get("REDIS_PASSWORD")
    db = url_db if url_db is not None and not options["db"] else int(options["db"])
    timeout = float(options["connect_timeout"])
    # Replies get longer than connects: a reply that times out leaves the command's fate
    # unknown (a paused server runs it when it resumes), so a retried add would count twice.
    read_timeout = max(timeout, READ_TIMEOUT_FLOOR)
    tls_files = {
        "ssl_ca_certs": options.get("ssl_ca_certs"),
        "ssl_certfile": options.get("ssl_certfile"),
        "ssl_keyfile": options.get("ssl_keyfile"),
    }
    for name, path in tls_files.items():
        if path and not os.path.isfile(path):
            # A private key's path stays private.
            shown = "" if name == "ssl_keyfile" else f"={path}"
            raise UsageError(f"--rdzv-conf {name}{shown}: no such file.")
    tls = scheme == "rediss" or any(tls_files.values())
    connection: dict[str, Any] = {
        "username": username,
        "password": password,
        "db": db,
        "socket_connect_timeout": timeout,
        "socket_timeout": read_timeout,
        "socket_keepalive": True,
        "retry": _no_retry(),
        "protocol": 2,
        **_NO_CLIENT_SETINFO,
    }
    if tls:
        connection["ssl"] = True
        connection.update({name: path for name, path in tls_files.items() if path})
    if scheme == "sentinel":
        return _sentinel_target(rest, endpoint, options, connection, timeout, tls)
    host, port = parse_endpoint(rest, DEFAULT_PORT)
    if not host:
        raise UsageError(f"--rdzv-endpoint {shown!r}: expected host:port.")
    describe = f"Redis at {host}:{port}" + (f" (db {db})" if db else "")
    return Target(
        describe,
        lambda: redis.Redis(host=host, port=port, **connection),
        read_timeout,
        user=username,
        tls=tls,
        options=options,
    )


def _no_retry() -> Any:
    """redis-py's setting for a client that does not retry: the protocol retries, with its
    own backoff. Called as Any: redis-py types these classes in some releases, not all."""
    retry: Any = Retry
    backoff: Any = NoBackoff
    return retry(backoff(), 0)


def _sentinel_target(
    hosts: str,
    endpoint: str,
    options: dict[str, Any],
    connection: dict[str, Any],
    timeout: float,
    tls: bool,
) -> Target:
    from redis.sentinel import Sentinel

    master = options.get("sentinel_master")
    if not master:
        raise UsageError(
            f"--rdzv-endpoint {redact_endpoint(endpoint)!r}: name the master the sentinels "
            "watch with --rdzv-conf sentinel_master=NAME."
        )
    sentinels = [parse_endpoint(item, DEFAULT_SENTINEL_PORT) for item in hosts.split(",") if item]
    if not sentinels or not all(host for host, _ in sentinels):
        raise UsageError(
            f"--rdzv-endpoint {redact_endpoint(endpoint)!r}: expected sentinel://host:port[,...]."
        )
    sentinel_settings = {
        "socket_connect_timeout": timeout,
        "socket_timeout": timeout,
        "retry": _no_retry(),
        "protocol": 2,
    }
    if tls:
        sentinel_settings.update({k: v for k, v in connection.items() if k.startswith("ssl")})

    sentinel: Any = Sentinel  # typed from redis-py 8.2 on, untyped before

    def client() -> Any:
        manager = sentinel(sentinels, sentinel_kwargs=sentinel_settings, **connection)
        return manager.master_for(str(master))

    listed = ",".join(f"{host}:{port}" for host, port in sentinels)
    return Target(
        f"Redis master {master!r} (sentinels {listed})",
        client,
        float(connection["socket_timeout"]),
        user=connection.get("username"),
        tls=tls,
        options=options,
    )
