"""Recall's choice through the plan: a promotion is granted when it fits, best match first."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from agentkv.lifecycle.options import promotion
from agentkv.lifecycle.placement import plan_placement
from agentkv.lifecycle.rungs import NEEDED_CLASS, PROMOTION_CLASS, Rung, RungOption, SpanOptions

BACK, ARCHIVED = 0.25, 0.9
"""The fidelity cost of a span brought back at int4, and of one left archived."""


def _asked(scores: list[float], costs: list[int], *, best_first: bool = True) -> list[SpanOptions]:
    """Archived spans (on the host: no device bytes) asking to come back, ranked best first."""
    return [
        promotion(
            i,
            score,
            RungOption(Rung.ATTENDED_Q, cost, BACK),
            RungOption(Rung.ARCHIVED, 0, ARCHIVED),
            klass=PROMOTION_CLASS if best_first and i == 0 else NEEDED_CLASS,
            order=i,
        )
        for i, (score, cost) in enumerate(zip(scores, costs, strict=True))
    ]


def _granted(asked: list[SpanOptions], room: int, usage: int = 0) -> list[int]:
    return sorted(plan_placement(asked, usage, usage + room).raised)


def test_short_relevant_spans_beat_one_long_loosely_relevant_span():
    # A 255-token policy text ranks second; the plan keeps most relevance per byte, so it does not
    # crowd out the 40-token message that holds the answer.
    asked = _asked([0.62, 0.61, 0.50, 0.43, 0.34, 0.34, 0.29], [18, 255, 24, 40, 12, 25, 24])
    granted = _granted(asked, 310)
    assert 1 not in granted and {0, 2, 3} <= set(granted)
    assert sum(a.options[0].device_bytes for a in asked if a.span_id in granted) <= 310


def test_the_best_match_is_taken_first_when_it_fits():
    # The fitted parameter sits in a 317-token tool result that ranks first; two short messages
    # have more relevance per byte but do not hold the answer.
    asked = _asked([0.54, 0.52, 0.34, 0.25], [317, 26, 29, 21])
    assert _granted(asked, 329) == [0]
    # When it cannot fit, it is refused and the room it does not take goes back to the others.
    assert _granted(asked, 300) == [1, 2, 3]
    # Without its class, it would compete on value per byte and lose.
    assert 0 not in _granted(_asked([0.54, 0.52, 0.34, 0.25], [317, 26, 29, 21], best_first=False), 329)


def test_room_left_over_is_given_back():
    # The long span leaves first (least value per byte); the room it leaves fits the next one again.
    asked = _asked([0.9, 0.5, 0.45], [10, 200, 30])
    assert _granted(asked, 45) == [0, 2]


def test_a_span_larger_than_the_room_is_never_granted():
    assert _granted(_asked([0.9, 0.5], [1_000, 10]), 100) == [1]


def test_the_room_comes_from_spans_the_question_does_not_need():
    # An attended span of the rest class, 400 bytes, that may be archived: the promotion takes its room.
    rest = SpanOptions(
        50, 0.5, (RungOption(Rung.FULL, 400, 0.0), RungOption(Rung.ARCHIVED, 0, ARCHIVED)), klass=0, order=50
    )
    asked = _asked([0.3], [300])
    plan = plan_placement([rest, *asked], 400, 420)
    assert plan.raised == {0} and plan.rungs[50] is Rung.ARCHIVED and plan.rungs[0] is Rung.ATTENDED_Q
    assert plan.met and plan.device_bytes == 300


@settings(max_examples=200, deadline=None)
@given(
    items=st.lists(st.tuples(st.floats(0.01, 1.0), st.integers(1, 10_000)), min_size=1, max_size=20),
    room=st.integers(0, 50_000),
)
def test_granted_promotions_always_fit_and_none_refused_would_fit(items, room):
    items.sort(key=lambda item: -item[0])
    asked = _asked([score for score, _ in items], [cost for _, cost in items])
    plan = plan_placement(asked, 0, room)
    used = sum(a.options[0].device_bytes for a in asked if a.span_id in plan.raised)
    assert plan.met and used == plan.device_bytes <= room
    assert plan.raised == {i for i, rung in plan.rungs.items() if rung is Rung.ATTENDED_Q}
    # The best rung the limit allows: no refused promotion fits in the room left.
    assert all(used + a.options[0].device_bytes > room for a in asked if a.span_id not in plan.raised)
    if sum(cost for _, cost in items) <= room:
        assert plan.raised == set(range(len(items)))
