"""The tests of rallypoint-example-restart-policy: rallypoint's conformance suite for a
restart policy, and the registration rallypoint finds."""

from __future__ import annotations

import pytest
from rallypoint.sdk import RestartPolicy
from rallypoint.testing.helpers import PluginManager, registered
from rallypoint.testing.restart_policy_conformance import RestartPolicyConformance

from rallypoint_example_restart_policy.policy import POLICY


class TestConformance(RestartPolicyConformance):
    @pytest.fixture
    def policy(self) -> RestartPolicy:
        return POLICY


def test_rallypoint_runs_this_policy(rallypoint_pm: PluginManager) -> None:
    assert registered(RestartPolicy, "example-restart-policy", rallypoint_pm) is POLICY
