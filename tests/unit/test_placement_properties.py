"""Property tests of the one placement plan on simulated spans (hypothesis; no model).

Random span tables (classes, states, pins, sizes, 8-bit keys held or not) with the store's
costs per rung, planned to random targets. Whatever the input:

- the limit is met whenever some rung per span meets it (each span at its cheapest
  allowed rung is the least that can be held), and the plan's total is what its rungs cost;
- pinned and active spans never leave attention;
- no span leaves attention while another span still holds a fine key plane whose step
  to 4-bit keys loses less per byte than leaving (8-bit keys drop to 4 before anything leaves);
- more room never loses more value, and never holds fewer spans in attention;
- bounded by the limit (`spare_above`), no span leaves attention while every span fits
  under the limit at its cheapest attended rung;
- promotions (archived spans asking to come back) in the same plan: the limit still holds
  whenever it can, none is granted while it is unmet, and none refused would fit in the
  room the plan leaves.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from agentkv.lifecycle.marks import RecallMarks
from agentkv.lifecycle.options import host_options, promotion, span_options
from agentkv.lifecycle.placement import Placement, plan_placement, step_chain
from agentkv.lifecycle.rungs import (
    ATTENDED_RUNGS,
    DEFAULT_FIDELITY,
    NEEDED_CLASS,
    PROMOTION_CLASS,
    Rung,
    RungOption,
)
from agentkv.spans import Span, SpanKind, SpanState, Tier
from agentkv.store.protocol import SpanCosts

EXACT, COARSE, FINE = 64, 10, 4


@dataclass
class Table:
    spans: list[Span]
    costs: dict[int, SpanCosts]

    def attended_costs(self, spans: list[Span]) -> dict[int, SpanCosts]:
        return {s.span_id: self.costs[s.span_id] for s in spans if s.span_id in self.costs}

    def span_bytes(self, span: Span) -> int:
        return self.costs[span.span_id].now


@st.composite
def tables(draw: st.DrawFn) -> Table:
    spans: list[Span] = []
    costs: dict[int, SpanCosts] = {}
    for i in range(draw(st.integers(1, 12))):
        slots = draw(st.integers(1, 300))
        state = draw(st.sampled_from([SpanState.COMMITTED, SpanState.COMMITTED, SpanState.ACTIVE]))
        span = Span(i, SpanKind.TOOL_RESULT, list(range(slots)), i * 1000, owner=f"s{i}")
        span.n_computed, span.state = slots, state
        span.score = draw(st.floats(0, 5))
        if draw(st.integers(0, 5)) == 0:
            span.leases.add(i + 1)  # pinned
        exact = draw(st.integers(0, min(slots, 8)))  # sinks and residual window: never quantized
        quantized = draw(st.integers(0, slots - exact))
        fine = draw(st.integers(0, quantized))
        more = slots - exact - quantized
        span.tier = Tier.ATTENDED_QUANTIZED if quantized else Tier.DEVICE
        now = (exact + more) * EXACT + quantized * COARSE + fine * FINE
        keys8 = exact * EXACT + (quantized + more) * COARSE + (fine + more) * FINE
        coarse = exact * EXACT + (quantized + more) * COARSE
        costs[i] = SpanCosts(slots, quantized, fine, more, now, keys8, coarse)
        spans.append(span)
    return Table(spans, costs)


def _plan(table: Table, target: int) -> tuple[Placement, dict[int, list[tuple[Rung, int]]]]:
    options = span_options(table.spans, table, RecallMarks(), archive_tier="drop")  # type: ignore[arg-type]
    usage = sum(c.now for c in table.costs.values())
    chains = {o.span_id: [(r.rung, r.device_bytes) for r in o.options] for o in options}
    return plan_placement(options, usage, target), chains


def _floor(table: Table) -> int:
    """The least the table can be held in: pinned and active spans at 4-bit keys, the rest out."""
    return sum(
        c.coarse if table.spans[i].pinned or table.spans[i].state is SpanState.ACTIVE else 0
        for i, c in table.costs.items()
    )


def _bytes(plan: Placement, chains: dict[int, list[tuple[Rung, int]]], table: Table) -> int:
    total = 0
    for span_id, cost in table.costs.items():
        rung = plan.rungs.get(span_id)
        if rung is None:
            total += cost.now
        else:
            total += min(b for r, b in chains[span_id] if r is rung)
    return total


@settings(max_examples=200, deadline=None)
@given(tables(), st.floats(0, 1.2))
def test_the_limit_holds_whenever_a_rung_per_span_meets_it(table: Table, share: float) -> None:
    usage = sum(c.now for c in table.costs.values())
    target = int(usage * share)
    plan, chains = _plan(table, target)
    assert plan.device_bytes == _bytes(plan, chains, table)
    if target >= _floor(table):
        assert plan.met and plan.device_bytes <= target
    for span in table.spans:
        if span.pinned or span.state is SpanState.ACTIVE:
            assert plan.rungs.get(span.span_id, Rung.FULL) in ATTENDED_RUNGS


@settings(max_examples=200, deadline=None)
@given(tables(), st.floats(0, 1.0))
def test_no_span_leaves_while_a_fine_plane_could_go(table: Table, share: float) -> None:
    usage = sum(c.now for c in table.costs.values())
    plan, _ = _plan(table, int(usage * share))
    options = span_options(table.spans, table, RecallMarks(), archive_tier="drop")  # type: ignore[arg-type]
    left = [i for i, r in plan.rungs.items() if r not in ATTENDED_RUNGS]
    if not left:
        return
    f8, fq = DEFAULT_FIDELITY[Rung.KEYS8], DEFAULT_FIDELITY[Rung.ATTENDED_Q]
    assert f8 < fq
    for option in options:
        if option.span_id in left:
            continue
        # A span whose step to 4-bit keys loses less per byte than leaving keeps that step on its chain.
        coarsens = [r.rung for r in step_chain(option.options)][-2:] == [Rung.KEYS8, Rung.ATTENDED_Q]
        rung = plan.rungs.get(option.span_id)
        assert not coarsens or rung is Rung.ATTENDED_Q, (option.span_id, rung, table.costs[option.span_id])


@settings(max_examples=150, deadline=None)
@given(tables(), st.floats(0, 1.0), st.floats(0, 1.0))
def test_more_room_never_loses_more_value(table: Table, a: float, b: float) -> None:
    usage = sum(c.now for c in table.costs.values())
    small, large = sorted((int(usage * a), int(usage * b)))
    tight, _ = _plan(table, small)
    roomy, _ = _plan(table, large)
    assert roomy.loss <= tight.loss + 1e-9
    left = lambda p: {i for i, r in p.rungs.items() if r not in ATTENDED_RUNGS}  # noqa: E731
    assert len(left(roomy)) <= len(left(tight))


@settings(max_examples=200, deadline=None)
@given(tables(), st.floats(0, 1.0), st.floats(0, 1.2))
def test_under_the_limit_no_span_leaves_attention(table: Table, share: float, limit_share: float) -> None:
    usage = sum(c.now for c in table.costs.values())
    target = int(usage * share)
    limit = max(target, int(usage * limit_share))
    options = span_options(table.spans, table, RecallMarks(), archive_tier="drop")  # type: ignore[arg-type]
    plan = plan_placement(options, usage, target, spare_above=limit)
    chains = [step_chain(o.options) for o in options]
    if not any(r.rung is Rung.KEYS8 for chain in chains for r in chain):
        return  # the bound holds only where 8-bit keys are in play
    if limit >= _floor(table):
        assert plan.device_bytes <= limit
    still = set(table.costs) - {o.span_id for o in options}  # spans that may not move stay as they are
    attended_floor = sum(min(r.device_bytes for r in chain if r.rung in ATTENDED_RUNGS) for chain in chains)
    attended_floor += sum(table.costs[i].now for i in still)
    if attended_floor <= limit:
        assert all(rung in ATTENDED_RUNGS for rung in plan.rungs.values()), plan.rungs


@st.composite
def host_tables(draw: st.DrawFn) -> tuple[list[Span], dict[int, int], RecallMarks]:
    spans: list[Span] = []
    held: dict[int, int] = {}
    marks = RecallMarks()
    for i in range(draw(st.integers(1, 10))):
        span = Span(i, SpanKind.TOOL_RESULT, list(range(5)), i * 10, owner=f"h{i}")
        span.state = draw(st.sampled_from([SpanState.ARCHIVED, SpanState.ARCHIVED, SpanState.EVICTABLE]))
        span.tier, span.score = Tier.HOST, draw(st.floats(0, 5))
        held[i] = draw(st.integers(1, 1000))
        if draw(st.integers(0, 4)) == 0:
            marks.recalled.add(i)
        spans.append(span)
    return spans, held, marks


@settings(max_examples=200, deadline=None)
@given(host_tables(), st.floats(0, 1.2))
def test_the_host_limit_holds_whenever_it_can_released_spans_first(
    table: tuple[list[Span], dict[int, int], RecallMarks], share: float
) -> None:
    spans, held, marks = table

    class Host:
        def span_bytes(self, span: Span) -> int:
            return held[span.span_id]

    usage = sum(held.values())
    target = int(usage * share)
    options = host_options(spans, Host(), marks)  # type: ignore[arg-type]
    plan = plan_placement(options, usage, target)
    kept = sum(held[i] for i in marks.recalled)
    if target >= kept:
        assert plan.met and plan.device_bytes <= target
    assert not set(plan.rungs) & marks.recalled, "a span recalled for this turn stays"
    evictable = {s.span_id for s in spans if s.state is SpanState.EVICTABLE}
    released = evictable - marks.recalled
    if set(plan.rungs) - released:
        assert released <= set(plan.rungs), "released spans leave the host before any other"


@settings(max_examples=200, deadline=None)
@given(
    tables(),
    st.lists(st.tuples(st.floats(0, 5), st.integers(1, 3000)), max_size=6),
    st.floats(0, 1.5),
    st.booleans(),
)
def test_a_recalled_span_is_placed_at_the_best_rung_the_limit_allows(
    table: Table, asked: list[tuple[float, int]], share: float, first: bool
) -> None:
    """Archived spans asking to come back share the plan with the spans held: both directions at once."""
    options = span_options(table.spans, table, RecallMarks(), archive_tier="drop")  # type: ignore[arg-type]
    promotions = [
        promotion(
            100 + i,
            value,
            RungOption(Rung.ATTENDED_Q, cost, DEFAULT_FIDELITY[Rung.ATTENDED_Q]),
            RungOption(Rung.ARCHIVED, 0, DEFAULT_FIDELITY[Rung.ARCHIVED]),
            klass=PROMOTION_CLASS if first and i == 0 else NEEDED_CLASS,
            order=100 + i,
        )
        for i, (value, cost) in enumerate(asked)
    ]
    usage = sum(c.now for c in table.costs.values())
    target = int((usage + sum(cost for _, cost in asked)) * share)
    plan = plan_placement([*options, *promotions], usage, target)
    if target >= _floor(table):
        assert plan.met, "refusing every promotion and demoting the rest would meet it"
    for span in table.spans:
        if span.pinned or span.state is SpanState.ACTIVE:
            assert plan.rungs.get(span.span_id, Rung.FULL) in ATTENDED_RUNGS
    granted = {p.span_id for p in promotions} & plan.raised
    assert granted == {i for i, r in plan.rungs.items() if i >= 100}
    if plan.met:
        for p in promotions:
            if p.span_id not in granted:
                assert plan.device_bytes + p.options[0].device_bytes > target, "a refused promotion would fit"
    else:
        assert not granted, "no promotion is granted while the limit is unmet"
