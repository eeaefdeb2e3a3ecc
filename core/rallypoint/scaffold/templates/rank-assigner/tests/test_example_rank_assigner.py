"""The tests of rallypoint-example-rank-assigner: rallypoint's conformance suite for a
rank assigner, and the registration rallypoint finds."""

from __future__ import annotations

import pytest
from rallypoint.sdk import RankAssigner
from rallypoint.testing.helpers import PluginManager, registered
from rallypoint.testing.rank_assigner_conformance import RankAssignerConformance

from rallypoint_example_rank_assigner.assigner import ASSIGNER


class TestConformance(RankAssignerConformance):
    @pytest.fixture
    def assigner(self) -> RankAssigner:
        return ASSIGNER


def test_rallypoint_runs_this_assigner(rallypoint_pm: PluginManager) -> None:
    assert registered(RankAssigner, "example-rank-assigner", rallypoint_pm) is ASSIGNER
