"""What each span may cost at each rung, read from the store: the planner's inputs (`SpanOptions`).

`span_options` turns the span table, the recall marks and the store's byte figures
into `SpanOptions` for `agentkv.lifecycle.placement.plan_placement`:

- an evictable span may be dropped, at no value (the grace queue goes first, oldest first);
- an attended span may be held quantized in attention (the store's attended tier: the
  tokens it would quantize now, sinks and residual window excepted), at 8-bit keys
  (`Rung.KEYS8`, where the tier holds them) and at the tier's floor bits
  (`Rung.ATTENDED_Q`), each at the bytes the store counts for it (`attended_costs`),
  and, unless pinned or active, archived to the configured tier;
- a quantized archive (on the device) may be dropped.

A span's class is the lifecycle's prior: pinned spans above the current turn's active
spans, above the spans recall brought back or counts as needed by the current question,
above the rest; its value is the strategy's (the commit score), raised by its relevance
when recall brought it back. Pinned and active spans have no archive step at all.
"""

from __future__ import annotations

from collections.abc import Mapping

from agentkv.lifecycle.marks import RecallMarks
from agentkv.lifecycle.rungs import (
    DEFAULT_FIDELITY,
    NEEDED_CLASS,
    GreedyDualValue,
    PlacementStrategy,
    Rung,
    RungOption,
    SpanOptions,
)
from agentkv.spans import Span, SpanState, Tier
from agentkv.store.protocol import AttendedFloor, CostReporter, KVStoreProtocol, SpanCosts

REST, NEEDED, ACTIVE, PINNED = 0, NEEDED_CLASS, 2, 3
"""The lifecycle's classes, lowest first: a lower class gives up each kind of step before a higher one."""


def lifecycle_class(span: Span, marks: RecallMarks) -> int:
    """Pinned > active > recalled or needed by the current question > the rest."""
    if span.pinned:
        return PINNED
    if span.state is SpanState.ACTIVE:
        return ACTIVE
    if span.span_id in marks.recalled or span.span_id in marks.needed:
        return NEEDED
    return REST


def promotion(
    span_id: int,
    value: float,
    higher: RungOption,
    now: RungOption,
    *,
    klass: int,
    order: int,
    last: bool = False,
) -> SpanOptions:
    """One promotion the plan may grant: `higher` (what it would hold there) above the rung it is on now.

    A recalled span's return to attention is its span's own options (`higher`: attended,
    `now`: archived or dropped); an exact recompute's page is a unit of its own
    (`higher`: its extra bytes at full precision, `now`: none).
    """
    return SpanOptions(span_id, value, (higher, now), klass=klass, order=order, current=1, last=last)


def pending_options(
    tokens: int,
    floor: AttendedFloor | None,
    exact_token_bytes: int,
    fidelity: Mapping[Rung, float] = DEFAULT_FIDELITY,
) -> SpanOptions | None:
    """The next prefill's tokens (the new message): exact when encoded, quantizable by the budget after.

    They hold nothing yet, so their exact bytes are the plan's to place: at full precision,
    at 8-bit keys where the tier holds them, and at the tier's floor bits, never out of
    attention (they are the active turn's). None without pending tokens.
    """
    if tokens <= 0:
        return None
    exact = tokens * exact_token_bytes
    options = [RungOption(Rung.FULL, exact, 0.0)]
    if floor is not None:
        if floor.fine_token_bytes:
            fine = floor.span_cost(tokens) + tokens * floor.fine_token_bytes
            options.append(RungOption(Rung.KEYS8, fine, fidelity[Rung.KEYS8]))
        options.append(RungOption(Rung.ATTENDED_Q, floor.span_cost(tokens), fidelity[Rung.ATTENDED_Q]))
    return SpanOptions(PENDING_ID, 1.0, tuple(options), klass=ACTIVE, order=1 << 62)


PENDING_ID = -1
"""The plan's id for the next prefill's tokens (`pending_options`)."""


