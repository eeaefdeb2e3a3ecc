"""ElasticSampler: one order per epoch, split among the ranks of each round, resumed at any
world size without repeating or skipping a sample."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

from launch import rallypoint, worker
from rallypoint.data import ElasticSampler

SIZES = [1, 3, 7, 16, 23, 50, 101]


def samplers(
    size: int, world: int, state: dict[str, Any] | None = None, **options: Any
) -> list[ElasticSampler]:
    """One sampler per rank of a ``world``-rank round, all loaded from ``state``."""
    ranks = [ElasticSampler(range(size), rank=r, world_size=world, **options) for r in range(world)]
    if state is not None:
        for sampler in ranks:
            sampler.load_state_dict(state)
    return ranks


def run_round(
    size: int,
    world: int,
    batch: int,
    steps: int | None,
    state: dict[str, Any] | None,
    **options: Any,
) -> tuple[list[list[int]], dict[str, Any]]:
    """Train ``steps`` steps (or to the end of the epoch) in lockstep on ``world`` ranks, each
    reading through a DataLoader; return each rank's indices and rank 0's state."""
    ranks = samplers(size, world, state, **options)
    loaders = [iter(DataLoader(range(size), batch_size=batch, sampler=s)) for s in ranks]
    seen: list[list[int]] = [[] for _ in ranks]
    step = 0
    while steps is None or step < steps:
        batches = [next(loader, None) for loader in loaders]
        if all(b is None for b in batches):
            break
        for rank, (sampler, got) in enumerate(zip(ranks, batches, strict=True)):
            if got is not None:  # a rank without a batch in the last step does not advance
                seen[rank] += got.tolist()
                sampler.advance(batch)
        step += 1
    return seen, ranks[0].state_dict()


# -- the order


@pytest.mark.parametrize("shuffle", [True, False])
def test_the_order_depends_on_seed_and_epoch_only(shuffle: bool) -> None:
    a = ElasticSampler(range(50), rank=0, world_size=1, shuffle=shuffle, seed=3)
    b = ElasticSampler(range(50), rank=2, world_size=5, shuffle=shuffle, seed=3)
    assert a.order() == b.order()
    assert sorted(a.order()) == list(range(50))
    a.set_epoch(1)
    b.set_epoch(1)
    assert a.order() == b.order()
    if shuffle:
        assert a.order() != ElasticSampler(range(50), shuffle=True, seed=3).order()
        assert a.order() != ElasticSampler(range(50), shuffle=True, seed=4).order()
    else:
        assert a.order() == list(range(50))


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_interleaving_the_ranks_gives_the_epoch_order(size: int, world: int) -> None:
    ranks = samplers(size, world, seed=7)
    shares = [list(s) for s in ranks]
    assert [len(share) for share in shares] == [len(s) for s in ranks]
    interleaved = [share[i] for i in range(len(shares[0])) for share in shares if i < len(share)]
    assert interleaved == ranks[0].order()


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("world", [1, 2, 3, 5])
@pytest.mark.parametrize("consumed", [0, 1, 6])
def test_the_ranks_split_what_is_left_without_overlap(size: int, world: int, consumed: int) -> None:
    consumed = min(consumed, size)
    ranks = samplers(size, world)
    for sampler in ranks:
        sampler.consumed = consumed
    shares = [list(s) for s in ranks]
    together = [i for share in shares for i in share]
    assert sorted(together) == sorted(ranks[0].order()[consumed:])
    assert max(map(len, shares)) - min(map(len, shares)) <= 1
    assert len(shares[0]) == max(map(len, shares)), "rank 0 holds the largest share"


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_drop_last_gives_every_rank_as_many_and_drops_the_fewest(size: int, world: int) -> None:
    ranks = samplers(size, world, drop_last=True)
    for sampler in ranks:
        sampler.consumed = 1
    shares = [list(s) for s in ranks]
    assert {len(share) for share in shares} == {(size - 1) // world}
    together = [i for share in shares for i in share]
    assert len(set(together)) == len(together)
    assert set(together) <= set(ranks[0].order()[1:])
    assert size - 1 - len(together) == (size - 1) % world


# -- position and state


def test_advance_counts_the_whole_job_and_stops_at_the_end() -> None:
    sampler = ElasticSampler(range(10), rank=1, world_size=3)
    sampler.advance(2)
    assert (sampler.consumed, sampler.remaining, len(sampler)) == (6, 4, 1)
    assert list(sampler) == [sampler.order()[7]]
    sampler.advance(2)
    assert (sampler.consumed, sampler.remaining, len(sampler), list(sampler)) == (10, 0, 0, [])
    sampler.advance(4, steps=0)
    assert sampler.consumed == 10


def test_an_iteration_keeps_its_indices_while_the_loop_advances() -> None:
    sampler = ElasticSampler(range(12), rank=0, world_size=2)
    expected = sampler.order()[0::2]
    got = []
    for index in sampler:
        got.append(index)
        sampler.advance(1)
    assert got == expected
    assert sampler.consumed == 12


def test_set_epoch_starts_a_new_epoch_and_keeps_the_current_one() -> None:
    sampler = ElasticSampler(range(10), world_size=1, rank=0)
    sampler.advance(4)
    sampler.set_epoch(0)  # a resumed loop calls it with the checkpoint's epoch
    assert sampler.consumed == 4
    sampler.set_epoch(1)
    assert (sampler.epoch, sampler.consumed, len(sampler)) == (1, 0, 10)


def test_state_is_plain_and_resumes_at_another_world_size() -> None:
    sampler = ElasticSampler(range(30), rank=0, world_size=4, seed=5)
    sampler.set_epoch(2)
    sampler.advance(3)
    state = json.loads(json.dumps(sampler.state_dict()))
    assert state == {
        "version": 1,
        "epoch": 2,
        "consumed": 12,
        "seed": 5,
        "shuffle": True,
        "length": 30,
        "steps": 1,
    }
    resumed = ElasticSampler(range(30), rank=1, world_size=3, seed=5)
    resumed.load_state_dict(state)
    assert (resumed.epoch, resumed.consumed, resumed.steps) == (2, 12, 1)
    assert list(resumed) == sampler.order()[13::3]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"length": 31}, "length=31"),
        ({"seed": 6}, "seed=6"),
        ({"shuffle": False}, "shuffle=False"),
        ({"version": 9}, "version 9"),
        ({"consumed": 31}, "consumed=31"),
    ],
)
def test_a_state_for_another_order_is_refused(change: dict[str, Any], message: str) -> None:
    state = ElasticSampler(range(30), seed=5).state_dict()
    sampler = ElasticSampler(range(30), seed=5)
    with pytest.raises(ValueError, match=message):
        sampler.load_state_dict({**state, **change})


def test_rank_and_world_size_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert (ElasticSampler(range(4)).rank, ElasticSampler(range(4)).world_size) == (2, 3)
    assert ElasticSampler(range(4), rank=0, world_size=1).world_size == 1
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    assert (ElasticSampler(range(4)).rank, ElasticSampler(range(4)).world_size) == (0, 1)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"rank": 2, "world_size": 2}, "rank must be in 0..1"),
        ({"rank": 0, "world_size": 0}, "at least 1"),
    ],
)
def test_bad_rank_or_world_size_is_one_sentence(options: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ElasticSampler(range(4), **options)


def test_bad_advance_is_refused() -> None:
    with pytest.raises(ValueError, match="non-negative"):
        ElasticSampler(range(4)).advance(-1)


# -- the guarantee: every sample once, across rounds of different sizes


@pytest.mark.parametrize("size", [13, 20, 21, 37, 64, 101])
@pytest.mark.parametrize("batch", [1, 2, 3])
@pytest.mark.parametrize("shuffle", [True, False])
def test_two_one_two_ranks_see_every_sample_once(size: int, batch: int, shuffle: bool) -> None:
    seen: Counter[int] = Counter()
    state = None
    for world, steps in [(2, 2), (1, 3), (2, None)]:
        shares, state = run_round(size, world, batch, steps, state, shuffle=shuffle, seed=11)
        seen.update(i for share in shares for i in share)
    assert seen == Counter(range(size))
    assert state is not None and state["consumed"] == size


@pytest.mark.parametrize("size", [13, 21, 37, 101])
@pytest.mark.parametrize(
    "rounds", [[(3, 1), (2, 2), (4, None)], [(4, 2), (1, 1), (3, 1), (2, None)]]
)
def test_any_sequence_of_world_sizes_sees_every_sample_once(
    size: int, rounds: list[tuple[int, int | None]]
) -> None:
    seen: Counter[int] = Counter()
    state = None
    for world, steps in rounds:
        shares, state = run_round(size, world, 2, steps, state, seed=1)
        seen.update(i for share in shares for i in share)
    assert seen == Counter(range(size))


@pytest.mark.parametrize("size", [13, 21, 37, 101])
def test_drop_last_sees_every_sample_at_most_once(size: int) -> None:
    seen: Counter[int] = Counter()
    state = None
    for world, steps in [(2, 2), (1, 3), (3, None)]:
        shares, state = run_round(size, world, 2, steps, state, drop_last=True)
        assert len({len(share) for share in shares}) == 1
        seen.update(i for share in shares for i in share)
    assert max(seen.values()) == 1
    assert size - len(seen) < 3


def test_the_next_epoch_is_whole_again() -> None:
    sampler = ElasticSampler(range(9), rank=0, world_size=1)
    sampler.advance(9)
    sampler.set_epoch(1)
    assert sorted(sampler) == list(range(9))


# -- in workers


def test_a_job_scaled_from_two_workers_to_one_and_back_sees_every_sample_once(
    tmp_path: Path,
) -> None:
    # 21 samples in batches of 2: 12 on 2 workers, 4 on 1, then 5 on 2 workers, where
    # rank 0 takes one batch more than rank 1.
    state = tmp_path / "sampler.json"
    seen: Counter[int] = Counter()
    for nproc, steps, consumed in [(2, "3", 12), (1, "2", 16), (2, "", 21)]:
        out = tmp_path / f"round-{nproc}-{steps}.json"
        limit = ["--steps", steps] if steps else []
        result = rallypoint(
            "run", "--standalone", "--nproc-per-node", str(nproc),
            worker("elastic_epoch.py"), str(state), str(out), "--size", "21", "--batch-size", "2", *limit,
            timeout=120,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        report = json.loads(out.read_text())
        assert report["world"] == nproc
        assert report["agent_modules"] == [], "a worker imports rallypoint.data without the agent"
        assert report["state"]["consumed"] == consumed
        seen.update(i for share in report["seen"] for i in share)
    assert [len(share) for share in report["seen"]] == [3, 2], "the last round is uneven"
    assert seen == Counter(range(21))


def test_the_guide_example_trains_and_checkpoints(tmp_path: Path) -> None:
    guide = Path(__file__).resolve().parents[1] / "docs" / "elastic-data.md"
    (example,) = re.findall(r"^```python\n(.*?)^```", guide.read_text(), re.DOTALL | re.MULTILINE)
    (tmp_path / "train.py").write_text(example)
    result = rallypoint(
        "run", "--standalone", "--nproc-per-node", "2", "train.py", cwd=tmp_path, timeout=120
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    state = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    # 1001 samples in steps of 2 x 10: 49 steps, then rank 0 takes 10 and 1, rank 1 only 10,
    # and rank 0's count of steps is saved.
    assert state["step"] == 3 * 51
    assert (state["sampler"]["epoch"], state["sampler"]["consumed"]) == (2, 1001)
