"""The account as a terminal shows it (``rallypoint report``), and the sentences the HTML
page shares with it."""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from typing import Any

from rallypoint.goodput.account import Account
from rallypoint.goodput.fields import real
from rallypoint.goodput.phases import TRAINING

#: What a report says of a job whose workers reported no steps.
NO_STEPS = (
    "the workers reported no steps (rallypoint.progress(step=...), a checkpoint save, the "
    "ElasticSampler or rallypoint.metrics.step): steps redone after a restart count as training"
)


def summary(account: Account) -> str:
    """The report a terminal shows: goodput, time per phase, failures and recoveries."""
    lines = []
    goodput = account.goodput
    nodes = len(account.nodes)
    head = "goodput unknown (no time accounted)" if goodput is None else f"goodput {goodput:.1%}"
    lines.append(
        f"{head}: {nodes} node{'s' if nodes != 1 else ''}, {account.wall:.0f} s of wall time "
        f"({account.total:.0f} node-seconds)"
    )
    if not account.steps_known:
        lines.append(f"  {NO_STEPS}")
    total = account.total or 1.0
    lines.append("")
    lines.append(f"  {'phase':<12}{'seconds':>10}{'share':>8}")
    for phase, seconds in account.phases.items():
        if seconds > 0 or phase == TRAINING:
            lines.append(f"  {phase:<12}{seconds:>10.1f}{seconds / total:>8.1%}")
    lines.append("")
    incidents = account.incidents
    if not incidents:
        lines.append("no failures")
    else:
        causes = ", ".join(f"{cause} {count}" for cause, count in account.causes().items())
        mtbf = account.mtbf()
        lines.append(
            f"failures: {len(incidents)} ({causes}); mean time between failures {mtbf:.0f} s"
            if mtbf is not None
            else f"failures: {len(incidents)} ({causes})"
        )
        lines += recovery_facts(account)
    lines += [straggler_line(s) for s in account.stragglers]
    if account.skipped_lines:
        lines.append(f"({skipped_line(account)})")
    return "\n".join(lines)


def straggler_line(straggler: Mapping[str, Any]) -> str:
    """A ``straggler`` event as a report says it."""
    return (
        f"straggler: node {straggler.get('node')} worked "
        f"{real(straggler.get('pace')):.3f} s per step, "
        f"{real(straggler.get('ratio')):.1f}x the median of the others"
    )


def skipped_line(account: Account) -> str:
    return f"{account.skipped_lines} lines of the logs were not events: skipped"


def recovery_facts(account: Account) -> list[str]:
    """Time to recover and to detect, and the steps redone, as the report says them."""
    facts = []
    recover = account.recoveries()
    if recover:
        facts.append(
            f"time to recover: mean {statistics.fmean(recover):.1f} s, worst {max(recover):.1f} s"
        )
    detect = account.detections()
    if detect:
        facts.append(f"time to detect: mean {statistics.fmean(detect):.2f} s")
    if account.steps_known:
        facts.append(f"steps redone: {account.steps_redone}")
    return facts