def span_options(
    spans: list[Span],
    store: KVStoreProtocol,
    marks: RecallMarks,
    *,
    archive_tier: str,
    strategy: PlacementStrategy | None = None,
    fidelity: Mapping[Rung, float] = DEFAULT_FIDELITY,
    relevance: Mapping[int, float] | None = None,
    klass_of: Mapping[int, int] | None = None,
    attended: frozenset[int] = frozenset(),
) -> list[SpanOptions]:
    """Every span that may move under pressure, with its rungs (current first) and its value.

    Args:
        spans: the session's spans.
        store: where their KV is (each attended span's bytes at each rung: `attended_costs`).
        marks: this turn's recall marks (recalled and needed spans weigh more).
        archive_tier: where an archived span goes (`host`, `int8`, `int4`, `drop`).
        strategy: the span's value (default: GreedyDual-Size on the commit score).
        fidelity: the fraction of a span's value lost at each rung.
        relevance: each span's relevance to the current question, where recall asks the plan
            before it marks anything (default: the marks' recalled spans').
        klass_of: classes that override the lifecycle's (recall's best match).
        attended: spans that stay attended whatever the plan (an exact recompute's spans).
    """
    strategy = strategy or GreedyDualValue()
    relevance = marks.relevance if relevance is None else relevance
    klass_of = klass_of or {}
    in_attention = [s for s in spans if s.tier.attended]
    costs = store.attended_costs(in_attention) if isinstance(store, CostReporter) else {}
    out: list[SpanOptions] = []
    for span in spans:
        if span.state is SpanState.EVICTED:
            continue
        cost = costs.get(span.span_id)
        held = cost.now if cost is not None else store.span_bytes(span)
        if span.state is SpanState.EVICTABLE:
            # The grace queue: what it holds on the device goes first (the host budget sees the rest),
            # an attended span quantized before it is dropped (its quantized rungs may close the gap).
            if span.pinned:
                continue
            if span.tier.attended and span.held_tokens:
                drop = RungOption(Rung.DROPPED, 0, fidelity[Rung.DROPPED])
                rungs = (*_attended_rungs(span, cost, held, fidelity), drop)
                out.append(SpanOptions(span.span_id, 0.0, rungs, order=span.start, released=True))
            elif span.tier is Tier.QUANTIZED:
                out.append(_droppable(span, held, value=0.0, fidelity=fidelity, released=True))
            continue
        klass = klass_of.get(span.span_id, lifecycle_class(span, marks))
        weight = 1.0 + max(0.0, relevance.get(span.span_id, 0.0))
        value = strategy.value(span.span_id, span.score, span.held_tokens, weight)
        if span.tier is Tier.QUANTIZED:
            if not span.pinned:
                out.append(_droppable(span, held, value=value, fidelity=fidelity, klass=klass))
            continue
        if not span.tier.attended or not span.held_tokens:
            continue
        options = _attended_rungs(span, cost, held, fidelity)
        if not span.pinned and span.state is SpanState.COMMITTED and span.span_id not in attended:
            options += _leaving_rungs(cost, held, archive_tier, fidelity)
        if len(options) >= 2:
            hard = span.span_id in marks.recalled
            rungs = tuple(options)
            out.append(SpanOptions(span.span_id, value, rungs, klass=klass, order=span.start, hard=hard))
    return out


def _droppable(
    span: Span,
    held: int,
    *,
    value: float,
    fidelity: Mapping[Rung, float],
    klass: int = REST,
    released: bool = False,
) -> SpanOptions:
    now = Rung.ARCHIVED if span.state is SpanState.ARCHIVED else Rung.FULL
    options = (
        RungOption(now, held, fidelity[now] if value else 0.0),
        RungOption(Rung.DROPPED, 0, fidelity[Rung.DROPPED]),
    )
    return SpanOptions(span.span_id, value, options, klass=klass, order=span.start, released=released)


