"""Hang detection with real agents and gloo workers, on by default, the script unchanged
(``tests/workers/hangs.py`` calls no rallypoint API): each hang is found, named, its
stacks kept, and the job trains again; a healthy job with long stretches without a step
runs to its end. The deadlines are scaled down (``--hang-floor``) so that each job takes
seconds; ``make soak`` runs the minute-long shapes."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from launch import (
    assert_no_worker_left,
    events,
    exit_codes,
    rallypoint,
    start_agent,
    worker,
)
from servers import free_port

#: The floor in these jobs: above what a starved worker on a busy 2-core machine can lose
#: (3 s once seen, tests/faults/test_worker_faults.py) while its peer waits in all_reduce.
FLOOR = 6.0
TRAINED = "rank 1 trained 60 steps in attempt 1"


def run_job(
    tmp_path: Path,
    case: str,
    *options: str,
    script: tuple[str, ...] = (),
    scaled: bool = True,
    timeout: float = 150,
) -> str:
    """``case`` on two ranks with default flags but the floor (``scaled``: else all
    default); its output."""
    log = tmp_path / "events.log"
    floor = ("--hang-floor", str(FLOOR), "--hang-ceiling", "60") if scaled else ()
    result = rallypoint(
        "run", "--nproc-per-node", "2", "--max-restarts", "1", *floor,
        "--log-dir", str(tmp_path / "logs"), "--event-log", str(log.with_suffix(".jsonl")),
        *options, worker("hangs.py"), case, *script, "--tag", str(tmp_path),
        timeout=timeout,
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    return output


# (case, agent options, what the sentence says of rank 1, where rank 1 was)
HANGS = [
    pytest.param("blocked", (), r"made no progress", r"hangs\.py:\d+ in hang\(\)", id="blocked"),
    pytest.param(
        "blocked", ("--warm-start", "off"), r"made no progress", r"hangs\.py", id="blocked-cold"
    ),
    pytest.param("spin", (), r"made no progress", r"hangs\.py:\d+ in hang\(\)", id="spin"),
    pytest.param("fifo", (), r"made no progress", r"hangs\.py:\d+ in hang\(\)", id="fifo"),
    pytest.param("sigstop", (), r"made no progress", r"stopped \(SIGSTOP", id="sigstop"),
    pytest.param("mismatch", (), r"every rank waited in different collectives", r"", id="mismatch"),
    pytest.param(
        "dataloader", (), r"made no progress", r"hangs\.py:\d+ in main\(\)", id="dataloader"
    ),
]


@pytest.mark.parametrize(("case", "options", "said", "place"), HANGS)
def test_a_hang_is_found_named_and_the_job_trains_again(
    tmp_path: Path, case: str, options: tuple[str, ...], said: str, place: str
) -> None:
    output = run_job(tmp_path, case, *options)
    assert TRAINED in output, output
    (found,) = events(tmp_path / "events.log", "hang_detected")
    assert 1 in found["ranks"], found
    sentence = found["sentence"]
    assert re.search(said, sentence), sentence
    if case != "mismatch":  # rank 0 waited in all_reduce, from the script's line
        assert re.search(r"rank 0 waited in all_reduce \(hangs\.py:\d+\)", sentence), sentence
        assert re.search(rf"rank 1 was at {place}", sentence), sentence
    else:
        assert "broadcast (hangs.py:" in sentence and "all_reduce (hangs.py:" in sentence
    (line,) = [line for line in output.splitlines() if line.startswith("[rallypoint] hang: ")]
    assert sentence in line and "stacks" in line  # one line in the agent's log
    failed = events(tmp_path / "events.log", "worker_failed")
    root = next(f for f in failed if f["rank"] == 1)
    assert root["hang"] == sentence and root["stalled_seconds"] >= FLOOR
    stacks = Path(found["stacks"]) / "1" / "stacks.txt"
    if case != "sigstop":  # a stopped rank writes none: /proc described it
        assert "most recent call first" in stacks.read_text()
    assert_no_worker_left(str(tmp_path))  # the DataLoader's blocked worker included


def test_a_hang_with_no_restart_left_is_the_job_s_reported_failure(tmp_path: Path) -> None:
    """failure.json names the stuck rank, and its traceback is the rank's main thread."""
    log = tmp_path / "events.jsonl"
    result = rallypoint(
        "run", "--nproc-per-node", "2", "--hang-floor", str(FLOOR), "--log-dir",
        str(tmp_path / "logs"), "--event-log", str(log), worker("hangs.py"), "blocked",
        "--tag", str(tmp_path), timeout=150,
    )  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr
    report = json.loads(next((tmp_path / "logs").glob("*/failure.json")).read_text())
    root = report["root_cause"]
    assert root["rank"] == 1 and root["hang"].startswith("rank 1 made no progress for")
    trace = root["traceback"].splitlines()
    assert trace[0] == "Stack of the main thread (most recent call last):"
    assert any(line.endswith("in hang") and "hangs.py" in line for line in trace), trace
    assert "killed for a hang: rank 1 made no progress" in result.stderr
    assert_no_worker_left(str(tmp_path))


