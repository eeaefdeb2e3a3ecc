"""The tests of rallypoint-example-checkpoint-backend: rallypoint's conformance suite for a
checkpoint backend, and the registration rallypoint finds."""

from __future__ import annotations

from pathlib import Path

import pytest
from rallypoint.testing.checkpoint_storage_conformance import (
    CheckpointStorageConformance,
    OpenStorage,
)
from rallypoint.testing.helpers import PluginManager, checkpoint_backend_for

from rallypoint_example_checkpoint_backend.storage import ExampleCheckpointBackendStorage


class TestConformance(CheckpointStorageConformance):
    @pytest.fixture
    def open_storage(self, tmp_path: Path) -> OpenStorage:
        return lambda: ExampleCheckpointBackendStorage(f"examplefs://{tmp_path}/checkpoints")


def test_rallypoint_opens_its_scheme_with_it(rallypoint_pm: PluginManager) -> None:
    backend = checkpoint_backend_for("examplefs:///checkpoints", rallypoint_pm)
    assert backend.name == "example-checkpoint-backend"
