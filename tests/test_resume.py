"""The round's resume step (``rallypoint.agent.checkpoints.resume``): decided from the offers alone,
the same on every member, with what each member must fetch."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from rallypoint.agent.checkpoints.resume import Decision, decide, decode, encode


def test_an_offer_reads_back_as_it_was_written() -> None:
    shares = {5: {0: 2, 1: 2}, 4: {3: 4}}
    offer = encode({3, 5}, shares)
    assert offer == {"steps": "3 5", "shares": "4@4:3 5@2:0,1"}
    assert decode(offer) == ({3, 5}, shares)


def test_what_does_not_parse_is_left_out() -> None:
    assert decode({"steps": "3 x 5", "shares": "5@2:0,y 6:1 z@2:0"}) == ({3, 5}, {5: {0: 2}})
    assert decode({}) == (set(), {})


def test_nothing_offered_resumes_from_durable_storage() -> None:
    assert decide([(set(), {}), (set(), {})], 0, 2, range(1)) == Decision(None)


def test_a_whole_state_is_fetched_by_the_member_that_lacks_it() -> None:
    offers = [({3, 5}, {}), ({4}, {})]
    assert decide(offers, 0, 2, range(0, 1)) == Decision(5)
    assert decide(offers, 1, 2, range(1, 2)) == Decision(5, {(0, False): [0]})


def test_a_sharded_step_needs_every_rank_s_share_at_the_round_s_world_size() -> None:
    # Step 6: rank 1's share is nowhere; step 5: rank 0's on member 0, rank 1's on member 1.
    offers = [(set(), {6: {0: 2}, 5: {0: 2}}), (set(), {5: {1: 2}})]
    assert decide(offers, 0, 2, range(0, 1)) == Decision(5)
    assert decide(offers, 1, 2, range(1, 2)) == Decision(5)


def test_a_member_fetches_the_shares_of_its_ranks_it_lacks() -> None:
    # A node came back empty and takes rank 1, whose share only member 0 holds (as a peer).
    offers = [(set(), {7: {0: 2, 1: 2}}), (set(), {})]
    assert decide(offers, 1, 2, range(1, 2)) == Decision(7, {(1, True): [0]})


def test_shares_saved_at_another_world_size_do_not_count() -> None:
    # Saved by 2 ranks; the round has 3: the workers reshard from --checkpoint-dir.
    offers = [(set(), {5: {0: 2, 1: 2}}), (set(), {5: {1: 2}}), (set(), {})]
    assert decide(offers, 2, 3, range(2, 3)) == Decision(None)


def test_the_newer_of_a_whole_state_and_a_sharded_one_wins() -> None:
    offers = [({9}, {8: {0: 1}})]
    assert decide(offers, 0, 1, range(1)) == Decision(9)
    offers = [({7}, {8: {0: 1}})]
    assert decide(offers, 0, 1, range(1)) == Decision(8)


steps = st.sets(st.integers(0, 6), max_size=3)
shares = st.dictionaries(
    st.integers(0, 6), st.dictionaries(st.integers(0, 2), st.sampled_from([2, 3]), max_size=3)
)


@given(st.lists(st.tuples(steps, shares), min_size=1, max_size=3))
def test_every_member_decides_the_same_step_and_can_fetch_what_it_lacks(offers: list) -> None:
    world = 3
    sizes = [world // len(offers) + (i < world % len(offers)) for i in range(len(offers))]
    firsts = [sum(sizes[:i]) for i in range(len(offers))]
    decisions = [
        decide(offers, me, world, range(firsts[me], firsts[me] + sizes[me]))
        for me in range(len(offers))
    ]
    assert len({d.step for d in decisions}) == 1
    step = decisions[0].step
    held = {s for whole, _ in offers for s in whole}
    complete = {
        s
        for s in range(7)
        if set(range(world)) <= {r for _, sh in offers for r, w in sh.get(s, {}).items() if w == 3}
    }
    assert step == max(held | complete, default=None)
    for me, decision in enumerate(decisions):
        for (rank, sharded), members in decision.fetch.items():
            assert members and me not in members
            for member in members:
                whole, sh = offers[member]
                assert (step in sh and sh[step].get(rank) == world) if sharded else step in whole
