"""The page ``rallypoint report --html`` writes: one self-contained HTML file (inline CSS
and SVG; nothing is fetched, so it opens offline and can be mailed or archived).

It shows a timeline per node (its phases along a time axis, its rounds with their world
size, failures, restarts, checkpoint saves and loads), the time per phase, the failures by
cause and the slowest recoveries. Every text that comes from a log is escaped.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from datetime import datetime, timezone
from html import escape

from rallypoint.goodput import (
    MEMBERSHIP,
    NO_STEPS,
    PHASES,
    TABLE,
    TRAINING,
    Account,
    Incident,
    Node,
    Segment,
    recovery_facts,
    skipped_line,
    straggler_line,
)

#: Each phase's colour on the timeline and in the tables, and what it is in a few words.
COLOURS = {phase.name: phase.colour for phase in TABLE}
MEANINGS = {phase.name: phase.meaning for phase in TABLE}
FAILURE = "#c92a2a"
#: The slowest recoveries listed; the rest are counted.
WORST = 20

# The SVG's coordinates; the page scales it to the window's width (viewBox).
WIDTH = 1000
LEFT, RIGHT = 12, 40  # room for the axis labels and markers at either end
LANE = 98  # one node: label, save ticks, phase bar, load ticks, rounds
BAR_Y, BAR_H = 30, 24  # the phase bar, from the top of the lane
ROUND_Y, ROUND_H = 64, 18
AXIS_H = 28
FONT = 11
#: Seconds between the time axis's ticks: the first that makes ten or fewer (else days).
TICK_STEPS = (0.1, 0.2, 0.5, 1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200,
              10800, 21600, 43200, 86400)  # fmt: skip
CHAR = 0.62 * FONT  # an estimate of a character's width, to fit labels in their bars

CSS = """
body{margin:0;color:#212529;background:#fff;
 font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,"DejaVu Sans",sans-serif}
