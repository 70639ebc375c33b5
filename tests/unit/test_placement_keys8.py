"""8-bit keys as a planned rung: every span quantized before any fine plane goes, none leaving first.

A span with 8-bit keys steps `KEYS8 -> ATTENDED_Q` (its fine planes dropped) in the planner's
order: every span is quantized (to 8-bit keys) before any fine plane goes, fine planes go the
lowest class first, and every attended step of every span comes before any span leaves
attention. Bounded by the limit (`spare_above`), fine planes go and spans leave only while
the total is over it.
"""

from __future__ import annotations

from agentkv.lifecycle.marks import RecallMarks
from agentkv.lifecycle.options import ACTIVE, PINNED, REST, span_options
from agentkv.lifecycle.placement import plan_placement
from agentkv.lifecycle.rungs import DEFAULT_FIDELITY, Rung, RungOption, SpanOptions
from agentkv.spans import Span, SpanKind, SpanState, Tier
from agentkv.store.protocol import SpanCosts

EXACT, COARSE, FINE = 64, 10, 4
"""Bytes of one slot: full precision, quantized at 4-bit keys, and what 8-bit keys add."""


def _keys8(span_id: int, slots: int, klass: int, *, fine: bool = True, value: float = 1.0) -> SpanOptions:
    """A committed span held quantized (at 8-bit keys when `fine`), archivable unless pinned or active."""
    now = RungOption(
        Rung.KEYS8 if fine else Rung.ATTENDED_Q, slots * (COARSE + FINE * fine), 0.05 if fine else 0.25
    )
    options = [now]
    if fine:
        options.append(RungOption(Rung.ATTENDED_Q, slots * COARSE, 0.25))
    if klass == REST:
        options.append(RungOption(Rung.DROPPED, 0, 1.0))
    return SpanOptions(span_id, value, tuple(options), klass=klass, order=span_id)


def _exact(span_id: int, slots: int, klass: int, *, value: float = 1.0) -> SpanOptions:
    """A span at full precision: 8-bit keys, then 4-bit keys, in attention (pinned or active: no further)."""
    options = (
        RungOption(Rung.FULL, slots * EXACT, 0.0),
        RungOption(Rung.KEYS8, slots * (COARSE + FINE), 0.05),
        RungOption(Rung.ATTENDED_Q, slots * COARSE, 0.25),
    )
    return SpanOptions(span_id, value, options, klass=klass, order=span_id)


def _usage(choices: list[SpanOptions]) -> int:
    return sum(c.options[0].device_bytes for c in choices)


def test_every_span_holds_8_bit_keys_before_any_drops_its_fine_planes() -> None:
    history = [_keys8(i, 200, REST) for i in range(1, 6)]  # 5 x 200 slots at 8-bit keys: 14,000 bytes
    result = _exact(10, 100, ACTIVE)  # the result the next call copies from: 6,400 bytes exact
    choices = [*history, result]
    usage = _usage(choices)
    # Quantizing the result to 8-bit keys frees 5,000 bytes: enough, and every fine plane stays.
    plan = plan_placement(choices, usage, usage - 3_000)
    assert plan.met and plan.rungs == {10: Rung.KEYS8}
    # More than that: then fine planes go, the lowest class first, and nothing leaves attention.
    plan = plan_placement(choices, usage, usage - 6_000)
    assert plan.met and plan.rungs[10] is Rung.KEYS8
    assert {plan.rungs[i] for i in range(1, 6) if i in plan.rungs} == {Rung.ATTENDED_Q}


def test_every_fine_plane_goes_before_any_span_leaves_attention() -> None:
    choices = [_keys8(i, 200, REST, value=10.0 if i % 2 else 0.1) for i in range(1, 7)]
    choices.append(_keys8(20, 300, PINNED))
    usage = _usage(choices)
    all_coarse = sum(c.options[1].device_bytes for c in choices)
    plan = plan_placement(choices, usage, all_coarse - 1)  # one byte below every key at 4 bits
    assert plan.met
    left = [i for i, r in plan.rungs.items() if r is Rung.DROPPED]
    assert left and all(plan.rungs[c.span_id] in (Rung.ATTENDED_Q, Rung.DROPPED) for c in choices)
    assert plan.rungs[20] is Rung.ATTENDED_Q  # pinned: its fine planes go, it never leaves
    assert all(c.value < 1 for c in choices if c.span_id in left)  # the least value per byte leaves


def test_a_pinned_prompt_steps_down_its_attended_rungs_until_the_limit_holds() -> None:
    # The tool descriptions, pinned, are over a third of the trace; the limit (12.5% of the
    # full-precision bytes) holds only with them at 4-bit keys and everything else out.
    prompt = _exact(1, 700, PINNED)
    rest = [_keys8(i, 150, REST) for i in range(2, 10)]
    active = _exact(20, 200, ACTIVE)
    choices = [prompt, *rest, active]
    full = (700 + 8 * 150 + 200) * EXACT
    target = full // 8
    plan = plan_placement(choices, _usage(choices), target)
    assert plan.met and plan.device_bytes <= target
    assert plan.rungs[1] is Rung.ATTENDED_Q and plan.rungs[20] is Rung.ATTENDED_Q
    # A limit under every span's cheapest attended rung cannot be met, and the plan says so.
    floor = (700 + 200) * COARSE
    assert not plan_placement(choices, _usage(choices), floor - 1).met


