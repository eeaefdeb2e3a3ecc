"""The tests of rallypoint-example-rendezvous: rallypoint's conformance suite for a
rendezvous backend, and the registration rallypoint finds.

Point ``connect`` at a real server of your service, started by a fixture on a free port
(and give ``outage`` to check that agents ride out a restart of it)."""

from __future__ import annotations

import pytest
from rallypoint.sdk import RendezvousBackend
from rallypoint.testing.helpers import PluginManager, registered
from rallypoint.testing.store_conformance import Connect, StoreConformance

import rallypoint_example_rendezvous
from rallypoint_example_rendezvous.store import ExampleRendezvousStore


class TestConformance(StoreConformance):
    @pytest.fixture
    def connect(self) -> Connect:
        store = ExampleRendezvousStore("localhost:1234")
        return store.clone


def test_rallypoint_connects_with_this_backend(rallypoint_pm: PluginManager) -> None:
    backend = registered(RendezvousBackend, "example-rendezvous", rallypoint_pm)
    assert backend.connect is rallypoint_example_rendezvous.connect
