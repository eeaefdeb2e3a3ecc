"""The c10d backend's store (torch's TCPStore) against the store conformance suite."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from rallypoint.rendezvous.tcpstore import TCPStoreClient
from rallypoint.testing.store_conformance import Connect, StoreConformance
from servers import free_port


class TestTCPStore(StoreConformance):
    @pytest.fixture
    def connect(self) -> Iterator[Connect]:
        port = free_port()
        host = TCPStoreClient("127.0.0.1", port, is_host=True, timeout=30)
        yield lambda: TCPStoreClient("127.0.0.1", port, is_host=False, timeout=30)
        host.close()
