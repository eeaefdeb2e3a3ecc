"""Shared fixtures: real servers (tests/servers.py) and a fresh plugin manager per test."""

from __future__ import annotations

from servers import (  # noqa: F401 - pytest finds fixtures by name
    etcd_server,
    etcd_server_session,
    prometheus_server,
    prometheus_server_session,
    redis_server,
    redis_server_session,
)
