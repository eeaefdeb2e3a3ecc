"""Goodput (``rallypoint.goodput``): real jobs' event logs accounted into phases, and the
rules of the account on small logs whose answer is known."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from launch import rallypoint, worker
from rallypoint import goodput
from rallypoint.errors import UsageError
from rallypoint.goodput.timeline import cause

TRAIN = worker("mem_train.py")


def run(tmp_path: Path, *flags: str, script: tuple[str, ...]) -> goodput.Account:
    log = tmp_path / "events.jsonl"
    done = rallypoint(
        "run", "--nproc-per-node", "2", "--max-restarts", "1", "--event-log", str(log),
        *flags, TRAIN, *script, timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    records, skipped = goodput.read([log])
    assert skipped == 0
    return goodput.account(records)


def test_a_restart_from_an_older_checkpoint_counts_the_steps_redone(tmp_path: Path) -> None:
    """Saves after steps 4, 9, 14...; rank 1 dies in step 13: the job resumes from step 9
    and does steps 10 to 12 (or 13, which rank 0 had reached) again."""
    account = run(
        tmp_path, "--checkpoint-dir", str(tmp_path / "ckpt"),
        script=("30", "--save-every", "5", "--kill-rank", "1", "--kill-at", "13",
                "--step-seconds", "0.1"),
    )  # fmt: skip
    assert account.steps_known
    [incident] = account.incidents
    assert (incident.cause, incident.steps_redone) in (("SIGKILL", 3), ("SIGKILL", 4))
    assert incident.detect_seconds is not None and incident.detect_seconds >= 0
    assert incident.recover_seconds is not None and incident.recover_seconds > 0
    phases = account.phases
    assert phases[goodput.REDONE] > 0 and phases[goodput.LOADING] > 0
    assert phases[goodput.TRAINING] > phases[goodput.REDONE]
    assert sum(phases.values()) == pytest.approx(account.total)
    assert 0 < (account.goodput or 0) < 1


def test_a_restart_from_memory_redoes_at_most_the_step_being_saved(tmp_path: Path) -> None:
    account = run(
        tmp_path, "--checkpoint-memory", "64MB",
        script=("30", "--kill-rank", "1", "--kill-at", "13", "--step-seconds", "0.1"),
    )  # fmt: skip
    [incident] = account.incidents
    assert incident.steps_redone in (0, 1)  # step 13's save may not have begun
    assert [source for _, _, source in account.nodes[0].loads] == ["memory", "memory"]


def test_a_script_that_reports_no_step_is_accounted_by_phase(tmp_path: Path) -> None:
    log = tmp_path / "events.jsonl"
    done = rallypoint(
        "run", "--nproc-per-node", "2", "--event-log", str(log), worker("steps.py"), "2",
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    account = goodput.account(goodput.read([log])[0])
    assert not account.steps_known and account.incidents == []
    assert account.phases[goodput.TRAINING] > 1.5
    assert "the workers reported no steps" in goodput.summary(account)


# --- the rules, on logs made by hand ------------------------------------------------------


def event(name: str, at: float, **data: Any) -> dict[str, Any]:
    return {"event": name, "wall_time": at, "node": "n1", "host": "h", **data}


LIFE = [
    event("agent_started", 0),
    event("rendezvous_started", 0),
    event("rendezvous_completed", 1, round=0, world_size=2),
    event("workers_started", 2, round=0, world_size=2),
    event("progress", 4, step=0),
    event("progress", 12, step=8),
    event("checkpoint_saved", 12.5, step=8, seconds=0.5, blocked_seconds=0.5),
    event("progress", 14, step=10),
    event("worker_failed", 15, timestamp=14.5, detected=14.75, signal="SIGKILL"),
    event("rendezvous_started", 15),
    event("rendezvous_completed", 15.5, round=1, world_size=2),
    event("workers_started", 16, round=1, world_size=2),
    event("checkpoint_loaded", 17, step=8, seconds=0.5, source="durable"),
    event("progress", 18, step=9),
    event("progress", 20, step=11),
]


def test_every_second_of_a_known_log_has_its_phase() -> None:
    account = goodput.account([*LIFE, event("agent_stopping", 21, exit_code=0)])
    phases = {k: round(v, 3) for k, v in account.phases.items() if v}
    # Startup: 1-3 (one step before the first step); training 3-14.5 less the save's
    # 0.5 s, and 19-21; restart: 14.75-15, 15.5-16.5; redone: 17 until step 10, at 19.
    assert phases == {
        "startup": 2.0, "rendezvous": 1.5, "training": 13.0, "checkpoint": 0.5,
        "detection": 0.25, "restart": 1.25, "loading": 0.5, "redone": 2.0,
    }  # fmt: skip
    [incident] = account.incidents
    assert (incident.steps_redone, incident.detect_seconds, incident.recover_seconds) == (
        2, 0.25, 3.5,
    )  # fmt: skip
    assert account.goodput == pytest.approx(13 / 21)


def test_a_live_account_runs_until_now() -> None:
    account = goodput.account(LIFE, now=30)
    assert account.nodes[0].end == 30
    assert account.nodes[0].segments[-1] == goodput.Segment(19, 30, goodput.TRAINING)


def test_logs_are_read_from_files_and_directories_and_a_torn_line_is_skipped(
    tmp_path: Path,
) -> None:
    (tmp_path / "a").mkdir()
    lines = [json.dumps(e) for e in LIFE]
    (tmp_path / "a" / "n1.jsonl").write_text("\n".join(lines) + '\n{"event": "progr')
    records, skipped = goodput.read([tmp_path / "a"])
    assert (len(records), skipped) == (len(LIFE), 1)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: p / "nowhere.jsonl", "no such event log"),
        (lambda p: p, "holds no event log"),
        (lambda p: (p / "x.jsonl").write_text("hello\n") and p / "x.jsonl", "no rallypoint event"),
    ],
)
def test_a_bad_log_is_one_sentence(tmp_path: Path, make: Any, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        goodput.read([make(tmp_path)])


def test_a_node_joining_is_no_failure_and_a_node_lost_is_counted_as_one() -> None:
    def life(node: str, rounds: list[tuple[int, float, int]], **end: Any) -> list[dict[str, Any]]:
        records = [event("agent_started", 0)]
        for round_, at, world in rounds:
            records += [
                event("rendezvous_started", at),
                event("rendezvous_completed", at + 0.5, round=round_, world_size=world),
                event("workers_started", at + 1, round=round_, world_size=world),
                event("progress", at + 2, step=int(at)),
            ]
            if round_ != rounds[-1][0]:
                records.append(event("workers_restarted", at + 5, cause="membership"))
        return [{**r, "node": node} for r in records]

    # a alone, b joins at 10 (a bigger round 1), b is lost at 20 (round 2, a alone again).
    a = life("a", [(0, 0, 2), (1, 10, 4), (2, 20, 2)])
    b = life("b", [(1, 10, 4)])
    incidents = goodput.account(a + b).incidents
    assert [(i.round, i.cause, i.detect_seconds) for i in incidents] == [(1, "membership", None)]


def test_workers_that_never_stepped_count_as_restarting_not_training() -> None:
    """The job reports steps; an attempt killed before its first step got nothing done."""
    records = [
        *LIFE,
        event("worker_failed", 20.5, timestamp=20.4, detected=20.45, signal="SIGKILL"),
        event("rendezvous_started", 20.5),
        event("rendezvous_completed", 20.6, round=2, world_size=2),
        event("workers_started", 20.7, round=2, world_size=2),
        event("worker_failed", 23, timestamp=22.9, detected=22.95, signal="SIGKILL"),
        event("agent_stopping", 23, exit_code=1),
    ]
    segments = goodput.account(records).nodes[0].segments
    assert [s.phase for s in segments if s.end > 20.7] == ["restart", "detection", "restart"]


def test_the_sums_kept_event_by_event_are_the_account_at_every_moment() -> None:
    """An accountant's snapshot (its sums, kept as the events come) is the whole account of
    the events so far, at every event: through a failure, a load, redone steps, workers
    that never stepped, and a node whose save holds up the other's training."""
    other = [
        {**event(name, at, **data), "node": "n2", "host": "h2"}
        for name, at, data in [
            ("agent_started", 1, {}),
            ("workers_started", 3, {"round": 0, "world_size": 2}),
            ("progress", 5, {"step": 0}),
            ("checkpoint_saved", 11, {"step": 7, "seconds": 2.0, "blocked_seconds": 1.5}),
            ("agent_stopping", 22, {"exit_code": 0}),
        ]
    ]
    records = [
        *LIFE,
        event("worker_failed", 20.5, timestamp=20.4, detected=20.45, signal="SIGKILL"),
        event("rendezvous_started", 20.5),
        event("rendezvous_completed", 20.6, round=2, world_size=2),
        event("workers_started", 20.7, round=2, world_size=2),
        event("agent_stopping", 23, exit_code=1),
    ]
    records = sorted(records + other, key=lambda r: float(r["wall_time"]))
    accountant = goodput.Accountant()
    for index, record in enumerate(records):
        accountant.add_record(record)
        for now in (None, float(record["wall_time"]) + 0.25):
            whole, sums = goodput.account(records[: index + 1], now), accountant.snapshot(now)
            assert sums.phases == pytest.approx(whole.phases, abs=1e-9), (index, now)
            assert (sums.total, list(sums.incidents)) == (
                pytest.approx(whole.total),
                whole.incidents,
            )
    # Each save holds up both nodes: n1's 0.5 s and n2's 1.5 s.
    assert whole.phases[goodput.CHECKPOINT] == pytest.approx(2 * (0.5 + 1.5))


@pytest.mark.parametrize(
    ("fields", "said"),
    [
        ({"signal": "SIGKILL", "stalled_seconds": 61.0, "hang": "rank 3 made no progress"}, "hang"),
        ({"signal": "SIGKILL", "stalled_seconds": 5.0}, "watchdog"),
        ({"signal": "SIGKILL", "out_of_memory": True}, "out of memory"),
        ({"exit_code": 1}, "exit code 1"),
    ],
)
def test_a_failure_s_cause_in_a_word(fields: dict[str, Any], said: str) -> None:
    assert cause(fields) == said
