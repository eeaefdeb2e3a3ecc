"""rallypoint-example-rank-assigner: the ``example-rank-assigner`` rank assigner.

Chosen with ``rallypoint run --rank-assigner example-rank-assigner``.
"""

from __future__ import annotations

from rallypoint.sdk import RankAssigner, hookimpl

from rallypoint_example_rank_assigner.assigner import ASSIGNER


@hookimpl
def register_rank_assigners() -> list[RankAssigner]:
    return [ASSIGNER]