class _CostStore:
    """A store that reports `attended_costs` and nothing else the options need."""

    def __init__(self, costs: dict[int, SpanCosts]) -> None:
        self.costs = costs

    def attended_costs(self, spans: list[Span]) -> dict[int, SpanCosts]:
        return {s.span_id: self.costs[s.span_id] for s in spans if s.span_id in self.costs}

    def span_bytes(self, span: Span) -> int:
        return self.costs[span.span_id].now


def _span(span_id: int, length: int, *, pinned: bool = False, state: SpanState = SpanState.COMMITTED) -> Span:
    span = Span(span_id, SpanKind.TOOL_RESULT, list(range(length)), span_id * 1000, owner=f"s{span_id}")
    span.n_computed = length
    span.state, span.tier = state, Tier.ATTENDED_QUANTIZED
    if pinned:
        span.leases.add(1)  # a lease of the span table's: a receipt, here without its table
    return span


def test_span_options_read_every_attended_rung_from_the_store() -> None:
    partly = SpanCosts(held=100, quantized=60, fine=40, quantizable=30, now=5000, keys8=3500, coarse=2700)
    pinned = SpanCosts(held=50, quantized=0, fine=0, quantizable=40, now=3200, keys8=1300, coarse=1100)
    spans = [_span(1, 100), _span(2, 50, pinned=True)]
    spans[1].tier = Tier.DEVICE
    store = _CostStore({1: partly, 2: pinned})
    options = span_options(spans, store, RecallMarks(), archive_tier="drop")  # type: ignore[arg-type]
    by_id = {o.span_id: o for o in options}
    f8, fq = DEFAULT_FIDELITY[Rung.KEYS8], DEFAULT_FIDELITY[Rung.ATTENDED_Q]
    first = by_id[1].options
    assert [o.rung for o in first] == [Rung.KEYS8, Rung.KEYS8, Rung.ATTENDED_Q, Rung.ARCHIVED]
    assert [o.device_bytes for o in first] == [5000, 3500, 2700, 0]
    assert abs(first[0].fidelity - (40 * f8 + 20 * fq) / 100) < 1e-12
    assert abs(first[1].fidelity - (70 * f8 + 20 * fq) / 100) < 1e-12
    assert abs(first[2].fidelity - 90 * fq / 100) < 1e-12
    second = by_id[2].options  # pinned: attended rungs only
    assert [o.rung for o in second] == [Rung.FULL, Rung.KEYS8, Rung.ATTENDED_Q]
    assert [o.device_bytes for o in second] == [3200, 1300, 1100]


def test_under_the_limit_no_span_leaves_attention_and_no_more_fine_planes_are_dropped() -> None:
    history = [_keys8(i, 200, REST) for i in range(1, 6)]  # 14,000 bytes at 8-bit keys
    result = _exact(10, 100, ACTIVE)  # 6,400 bytes exact; 1,400 at 8-bit keys
    released = SpanOptions(
        20,
        0.0,
        (RungOption(Rung.FULL, 640, 0.0), RungOption(Rung.DROPPED, 0, 1.0)),
        klass=REST,
        order=20,
        released=True,
    )
    choices = [*history, result, released]
    usage = _usage(choices)  # 21,040
    target, limit = usage - 15_000, usage - 8_000
    # Unbounded, the plan reaches the low watermark by taking old spans out of attention.
    plan = plan_placement(choices, usage, target)
    assert plan.met and Rung.DROPPED in {plan.rungs[i] for i in range(1, 6)}
    # Bounded by the limit: the released call goes and the result is quantized; over the limit
    # still, old spans drop their fine planes until it holds; under it nothing else moves.
    plan = plan_placement(choices, usage, target, spare_above=limit)
    assert plan.rungs == {
        20: Rung.DROPPED,
        10: Rung.KEYS8,
        1: Rung.ATTENDED_Q,
        2: Rung.ATTENDED_Q,
        3: Rung.ATTENDED_Q,
    }
    assert not plan.met and plan.device_bytes == usage - 640 - 5_000 - 3 * 800 <= limit
    # Without 8-bit keys in play the bound does not hold: the plan goes to the low watermark.
    coarse = [_keys8(i, 200, REST, fine=False) for i in range(1, 6)]
    usage = _usage(coarse)
    plan = plan_placement(coarse, usage, usage - 4_000, spare_above=usage - 1_000)
    assert plan.met and set(plan.rungs.values()) == {Rung.DROPPED}
