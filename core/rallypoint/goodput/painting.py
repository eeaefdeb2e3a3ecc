"""How an attempt's training splits into phases: start-up (or restart) until its first step,
the checkpoint load, the steps redone until the job's step before it is reached again, the
saves that held it up, and the training that stayed done.

The split is given as its seconds (``split``: what a snapshot adds up) and as segments
(``painted``: what the timelines show), from the same spans.
"""

from __future__ import annotations

from rallypoint.goodput.account import Segment
from rallypoint.goodput.attempts import Run
from rallypoint.goodput.phases import CHECKPOINT, LOADING, REDONE, RESTART, STARTUP, TRAINING
from rallypoint.goodput.stalls import Stalls

Span = tuple[str, float, float]  # (phase, start, end)


def spans(run: Run, steps_known: bool, end: float) -> list[Span]:
    """What ``run`` gives of its training to other phases, in the order it is given (each
    takes what is still training). ``end``: the node's, for an attempt not yet ended."""
    attempt = run.attempt
    until = attempt.end if attempt.end is not None else end
    ready = STARTUP if run.first else RESTART
    if run.first_mark is None:
        # The job reports steps and these workers made none: they never got going. Else no
        # steps anywhere: all training, as far as anyone can tell.
        return [(ready, attempt.start, until)] if steps_known else []
    # Training begins when the checkpoint is loaded, or one step before the first step.
    if attempt.load is not None:
        given = [(ready, attempt.start, attempt.load[0]), (LOADING, *attempt.load)]
        began = attempt.load[1]
    else:
        began = max(attempt.start, run.first_mark[0] - run.step_seconds())
        given = [(ready, attempt.start, began)]
    resumed = run.resumed()
    if run.target is not None and resumed is not None and resumed < run.target:
        reached = run.reached if run.reached is not None else until
        given.append((REDONE, began, min(until, reached)))
    return given


def trained(run: Run, end: float) -> tuple[float, float]:
    """When ``run`` was training: from its start to the phase after, or to ``end``."""
    stop = run.trained_to if run.trained_to is not None else end
    return run.trained_from, max(stop, run.trained_from)


def split(run: Run, steps_known: bool, end: float, stalls: Stalls) -> dict[str, float]:
    """The seconds of each phase ``run``'s training went to."""
    seconds: dict[str, float] = {}
    free = [trained(run, end)]  # what is still training
    for phase, start, stop in spans(run, steps_known, end):
        taken, free = _carve(free, start, stop)
        if taken > 0:
            seconds[phase] = seconds.get(phase, 0.0) + taken
    held = sum(stalls.within(start, stop) for start, stop in free)
    seconds[CHECKPOINT] = seconds.get(CHECKPOINT, 0.0) + held
    seconds[TRAINING] = sum(stop - start for start, stop in free) - held
    return seconds


def _carve(
    free: list[tuple[float, float]], start: float, stop: float
) -> tuple[float, list[tuple[float, float]]]:
    """The seconds of ``free`` between ``start`` and ``stop``, and ``free`` without them."""
    taken, left = 0.0, []
    for a, b in free:
        low, high = max(a, start), min(b, stop)
        if high <= low:
            left.append((a, b))
            continue
        taken += high - low
        left += [(x, y) for x, y in ((a, low), (high, b)) if y > x]
    return taken, left


def painted(run: Run, steps_known: bool, end: float, stalls: Stalls) -> list[Segment]:
    """``run``'s training as segments of the phases it went to, in time order."""
    start, stop = trained(run, end)
    if stop <= start:
        return []
    segments = [Segment(start, stop, TRAINING)]
    for phase, a, b in spans(run, steps_known, end):
        segments = paint(segments, [(a, b)], phase)
    return paint(segments, stalls.spans(start, stop), CHECKPOINT)


def paint(segments: list[Segment], spans: list[tuple[float, float]], phase: str) -> list[Segment]:
    """``segments`` (in time order) with their training time inside ``spans`` given to
    ``phase``: one pass over both, so that a save every step of a long job stays cheap."""
    merged: list[list[float]] = []
    for start, end in sorted(spans):
        if end <= start:
            continue
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    out: list[Segment] = []
    first = 0  # the first span that may still overlap a segment
    for segment in segments:
        if segment.phase != TRAINING:
            out.append(segment)
            continue
        while first < len(merged) and merged[first][1] <= segment.start:
            first += 1
        cursor = segment.start
        index = first
        while index < len(merged) and merged[index][0] < segment.end:
            start, end = max(merged[index][0], cursor), min(merged[index][1], segment.end)
            if start > cursor:
                out.append(Segment(cursor, start, TRAINING))
            out.append(Segment(start, end, phase))
            cursor = end
            if merged[index][1] > segment.end:
                break  # it goes on into a later segment
            index += 1
        if cursor < segment.end:
            out.append(Segment(cursor, segment.end, TRAINING))
    return out


def merged(segments: list[Segment]) -> list[Segment]:
    """Neighbours in the same phase made one."""
    out: list[Segment] = []
    for segment in segments:
        if out and out[-1].phase == segment.phase and out[-1].end >= segment.start:
            out[-1] = Segment(out[-1].start, segment.end, segment.phase)
        else:
            out.append(segment)
    return out
