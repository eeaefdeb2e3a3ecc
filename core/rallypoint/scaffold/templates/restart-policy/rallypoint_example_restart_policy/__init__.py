"""rallypoint-example-restart-policy: the ``example-restart-policy`` restart policy.

Chosen with ``rallypoint run --restart-policy example-restart-policy``.
"""

from __future__ import annotations

from rallypoint.sdk import RestartPolicy, hookimpl

from rallypoint_example_restart_policy.policy import POLICY


@hookimpl
def register_restart_policies() -> list[RestartPolicy]:
    return [POLICY]
