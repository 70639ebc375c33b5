"""Recall selection: the most total relevance that fits the room, among clearly relevant spans."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from agentkv.lifecycle.recall_ranking import choose_within_room
from agentkv.spans import Span, SpanKind


def _ranked(scores: list[float]) -> list[tuple[Span, float]]:
    spans = [Span(span_id=i, kind=SpanKind.USER, token_ids=[1], start=i) for i in range(len(scores))]
    return list(zip(spans, scores, strict=True))


def test_short_relevant_spans_beat_one_long_loosely_relevant_span():
    # The shape of the bench's support workload: a 255-token policy text ranks second and
    # greedy selection would let it crowd out the 40-token message that holds the answer.
    ranked = _ranked([0.62, 0.61, 0.50, 0.43, 0.34, 0.34, 0.29])
    costs = [18, 255, 24, 40, 12, 25, 24]
    chosen = choose_within_room(ranked, costs, 310, relative_floor=0.5)
    assert chosen == [0, 2, 3, 4, 5]  # 2.23 in 119 tokens; with the policy text at most 2.07
    assert sum(costs[i] for i in chosen) <= 310


def test_the_best_match_is_taken_first_when_it_fits():
    # The research workload: the fitted parameter sits in a 317-token tool result that ranks
    # first; two short messages have more summed relevance but do not hold the answer.
    ranked = _ranked([0.54, 0.52, 0.34, 0.25])
    costs = [317, 26, 29, 21]
    assert choose_within_room(ranked, costs, 329, relative_floor=0.5) == [0]
    # When it cannot fit, the room goes to the others.
    assert choose_within_room(ranked, costs, 300, relative_floor=0.5) == [1, 2]


def test_the_floor_keeps_many_weak_spans_from_outvoting_one_strong_span():
    ranked = _ranked([0.9, 0.8] + [0.2] * 10)
    costs = [10, 250] + [25] * 10
    assert choose_within_room(ranked, costs, 260, relative_floor=0.5) == [0, 1]
    # Without the floor, the ten weak spans' summed relevance (2.0) would win.
    assert choose_within_room(ranked, costs, 260, relative_floor=0.0) == [0, *range(2, 12)]


def test_unlimited_room_takes_every_eligible_span_and_nothing_irrelevant():
    ranked = _ranked([0.8, 0.5, 0.3, 0.0])
    assert choose_within_room(ranked, [10, 10, 10, 10], None, relative_floor=0.5) == [0, 1]
    assert choose_within_room(_ranked([0.0, 0.0]), [1, 1], 100, relative_floor=0.5) == []
    assert choose_within_room([], [], 100, relative_floor=0.5) == []


def test_a_span_larger_than_the_room_is_never_chosen():
    ranked = _ranked([0.9, 0.5])
    assert choose_within_room(ranked, [1_000, 10], 100, relative_floor=0.1) == [1]


@settings(max_examples=200, deadline=None)
@given(
    items=st.lists(st.tuples(st.floats(0.01, 1.0), st.integers(1, 10_000)), min_size=1, max_size=20),
    room=st.integers(0, 50_000),
)
def test_chosen_spans_always_fit_and_are_eligible(items, room):
    items.sort(key=lambda item: -item[0])
    ranked = _ranked([score for score, _ in items])
    costs = [cost for _, cost in items]
    chosen = choose_within_room(ranked, costs, room, relative_floor=0.5)
    assert sum(costs[i] for i in chosen) <= room
    assert all(ranked[i][1] >= 0.5 * ranked[0][1] for i in chosen)
    assert chosen == sorted(set(chosen))
    # Nothing eligible that still fits was left out when the room is ample.
    if sum(costs) <= room:
        assert chosen == [i for i in range(len(items)) if ranked[i][1] >= 0.5 * ranked[0][1]]
