"""rallypoint-example: a worked third-party plugin for rallypoint.

It registers two things:

* the ``failure-window`` restart policy: restart like ``max-restarts``, but give up on this
  node when its workers failed ``max_failures`` times within ``window`` seconds (a node
  that keeps crashing is broken; restarting it again only burns the restart budget);
* the ``topology-file`` rank assigner: neighbours in the cluster's network, as a topology
  file lists them, get neighbouring group ranks.

Only the standard library is imported: the plugin costs every ``rallypoint`` command
nothing.
"""

from __future__ import annotations

from rallypoint.sdk import RankAssigner, RestartPolicy, hookimpl
from rallypoint_example.policy import POLICY
from rallypoint_example.topology import ASSIGNER

__version__ = "0.1.0"


@hookimpl
def register_restart_policies() -> list[RestartPolicy]:
    return [POLICY]


@hookimpl
def register_rank_assigners() -> list[RankAssigner]:
    return [ASSIGNER]
