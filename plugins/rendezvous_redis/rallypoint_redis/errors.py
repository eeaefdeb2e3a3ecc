"""redis-py's errors as one sentence each, saying which server and what to do."""

from __future__ import annotations

import ssl

import redis

from rallypoint.sdk import StoreError, StoreUnavailable
from rallypoint_redis.target import Target


def translate(error: redis.RedisError, target: Target) -> StoreError:
    """One sentence for ``error``: ``StoreUnavailable`` when retrying may help."""
    where = target.describe
    if isinstance(error, (redis.AuthenticationError, redis.AuthenticationWrongNumberOfArgsError)):
        who = f"user {target.user!r}" if target.user else "the default user"
        message = _first_line(error)
        # redis-py drops the error code; name it, it is what the server's docs list.
        code = "NOAUTH" if "required" in message.lower() else "WRONGPASS"
        return StoreError(
            f"{where} refused authentication for {who} ({code} {message}); give the "
            "right username and password (--rdzv-conf username=..., password or "
            "$REDIS_PASSWORD)"
        )
    tls = _tls_failure(error)
    if tls is not None:
        return StoreError(
            f"TLS with {where} failed ({tls}); check ssl_ca_certs, ssl_certfile and "
            "ssl_keyfile, or use a redis:// endpoint if the server does not speak TLS"
        )
    if isinstance(error, redis.exceptions.NoPermissionError):
        return StoreError(
            f"{where}: the ACL user may not do this ({_first_line(error)}); it needs the "
            "rendezvous prefix's keys and channels (~PREFIX* &PREFIX*) and the commands "
            "+@read +@write +@scripting +@pubsub +ping"
        )
    message = _first_line(error)
    if isinstance(error, (redis.ConnectionError, redis.TimeoutError)) or message.startswith(
        ("READONLY", "MASTERDOWN", "LOADING", "TRYAGAIN")
    ):
        return StoreUnavailable(f"cannot reach {where} ({message})")
    if isinstance(error, redis.exceptions.OutOfMemoryError):
        return StoreError(
            f"{where} is out of memory (maxmemory) and refuses writes; free memory or raise "
            "its maxmemory"
        )
    return StoreError(f"{where} failed: {message}")


def _first_line(error: BaseException) -> str:
    text = str(error).strip() or type(error).__name__
    return text.splitlines()[0].rstrip(".")


def _tls_failure(error: BaseException) -> str | None:
    seen: BaseException | None = error
    for _ in range(5):
        if seen is None:
            return None
        if isinstance(seen, ssl.SSLError):
            reason = getattr(seen, "reason", None) or _first_line(seen)
            detail = getattr(seen, "verify_message", None)
            return f"{reason}: {detail}" if detail else str(reason)
        seen = seen.__cause__ or seen.__context__
    return None