def test_a_hang_under_ddp_is_found_from_inside_backward(tmp_path: Path) -> None:
    """DDP's all-reduces run in backward(), out of the script's sight: rank 0 waits there."""
    output = run_job(tmp_path, "blocked", script=("--ddp",))
    assert TRAINED in output, output
    (found,) = events(tmp_path / "events.log", "hang_detected")
    assert re.search(r"rank 0 waited in backward \(hangs\.py:\d+\)", found["sentence"])


def test_a_healthy_job_with_long_stretches_without_a_step_is_never_killed(
    tmp_path: Path,
) -> None:
    """torch.compile's first step, epochs, rank 0 evaluating and saving while rank 1 waits
    in all_reduce, every rank in numpy: each 2.5 floors long, none a hang."""
    output = run_job(tmp_path, "healthy", script=("--seconds", str(2.5 * FLOOR)))
    assert "rank 1 trained 60 steps in attempt 0" in output, output
    assert events(tmp_path / "events.log", "hang_detected") == []
    assert events(tmp_path / "events.log", "worker_failed") == []
    # The numpy stretch was seen, said once with its evidence, and left alone.
    assert re.search(r"ranks 0-1 made no progress for \d+ s, outside any collective", output)


def test_long_steps_are_learned_not_killed(tmp_path: Path) -> None:
    """Steps of 1.5 floors: the first is not timed, and the gap it shows is learned."""
    output = run_job(
        tmp_path, "steady", script=("--steps", "4", "--step-seconds", str(1.5 * FLOOR))
    )
    assert "rank 1 trained 4 steps in attempt 0" in output, output
    assert events(tmp_path / "events.log", "hang_detected") == []


@pytest.mark.soak
@pytest.mark.timeout(1800)  # three jobs of minutes each, one after another
def test_minute_long_shapes_with_default_flags(tmp_path: Path) -> None:
    """The shapes at their real length, with every flag at its default: a 3-minute
    evaluation, a 2-minute save and 2 minutes of numpy are never killed; a rank blocked
    is, a minute (the floor) after its last progress."""
    output = run_job(tmp_path, "healthy", script=("--seconds", "180"), scaled=False, timeout=900)
    assert "rank 1 trained 60 steps in attempt 0" in output, output
    assert events(tmp_path / "events.log", "hang_detected") == []
    steps, hang = tmp_path / "steps", tmp_path / "hang"
    steps.mkdir()
    hang.mkdir()
    output = run_job(
        steps, "steady", script=("--steps", "6", "--step-seconds", "20"), scaled=False,
        timeout=600,
    )  # fmt: skip
    assert events(steps / "events.log", "hang_detected") == []
    output = run_job(hang, "blocked", scaled=False, timeout=600)
    assert TRAINED in output, output
    (found,) = events(hang / "events.log", "hang_detected")
    assert found["sentence"].startswith("rank 1 made no progress for 6"), found