def _attended_rungs(
    span: Span, cost: SpanCosts | None, held: int, fidelity: Mapping[Rung, float]
) -> list[RungOption]:
    """The span's rung now and the attended rungs below it, at the store's own byte counts.

    A span's loss at an attended rung is each rung's fidelity cost weighted by the share
    of its held slots there: the sinks and the residual window stay exact at every rung.
    A span with some keys at 8 bits is on `Rung.KEYS8` now; its step to `Rung.ATTENDED_Q`
    drops their fine planes (and quantizes what is left to quantize).
    """
    if cost is None:  # a store without an attended quantized tier: the span is held as it is
        return [RungOption(Rung.FULL, held, 0.0)]
    slots = cost.held or 1
    keys8, coarse = fidelity[Rung.KEYS8], fidelity[Rung.ATTENDED_Q]

    def loss(fine: int, coarse_slots: int) -> float:
        return (fine * keys8 + coarse_slots * coarse) / slots

    coarse_now = cost.quantized - cost.fine
    now = Rung.KEYS8 if cost.fine else Rung.ATTENDED_Q if cost.quantized else Rung.FULL
    options = [RungOption(now, cost.now, loss(cost.fine, coarse_now))]
    if cost.keys8 is not None and cost.quantizable:
        options.append(RungOption(Rung.KEYS8, cost.keys8, loss(cost.fine + cost.quantizable, coarse_now)))
    if cost.coarse < cost.now:
        options.append(RungOption(Rung.ATTENDED_Q, cost.coarse, loss(0, cost.quantized + cost.quantizable)))
    return options


def _leaving_rungs(
    cost: SpanCosts | None, held: int, archive_tier: str, fidelity: Mapping[Rung, float]
) -> list[RungOption]:
    """Archived (on the configured tier, at the store's count) and, for an archive on the device, dropped.

    A store that reports no costs archives to the host or drops: nothing stays on the device.
    An archive on the host holds the store's host count (`SpanCosts.host`; without costs, the
    span's bytes now), which the host budget plans with (`host_options`).
    """
    archived = host = 0
    if cost is not None and archive_tier in ("int8", "int4"):
        archived = cost.int8 if archive_tier == "int8" else cost.int4
    if archive_tier == "host":
        host = cost.host if cost is not None else held
    loss = fidelity[Rung.DROPPED] if archive_tier == "drop" else fidelity[Rung.ARCHIVED]
    options = [RungOption(Rung.ARCHIVED, archived, loss, host_bytes=host)]
    if archived:  # an archive on the device: dropping the span frees what the archive would keep
        options.append(RungOption(Rung.DROPPED, 0, fidelity[Rung.DROPPED]))
    return options


def host_options(
    spans: list[Span],
    store: KVStoreProtocol,
    marks: RecallMarks,
    *,
    arriving: Mapping[int, int] | None = None,
    strategy: PlacementStrategy | None = None,
    fidelity: Mapping[Rung, float] = DEFAULT_FIDELITY,
) -> list[SpanOptions]:
    """The spans on the host, each with its host bytes and one step down: dropped.

    The host budget's resource, planned by the same planner as the device's (the
    options' `device_bytes` are host bytes here): the grace queue first, then the least
    value lost per byte. `arriving`: spans the device's plan archives to the host (span
    id -> the host bytes their archive will hold); one the host cannot hold is dropped
    instead of copied there first. A span recalled for this turn stays.
    """
    strategy = strategy or GreedyDualValue()
    arriving = arriving or {}
    out: list[SpanOptions] = []
    for span in spans:
        if span.span_id in marks.recalled or span.state is SpanState.EVICTED or span.pinned:
            continue
        klass = lifecycle_class(span, marks)
        if span.span_id in arriving:
            value = strategy.value(span.span_id, span.score, span.held_tokens, 1.0)
            options = (
                RungOption(Rung.ARCHIVED, arriving[span.span_id], fidelity[Rung.ARCHIVED]),
                RungOption(Rung.DROPPED, 0, fidelity[Rung.DROPPED]),
            )
            out.append(SpanOptions(span.span_id, value, options, klass=klass, order=span.start))
            continue
        if span.tier is not Tier.HOST:
            continue
        released = span.state is SpanState.EVICTABLE
        value = 0.0 if released else strategy.value(span.span_id, span.score, span.held_tokens, 1.0)
        held = store.span_bytes(span)
        out.append(_droppable(span, held, value=value, fidelity=fidelity, klass=klass, released=released))
    return out
