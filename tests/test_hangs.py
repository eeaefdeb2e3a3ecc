"""Hang detection's decisions (``rallypoint.agent.monitoring.hangs``), driven through
timelines of progress reports with no real time and no processes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from launch import rallypoint
from rallypoint.agent.monitoring.hangs import (
    COLLECTIVE,
    SILENT,
    STUCK,
    WATCHDOG,
    WORK,
    HangSettings,
    HangWatch,
    _ranks,
)
from rallypoint.agent.monitoring.stacks import parse
from rallypoint.agent.monitoring.steps import Progress

FLOOR, CEILING = 10.0, 100.0


class Job:
    """Ranks 0..n-1 of one node, reporting every half second on a timeline of their own."""

    def __init__(
        self, ranks: int = 4, world_size: int | None = None, first: int = 0, **settings: Any
    ) -> None:
        settings = {"floor": FLOOR, "ceiling": CEILING, **settings}
        self.watch = HangWatch(HangSettings(**settings))
        self.watch.watch(0.0, ranks if world_size is None else world_size)
        self.n = ranks
        self.first = first  # the global rank of local rank 0 (a node of a larger job)
        self.peers: dict[str, Any] = {}  # what the job's other nodes shared, as read
        self.now = 0.0
        self.state: dict[int, dict[str, Any]] = {
            r: {"signals": 0, "progressed": None, "armed": False, "collective": None, "phase": None}
            for r in range(ranks)
        }
        self.quiet: set[int] = set()  # ranks that send no report (stopped)

    def progress(self, *ranks: int, armed: bool = True) -> None:
        for r in ranks or range(self.n):
            s = self.state[r]
            s.update(signals=s["signals"] + 1, progressed=self.now, armed=s["armed"] or armed)
            s["collective"] = None

    def enter(self, rank: int, op: str = "all_reduce", site: str = "train.py:88") -> None:
        self.state[rank]["collective"] = {"op": op, "site": site, "since": self.now}

    def phase(self, rank: int, name: str | None) -> None:
        self.state[rank]["phase"] = None if name is None else {"name": name, "since": self.now}

    def run(self, seconds: float, *, progressing: tuple[int, ...] = ()) -> list[Any]:
        """Reports every half second for ``seconds``; the verdicts found on the way."""
        verdicts = []
        end = self.now + seconds
        while self.now < end - 1e-9:
            self.now = round(self.now + 0.5, 6)
            if progressing:
                self.progress(*progressing)
            for r in range(self.n):
                if r not in self.quiet:
                    self.watch.report(
                        {
                            "local_rank": r,
                            "rank": self.first + r,
                            "sent": self.now,
                            "thread": 1,
                            **self.state[r],
                        },
                        self.now,
                    )
            verdict = self.watch.verdict(range(self.n), self.now, self.peers)
            if verdict is not None:
                verdicts.append((self.now, verdict))
        return verdicts


def trained(job: Job, seconds: float = 5.0) -> Job:
    """Every rank armed and stepping (a signal every half second) for ``seconds``."""
    job.run(seconds, progressing=tuple(range(job.n)))
    return job


def test_a_rank_with_no_progress_while_the_others_wait_in_a_collective_is_stuck() -> None:
    job = trained(Job())
    stalled_at = job.now
    for r in (0, 1, 2):
        job.enter(r)
    verdicts = job.run(30)
    at, verdict = verdicts[0]
    assert verdict.kind == STUCK and verdict.kill == (3,)
    assert at == pytest.approx(stalled_at + FLOOR)  # its deadline: the floor, nothing learned
    assert verdict.sentence(at, {3: "data.py:120 in read()"}) == (
        "rank 3 made no progress for 10 s while ranks 0-2 waited in all_reduce (train.py:88); "
        "rank 3 was at data.py:120 in read()"
    )


def test_nothing_is_killed_before_the_deadline_or_without_a_rank_waiting() -> None:
    job = trained(Job())
    job.enter(0)
    assert job.run(FLOOR - 1) == []  # waited, but under the floor
    job = trained(Job())
    verdicts = job.run(3 * FLOOR)  # nobody waits: everyone busy outside collectives is work
    assert [v.kind for _, v in verdicts] == [WORK]  # said once, nothing to kill
    assert verdicts[0][1].kill == ()
    job.progress()
    assert job.run(1, progressing=(0, 1, 2, 3)) == []
    # A new stretch is said again, once past the deadline the first one taught (5 x 30 s).
    assert [v.kind for _, v in job.run(6 * 3 * FLOOR)] == [WORK]


def test_a_rank_in_a_checkpoint_or_not_yet_armed_is_never_accused() -> None:
    job = Job()
    job.run(2, progressing=(0, 1, 2))
    job.progress(3, armed=False)  # rank 3 still compiles its first step
    for r in (0, 1, 2):
        job.enter(r)
    assert job.run(3 * FLOOR) == []
    job = trained(Job())
    job.phase(3, "checkpoint_save")
    for r in (0, 1, 2):
        job.enter(r)
    assert job.run(3 * FLOOR) == []


def test_the_deadline_is_learned_from_the_rank_s_longest_gap() -> None:
    job = trained(Job())
    for _ in range(3):  # steps of 4 s: a deadline of 5 x 4 = 20 s, over the floor
        job.run(4)
        job.progress()
    for r in (0, 1, 2):
        job.enter(r)
    start = job.now
    at, verdict = job.run(60)[0]
    assert verdict.kind == STUCK and at - start == pytest.approx(20.0)
    assert verdict.deadline == pytest.approx(20.0)


def test_a_gap_over_a_checkpoint_is_not_learned() -> None:
    job = trained(Job())
    job.phase(3, "checkpoint_save")
    job.run(30)
    job.phase(3, None)
    job.progress()
    state = next(r for r in job.watch.ranks() if r.local_rank == 3)
    assert state.longest_gap < 1.0


def test_every_rank_in_a_collective_past_its_deadline_is_a_collective_hang() -> None:
    job = trained(Job(ranks=2))
    job.enter(0, "all_reduce", "train.py:88")
    job.enter(1, "broadcast", "train.py:90")
    at, verdict = job.run(30)[0]
    assert verdict.kind == COLLECTIVE and verdict.kill == (0, 1)
    assert verdict.sentence(at) == (
        "every rank waited in different collectives for 10 s: rank 0 waited in all_reduce "
        "(train.py:88), rank 1 waited in broadcast (train.py:90)"
    )


def test_a_node_that_sees_part_of_the_job_waits_for_the_ceiling() -> None:
    job = trained(Job(ranks=2, world_size=8))  # the other 6 ranks are on other nodes
    job.enter(0)
    job.enter(1)
    start = job.now
    at, verdict = job.run(2 * CEILING)[0]
    assert verdict.kind == SILENT and at - start == pytest.approx(CEILING)


def test_a_rank_that_stops_answering_is_accused_not_believed_waiting() -> None:
    job = trained(Job())
    job.enter(3)  # it was in the collective when it stopped (SIGSTOP)
    job.quiet.add(3)
    for r in (0, 1, 2):
        job.enter(r)
    _at, verdict = job.run(30)[0]
    assert verdict.kind == STUCK and verdict.kill == (3,)


def test_a_rank_silent_alone_is_killed_at_the_ceiling() -> None:
    job = trained(Job(ranks=1))
    job.quiet.add(0)
    start = job.now
    verdicts = job.run(2 * CEILING)
    assert verdicts[0][1].kind == WORK  # a rank alone, silent: work until the ceiling
    at, verdict = next((at, v) for at, v in verdicts if v.kind == SILENT)
    assert at - start == pytest.approx(CEILING) and verdict.kill == (0,)


def test_the_fixed_watchdog_blames_the_rank_the_others_wait_for() -> None:
    job = trained(Job(ranks=2, fixed=7.0))
    job.enter(0)  # rank 0 waits at once; rank 1 stops a report later, outside any collective
    job.run(0.5, progressing=(1,))
    _at, verdict = job.run(30)[0]
    assert verdict.kind == WATCHDOG and verdict.kill == (1,)  # not rank 0, which waits
    job = trained(Job(ranks=2, fixed=7.0))
    job.enter(0)
    job.enter(1)  # both wait: a collective that never completes
    _at, verdict = job.run(30)[0]
    assert verdict.kill == (0, 1)


def test_the_fixed_watchdog_kills_work_too_and_off_finds_nothing() -> None:
    job = trained(Job(fixed=7.0))
    _at, verdict = job.run(30)[0]
    assert verdict.kind == WATCHDOG and verdict.kill == (0, 1, 2, 3)
    job = trained(Job(mode="off"))
    for r in (0, 1, 2):
        job.enter(r)
    assert job.run(3 * CEILING) == []


def test_reports_of_an_older_attempt_or_malformed_are_dropped() -> None:
    watch = HangWatch(HangSettings(floor=FLOOR, ceiling=CEILING))
    watch.watch(100.0, 1)
    good = {"local_rank": 0, "rank": 0, "progressed": 99.0, "armed": True, "thread": 1}
    watch.report({**good, "sent": 99.0}, 101.0)  # sent before this attempt began
    for bad in ({"local_rank": -1}, {"local_rank": True}, {"sent": "x"}, {"progressed": "x"}):
        watch.report({**good, "sent": 101.0, **bad}, 101.0)
    assert watch.ranks() == []
    watch.report({**good, "sent": 101.0, "collective": {"op": 3}}, 101.0)
    assert [r.waiting for r in watch.ranks()] == [None]


@pytest.mark.parametrize(
    ("numbers", "text"),
    [([3], "rank 3"), ([0, 1, 2], "ranks 0-2"), ([0, 2, 5, 6, 7], "ranks 0, 2, 5-7")],
)
def test_ranks_are_named_in_runs(numbers: list[int], text: str) -> None:
    assert _ranks(numbers) == text


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (
            ("--hang-detection", "sometimes"),
            "--hang-detection 'sometimes': choose one of auto, off.",
        ),
        (("--hang-floor", "0"), "--hang-floor '0': must be above 0"),
        (
            ("--hang-floor", "30", "--hang-ceiling", "20"),
            "--hang-ceiling 20 is under --hang-floor 30",
        ),
    ],
)
def test_a_bad_hang_flag_is_one_sentence_and_exit_code_2(
    tmp_path: Path, flags: tuple[str, ...], said: str
) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    result = rallypoint("run", *flags, str(script))
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("rallypoint: error: ") and said in line, line


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4)
    ),
    max_leaves=12,
)
FIELDS = ("local_rank", "rank", "sent", "progressed", "armed", "collective", "phase", "thread")


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(FIELDS), JSON, max_size=len(FIELDS)))
@example({"sent": 10**400, "progressed": 10**400, "collective": {"op": "x", "since": 10**400}})
def test_any_report_a_worker_sends_is_taken_or_dropped_never_raises(data: dict[str, Any]) -> None:
    """A report is a datagram's JSON: whatever it holds, the watch stays consistent."""
    watch = HangWatch(HangSettings(floor=FLOOR, ceiling=CEILING))
    watch.watch(0.0, 2)
    watch.report(data, 1.0)
    watch.report({**data, "local_rank": 0, "rank": 0, "sent": 1.0}, 1.0)
    for now in (2.0, 50.0, 500.0):
        verdict = watch.verdict([0, 1], now)
        if verdict is not None:
            assert verdict.sentence(now)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=400))
def test_any_stacks_file_parses_without_raising(text: str) -> None:
    for frames in parse(text).values():
        assert all(frame.line >= 0 for frame in frames)


def test_a_step_time_no_float_holds_is_dropped() -> None:
    steps = Progress()
    steps.watch(0.0)
    steps.report({"local_rank": 0, "step": 3, "step_at": 10**400})
    steps.report({"local_rank": 0, "step": 10**400, "step_at": 1.0})
    assert steps.step() is None