ACROSS = [
    pytest.param(
        "blocked",
        r"rank 1 made no progress for \d+ s while rank 0 waited in all_reduce "
        r"\(hangs\.py:\d+\); rank 1 was at hangs\.py:\d+ in hang\(\)",
        id="stuck",
    ),
    pytest.param(
        "mismatch",
        r"every rank waited in different collectives for \d+ s: rank 0 waited in all_reduce "
        r"\(hangs\.py:\d+\), rank 1 waited in broadcast \(hangs\.py:\d+\)",
        id="collective",
    ),
]


@pytest.mark.parametrize(("case", "sentence"), ACROSS)
def test_a_hang_across_nodes_is_found_from_what_the_other_node_shares(
    tmp_path: Path, case: str, sentence: str
) -> None:
    """Two nodes of one rank each: alone, neither node has evidence (a rank with no
    progress, or a rank waiting alone, both until the ceiling). Each shares its rank's long
    wait through the rendezvous: the stuck rank's node kills it, naming where the other
    node's rank waited; ranks in different collectives are each killed by their own node,
    both seeing the whole job."""
    run_across(tmp_path, case, sentence)


@pytest.mark.soak
def test_a_rank_stuck_on_another_node_is_found_with_default_flags(tmp_path: Path) -> None:
    """The stuck case across nodes with every hang and rendezvous setting at its default:
    the floor of 60 s, a heartbeat every 5 s."""
    run_across(tmp_path, "blocked", ACROSS[0].values[1], scaled=False)


def run_across(tmp_path: Path, case: str, sentence: str, *, scaled: bool = True) -> None:
    port, run_id = free_port(), f"hang-{tmp_path.name}"
    conf = "heartbeat_timeout=3,last_call_timeout=1" if scaled else ""  # a beat a second
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    flags = ("--hang-floor", str(FLOOR), "--hang-ceiling", "120") if scaled else ()
    script = (worker("hangs.py"), case, "--tag", str(tmp_path))
    agents = [
        start_agent(
            "c10d", f"127.0.0.1:{port}", run_id, "2", *flags, "--event-log",
            str(log.with_suffix(".jsonl")), *script, conf=conf, log=log, nproc=1,
        )
        for log in logs
    ]  # fmt: skip
    codes = exit_codes(agents, timeout=150 if scaled else 400)
    output = "\n".join(log.read_text() for log in logs)
    assert codes == [0, 0], output
    # The attempt counts its node's restarts: a node whose workers were stopped for the
    # other node's kill keeps its count, as torchrun's agents do.
    assert re.search(r"rank 1 trained 60 steps in attempt [01]\n", output), output
    found = [f for log in logs for f in events(log, "hang_detected")]
    # Only the stuck rank's node finds a stuck rank. Both nodes see the collective: the
    # first to kill ends the round, which may stop the other's rank before it does.
    assert 1 <= len(found) <= (1 if case == "blocked" else 2), found
    for event in found:
        assert event["kind"] == ("stuck" if case == "blocked" else "collective"), event
        assert re.match(sentence, event["sentence"]), event
    assert_no_worker_left(str(tmp_path))


@pytest.mark.parametrize("framework", ["lightning", "accelerate"])
def test_a_hang_in_a_framework_s_loop_is_found_through_what_it_calls(
    tmp_path: Path, framework: str
) -> None:
    """Lightning's Trainer and Accelerate's prepared model, the script unchanged: their
    optimizer steps arm and time the ranks, DDP's backward is where rank 0 waits, and the
    sentence names the script's line (past the framework's frames)."""
    log = tmp_path / "events.log"
    result = rallypoint(
        "run", "--nproc-per-node", "2", "--max-restarts", "1", "--hang-floor", str(FLOOR),
        "--hang-ceiling", "60", "--event-log", str(log.with_suffix(".jsonl")),
        worker("frameworks.py"), framework, "blocked", "--tag", str(tmp_path), timeout=240,
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "rank 1 trained 60 steps in attempt 1" in output, output
    (found,) = events(log, "hang_detected")
    assert re.match(
        r"rank 1 made no progress for \d+ s while rank 0 waited in backward "
        r"\(frameworks\.py:\d+\); rank 1 was at frameworks\.py:\d+ in maybe_hang\(\)",
        found["sentence"],
    ), found
    assert_no_worker_left(str(tmp_path))