main{max-width:1040px;margin:0 auto;padding:12px 20px 40px}
h1{font-size:22px;margin:8px 0 2px}h2{font-size:17px;margin:26px 0 6px}
.headline{font-size:16px;margin:4px 0}.note{color:#495057;margin:4px 0}
.legend{display:flex;flex-wrap:wrap;gap:2px 16px;padding:0;margin:8px 0;list-style:none}
.swatch{display:inline-block;width:12px;height:12px;border-radius:2px;
 vertical-align:-1px;margin-right:5px}
svg.timeline{display:block;width:100%;height:auto}
svg.glyph{vertical-align:-2px;margin-right:4px}
svg text{font-size:11px;fill:#343a40}
table{border-collapse:collapse;margin:4px 0 8px;max-width:100%}
th,td{padding:3px 10px;text-align:left;border-bottom:1px solid #dee2e6;vertical-align:top}
th{font-weight:600;border-bottom:2px solid #adb5bd}
.n{text-align:right;font-variant-numeric:tabular-nums}td.n{white-space:nowrap}
.wrap{overflow-wrap:anywhere}.name{white-space:nowrap}
@media (max-width:640px){main{padding:8px 10px 30px}th,td{padding:3px 4px}}
"""


def render(account: Account) -> str:
    """The whole page for ``account``, as one string."""
    begin = min((n.start for n in account.nodes), default=0.0)
    end = max((n.end for n in account.nodes), default=begin)
    x = _scale(begin, end)
    body = [
        "<h1>rallypoint report</h1>",
        _headline(account, begin),
        "<h2>Timeline</h2>",
        _legend(),
        _timeline(account, x, begin, end),
        "<h2>Where the time went</h2>",
        _phases_table(account),
        "<h2>Failures</h2>",
        _failures(account),
        "<h2>Slowest recoveries</h2>",
        _recoveries(account, begin),
        _notes(account),
    ]
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>rallypoint report</title><style>{CSS}</style></head>"
        f"<body><main>{''.join(body)}</main></body></html>\n"
    )


# --- the text around the timeline -----------------------------------------------------------


def _headline(account: Account, begin: float) -> str:
    goodput = account.goodput
    head = "goodput unknown (no time accounted)" if goodput is None else f"goodput {goodput:.1%}"
    nodes = len(account.nodes)
    started = datetime.fromtimestamp(begin, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    return (
        f'<p class="headline"><strong>{head}</strong>: {nodes} node{"s" * (nodes != 1)}, '
        f"{account.wall:.0f} s of wall time ({account.total:.0f} node-seconds), "
        f"from {started}</p>"
    )


def _legend() -> str:
    items = [
        f'<li><span class="swatch" style="background:{COLOURS[p]}"></span>{p}</li>' for p in PHASES
    ]
    marks = {
        "failure": f'<path d="M2 1h10l-5 8z" fill="{FAILURE}"/>'
        f'<line x1="7" x2="7" y1="8" y2="14" stroke="{FAILURE}" stroke-width="2"/>',
        "restart": '<line x1="7" x2="7" y1="0" y2="14" stroke="#343a40" stroke-dasharray="3 2"/>',
        "checkpoint saved": f'<line x1="7" x2="7" y1="0" y2="8" stroke="{COLOURS["checkpoint"]}"/>',
        "checkpoint loaded": f'<line x1="7" x2="7" y1="6" y2="14" stroke-width="2" '
        f'stroke="{COLOURS["loading"]}"/>',
    }
    items += [
        f'<li><svg class="glyph" width="14" height="14" viewBox="0 0 14 14">{glyph}</svg>'
        f"{name}</li>"
        for name, glyph in marks.items()
    ]
    return f'<ul class="legend">{"".join(items)}</ul>'


def _phases_table(account: Account) -> str:
    total = account.total or 1.0
    rows = [
        f'<tr data-phase="{phase}"><td class="name"><span class="swatch" style="background:'
        f'{COLOURS[phase]}"></span>{phase}</td><td class="n">{seconds:.1f}</td>'
        f'<td class="n">{seconds / total:.1%}</td><td>{MEANINGS[phase]}</td></tr>'
        for phase, seconds in account.phases.items()
        if seconds > 0 or phase == TRAINING
    ]
    return (
        '<table class="phases"><tr><th>phase</th><th class="n">node-seconds</th>'
        f'<th class="n">share</th><th>what it is</th></tr>{"".join(rows)}'
        f'<tr><td><strong>total</strong></td><td class="n">{account.total:.1f}</td>'
        '<td class="n">100.0%</td><td></td></tr></table>'
    )


def _failures(account: Account) -> str:
    incidents = account.incidents
    if not incidents:
        return '<p class="note">No failures.</p>'
    rows = "".join(
        f'<tr><td>{escape(cause)}</td><td class="n">{count}</td></tr>'
        for cause, count in account.causes().items()
    )
    facts = [f"{len(incidents)} failure{'s' * (len(incidents) != 1)}"]
    mtbf = account.mtbf()
    if mtbf is not None:
        facts.append(f"mean time between failures {mtbf:.0f} s")
    facts += recovery_facts(account)
    return (
        f'<p class="note">{"; ".join(facts)}</p>'
        f'<table class="causes"><tr><th>cause</th><th class="n">failures</th></tr>{rows}</table>'
    )


def _recoveries(account: Account, begin: float) -> str:
    if not account.incidents:
        return '<p class="note">Nothing to recover from.</p>'
    # Worst first; a failure the job never recovered from (no step after it) last.
    ordered = sorted(
        account.incidents,
        key=lambda i: (i.recover_seconds is None, -(i.recover_seconds or 0.0), i.at),
    )
    rows = "".join(_recovery_row(incident, begin) for incident in ordered[:WORST])
    more = len(ordered) - WORST
    rest = f'<p class="note">and {more} more.</p>' if more > 0 else ""
    return (
        '<table class="recoveries"><tr><th class="n">recovery</th><th class="n">detection</th>'
        '<th class="n">steps redone</th><th>cause</th><th class="n">round</th>'
        f'<th class="n">at</th><th>node</th></tr>{rows}</table>{rest}'
    )


def _recovery_row(incident: Incident, begin: float) -> str:
    def seconds(value: float | None, digits: int) -> str:
        return "\u2014" if value is None else f"{value:.{digits}f} s"

    redone = "\u2014" if incident.steps_redone is None else str(incident.steps_redone)
    return (
        f'<tr data-recover="{incident.recover_seconds}">'
        f'<td class="n">{seconds(incident.recover_seconds, 2)}</td>'
        f'<td class="n">{seconds(incident.detect_seconds, 3)}</td>'
        f'<td class="n">{redone}</td><td>{escape(incident.cause)}</td>'
        f'<td class="n">{incident.round}</td><td class="n">{_clock(incident.at - begin)}</td>'
        f'<td class="wrap">{escape(incident.node)}</td></tr>'
    )


def _notes(account: Account) -> str:
    notes = [NO_STEPS] if not account.steps_known else []
    notes += [straggler_line(straggler) for straggler in account.stragglers]
    if account.skipped_lines:
        notes.append(skipped_line(account))
    return "".join(f'<p class="note wrap">{escape(_sentence(note))}</p>' for note in notes)


def _sentence(text: str) -> str:
    return text[:1].upper() + text[1:] + "."


# --- the timeline ---------------------------------------------------------------------------


def _scale(begin: float, end: float) -> Callable[[float], float]:
    """Wall time to the SVG's x."""
    span = max(end - begin, 1e-9)
    return lambda at: LEFT + (at - begin) / span * (WIDTH - LEFT - RIGHT)


def _timeline(account: Account, x: Callable[[float], float], begin: float, end: float) -> str:
    height = LANE * len(account.nodes) + AXIS_H
    parts = [
        f'<svg class="timeline" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} '
        f'{height}" width="{WIDTH}" height="{height}" role="img" '
        'aria-label="timeline of every node">'
    ]
    ticks = _axis_ticks(end - begin)
    bottom = LANE * len(account.nodes)
    for at, _ in ticks:  # grid lines first, under the lanes
        parts.append(
            f'<line x1="{x(begin + at):.1f}" x2="{x(begin + at):.1f}" y1="0" y2="{bottom}" '
            'stroke="#e9ecef"/>'
        )
    for index, node in enumerate(account.nodes):
        parts.append(f'<g class="node" transform="translate(0 {index * LANE})">')
        parts.append(_node_label(node))
        parts += _phase_bars(node.segments, x)
        parts += _rounds(node, x)
        parts += _checkpoint_ticks(node, x)
        parts += _failure_marks(node, x)
        parts.append("</g>")
    for at, label in ticks:
        anchor = "end" if x(begin + at) + len(label) * CHAR / 2 > WIDTH else "middle"
        parts.append(
            f'<line x1="{x(begin + at):.1f}" x2="{x(begin + at):.1f}" y1="{bottom}" '
            f'y2="{bottom + 5}" stroke="#868e96"/><text class="tick" x="{x(begin + at):.1f}" '
            f'y="{bottom + 18}" text-anchor="{anchor}">{label}</text>'
        )
    parts.append("</svg>")
    return "".join(parts)


def _node_label(node: Node) -> str:
    seconds = node.end - node.start
    share = node.seconds(TRAINING) / seconds if seconds > 0 else 0.0
    rounds = len(node.attempts)
    name = node.node if len(node.node) <= 80 else node.node[:79] + "\u2026"
    host = f" on {escape(node.host)}" if node.host and node.host not in node.node else ""
    return (
        f'<text class="label" x="{LEFT}" y="14"><tspan font-weight="600">node '
        f"{escape(name)}</tspan>{host} \u00b7 {_clock(seconds)} \u00b7 goodput {share:.1%} "
        f"\u00b7 {rounds} round{'s' * (rounds != 1)}</text>"
    )


def _phase_bars(segments: list[Segment], x: Callable[[float], float]) -> list[str]:
    """A rect per segment a pixel wide or more; the segments between two such are gathered
    into columns about a pixel wide, so that a long job's page grows with the width of
    the timeline, not with the number of its saves."""
    parts: list[str] = []
    run: list[Segment] = []
    for segment in segments:
        if x(segment.end) - x(segment.start) >= 1:
            parts += _column(run, x) + _column([segment], x)
            run = []
            continue
        run.append(segment)
        if x(segment.end) - x(run[0].start) >= 1:
            parts += _column(run, x)
            run = []
    return parts + _column(run, x)


def _column(run: list[Segment], x: Callable[[float], float]) -> list[str]:
    """The segments ``run`` as one column, stacked by phase, each as high as its share of
    the column's time: a phase too short for a pixel of its own stays in sight (a save
    every few seconds of a day-long job)."""
    if not run:
        return []
    by_phase = {phase: 0.0 for phase in PHASES}
    for segment in run:
        by_phase[segment.phase] += segment.seconds
    total = sum(by_phase.values())
    x0, x1 = x(run[0].start), x(run[-1].end)
    parts, y = [], float(BAR_Y)
    for phase, seconds in by_phase.items():
        if seconds <= 0:
            continue
        height = BAR_H * seconds / total
        share = f" of {total:.2f} s" if len(run) > 1 else ""
        parts.append(
            f'<rect class="phase" data-phase="{phase}" x="{x0:.2f}" y="{y:.2f}" '
            f'width="{x1 - x0:.2f}" height="{height:.2f}" fill="{COLOURS[phase]}">'
            f"<title>{phase}: {seconds:.2f} s{share}</title></rect>"
        )
        y += height
    return parts


def _rounds(node: Node, x: Callable[[float], float]) -> list[str]:
    """A bar per round, labelled when the label fits; a dashed line at each restart."""
    parts = []
    for index, attempt in enumerate(node.attempts):
        end = attempt.end if attempt.end is not None else node.end
        x0, x1 = x(attempt.start), max(x(end), x(attempt.start) + 1)
        outcome = "finished" if attempt.succeeded else "ended"
        label = next(
            (
                text
                for text in (
                    f"round {attempt.round} \u00b7 world size {attempt.world_size}",
                    f"r{attempt.round} \u00b7 {attempt.world_size}",
                )
                if len(text) * CHAR + 8 <= x1 - x0
            ),
            "",
        )
        parts.append(
            f'<g class="round" data-round="{attempt.round}" data-world-size="'
            f'{attempt.world_size}"><rect x="{x0:.2f}" y="{ROUND_Y}" width="{x1 - x0:.2f}" '
            f'height="{ROUND_H}" rx="3" fill="{("#dee2e6", "#ced4da")[index % 2]}"/>'
            f"<title>round {attempt.round}, world size {attempt.world_size}: "
            f"{end - attempt.start:.1f} s, {outcome}</title>"
            + (f'<text x="{x0 + 4:.2f}" y="{ROUND_Y + 13}">{label}</text>' if label else "")
            + "</g>"
        )
        if index > 0:
            parts.append(
                f'<line class="restart" x1="{x0:.2f}" x2="{x0:.2f}" y1="{BAR_Y - 4}" '
                f'y2="{ROUND_Y + ROUND_H}" stroke="#343a40" stroke-dasharray="3 2">'
                f"<title>restart: round {attempt.round}</title></line>"
            )
    return parts


def _checkpoint_ticks(node: Node, x: Callable[[float], float]) -> list[str]:
    """A tick above the bar per save, below it per load; ticks closer than a pixel (a load
    by every rank) are one, their steps in its tooltip."""
    parts = []
    saves = _merge_ticks(((x(at), str(step)) for at, step in node.saves))
    for at, steps in saves:
        parts.append(
            f'<line class="save" data-step="{steps[-1]}" x1="{at:.2f}" x2="{at:.2f}" '
            f'y1="{BAR_Y - 8}" y2="{BAR_Y}" stroke="{COLOURS["checkpoint"]}">'
            f"<title>saved step {_steps(steps)}</title></line>"
        )
    loads = _merge_ticks(((x(at), f"{step} from {source}") for at, step, source in node.loads))
    for at, steps in loads:
        parts.append(
            f'<line class="load" data-step="{escape(steps[-1].split()[0])}" x1="{at:.2f}" '
            f'x2="{at:.2f}" y1="{BAR_Y + BAR_H}" y2="{BAR_Y + BAR_H + 8}" stroke-width="2" '
            f'stroke="{COLOURS["loading"]}"><title>loaded step {escape(_steps(steps))}'
            "</title></line>"
        )
    return parts


def _merge_ticks(ticks: Iterable[tuple[float, str]]) -> list[tuple[float, list[str]]]:
    merged: list[tuple[float, list[str]]] = []
    for at, what in sorted(ticks, key=lambda tick: tick[0]):
        if merged and at - merged[-1][0] < 1:
            if what not in merged[-1][1]:
                merged[-1][1].append(what)
        else:
            merged.append((at, [what]))
    return merged


def _steps(steps: list[str]) -> str:
    return steps[0] if len(steps) == 1 else f"{steps[0]} to {steps[-1]}"


def _failure_marks(node: Node, x: Callable[[float], float]) -> list[str]:
    """A marker where a round of this node ended for a failure: a red triangle and line for
    a worker's failure, a grey one for the job's nodes changing."""
    parts = []
    for attempt in node.attempts:
        if attempt.failure is None:
            continue
        cause, failed, noticed = attempt.failure
        at = x(failed)
        colour = "#495057" if cause == MEMBERSHIP else FAILURE
        what = "the job's nodes changed" if cause == MEMBERSHIP else f"failure: {cause}"
        parts.append(
            f'<g class="failure" data-cause="{escape(cause)}" data-round="{attempt.round}">'
            f'<path d="M{at - 5:.2f} {BAR_Y - 12}h10l-5 9z" fill="{colour}"/>'
            f'<line x1="{at:.2f}" x2="{at:.2f}" y1="{BAR_Y - 3}" y2="{ROUND_Y + ROUND_H}" '
            f'stroke="{colour}" stroke-width="2"/><title>{escape(what)} in round '
            f"{attempt.round}{_noticed(failed, noticed)}</title></g>"
        )
    return parts


def _axis_ticks(span: float) -> list[tuple[float, str]]:
    """(seconds from the start, label): at most about ten, on round numbers of the unit."""
    step = next((s for s in TICK_STEPS if span / s <= 10), 86400 * -(-span // 864000))
    unit, name = (1, "s") if step < 60 else (60, "min") if step < 3600 else (3600, "h")
    ticks, count = [], 0
    while count * step <= span + 1e-9:
        at = count * step
        ticks.append((at, "0" if count == 0 else f"{round(at / unit, 3):g} {name}"))
        count += 1
    return ticks


def _clock(seconds: float) -> str:
    """A time span, or a time from the job's start: ``12.3 s``, ``12:05`` or ``1:02:05``."""
    if seconds < 120:
        return f"{seconds:.1f} s"
    whole = int(seconds)
    hours, rest = divmod(whole, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


def _noticed(failed: float, noticed: float | None) -> str:
    return "" if noticed is None else f", noticed {noticed - failed:.3f} s later"
