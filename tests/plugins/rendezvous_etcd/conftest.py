"""Fixtures of the etcd plugin's tests: the servers are in etcd_servers.py."""

from etcd_servers import (  # noqa: F401 - pytest finds fixtures by name
    auth_etcd,
    certificates,
    etcd_cluster,
    restartable_etcd,
    tls_etcd,
)
