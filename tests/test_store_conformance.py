"""The built-in stores against the store conformance suite: torch's TCPStore (the c10d and
static backends) and the in-memory store of one-node jobs."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from rallypoint.rendezvous.memory import MemoryStore
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


class TestMemoryStore(StoreConformance):
    @pytest.fixture
    def connect(self) -> Connect:
        store = MemoryStore()
        return store.clone
