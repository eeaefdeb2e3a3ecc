"""The built-in stores against the store conformance suite: torch's TCPStore (the c10d and
static backends) and the in-memory store of one-node jobs."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from rallypoint.rendezvous.memory_store import MemoryStore
from rallypoint.rendezvous.tcpstore import TCPStoreClient
from rallypoint.testing.store_conformance import Connect, StoreConformance
from servers import free_port


class TestTCPStore(StoreConformance):
    store_in_agent = True

    @pytest.fixture
    def connect(self) -> Iterator[Connect]:
        port = free_port()
        host = TCPStoreClient("127.0.0.1", port, is_host=True, timeout=30)
        yield lambda: TCPStoreClient("127.0.0.1", port, is_host=False, timeout=30)
        host.close()

    # TCPStore cannot list its keys: a client deletes those it (or a clone) wrote. The
    # protocol deletes nothing there: the store ends with the agent that hosts it.
    @pytest.mark.skip(reason="TCPStore cannot list keys: a client deletes only its own")
    def test_delete_prefix_deletes_what_other_connections_wrote(self) -> None: ...

    @pytest.mark.skip(reason="a TCPStore ends with the agent hosting it: nothing to delete")
    def test_a_job_that_finished_cleanly_leaves_no_key(self) -> None: ...


class TestMemoryStore(StoreConformance):
    @pytest.fixture
    def connect(self) -> Connect:
        store = MemoryStore()
        return store.clone
