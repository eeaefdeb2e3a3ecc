"""Fixtures of the etcd plugin's tests: the servers are in etcd_servers.py, built on
tests/servers.py of the repository (on the path through pytest's ``pythonpath``)."""

from etcd_servers import (  # noqa: F401 - pytest finds fixtures by name
    auth_etcd,
    certificates,
    etcd_cluster,
    restartable_etcd,
    tls_etcd,
)

from servers import etcd_server, etcd_server_session  # noqa: F401 - found by name
