"""What each span may cost at each rung, read from the store: the planner's inputs.

`span_options` turns the span table, the recall marks and the store's byte figures
into `SpanOptions` for `agentkv.lifecycle.placement.plan_placement`:

- an evictable span may be dropped, at no value (the grace queue goes first, oldest first);
- an attended span may be held quantized in attention (the store's attended tier: the
  tokens it would quantize now, sinks and residual window excepted) and, unless pinned,
  active or under a lease of this turn, archived to the configured tier;
- a quantized archive (on the device) may be dropped.

A span's class is the lifecycle's prior: pinned spans above the current turn's active
spans, above the spans recall brought back or counts as needed by the current question,
above the rest; its value is the strategy's (the commit score), raised by its relevance
when recall brought it back. Pinned and active spans have no archive step at all.
"""

from __future__ import annotations

from collections.abc import Mapping

from agentkv.lifecycle.marks import RecallMarks
from agentkv.lifecycle.placement import (
    DEFAULT_FIDELITY,
    NEEDED_CLASS,
    GreedyDualValue,
    PlacementStrategy,
    Rung,
    RungOption,
    SpanOptions,
)
from agentkv.spans import Span, SpanState, Tier
from agentkv.store.protocol import AttendedFloor, AttendedQuantizer, KVStoreProtocol

REST, NEEDED, ACTIVE, PINNED = 0, NEEDED_CLASS, 2, 3
"""The lifecycle's classes, lowest first: a lower class gives up each kind of step before a higher one."""

ARCHIVE_DEVICE_SHARE: Mapping[str, float] = {"host": 0.0, "drop": 0.0, "int8": 0.3, "int4": 0.16}
"""Device bytes of an archived span per full-precision byte, by archive tier (codes plus statistics)."""


def lifecycle_class(span: Span, marks: RecallMarks) -> int:
    """Pinned > active > recalled or needed by the current question > the rest."""
    if span.pinned:
        return PINNED
    if span.state is SpanState.ACTIVE:
        return ACTIVE
    if span.span_id in marks.recalled or span.span_id in marks.needed:
        return NEEDED
    return REST


def relevance_weight(span: Span, marks: RecallMarks) -> float:
    """A span recalled for the current question weighs more by its relevance (1 = no raise)."""
    return 1.0 + max(0.0, marks.relevance.get(span.span_id, 0.0))


def span_options(
    spans: list[Span],
    store: KVStoreProtocol,
    marks: RecallMarks,
    *,
    archive_tier: str,
    token_bytes: int,
    strategy: PlacementStrategy | None = None,
    fidelity: Mapping[Rung, float] = DEFAULT_FIDELITY,
) -> list[SpanOptions]:
    """Every span that may move under pressure, with its rungs (current first) and its value.

    Args:
        spans: the session's spans.
        store: where their KV is (byte figures; the attended tier's floor).
        marks: this turn's recall marks (recalled and needed spans weigh more).
        archive_tier: where an archived span goes (`host`, `int8`, `int4`, `drop`).
        token_bytes: one full-precision token's device bytes (all layers, keys and values).
        strategy: the span's value (default: GreedyDual-Size on the commit score).
        fidelity: the fraction of a span's value lost at each rung.
    """
    strategy = strategy or GreedyDualValue()
    quantizer = store if isinstance(store, AttendedQuantizer) else None
    floor = quantizer.attended_floor() if quantizer is not None else None
    counts = quantizer.attended_token_counts([s for s in spans if s.tier.attended]) if quantizer else {}
    out: list[SpanOptions] = []
    for span in spans:
        if span.state is SpanState.EVICTED:
            continue
        if span.state is SpanState.EVICTABLE:
            # The grace queue: what it holds on the device goes first (the host budget sees the rest).
            if not span.pinned and (span.tier.attended or span.tier is Tier.QUANTIZED):
                out.append(
                    _droppable(span, store.span_bytes(span), value=0.0, fidelity=fidelity, released=True)
                )
            continue
        klass = lifecycle_class(span, marks)
        value = strategy.value(span.span_id, span.score, span.held_tokens, relevance_weight(span, marks))
        if span.tier is Tier.QUANTIZED:
            if not span.pinned:
                out.append(
                    _droppable(span, store.span_bytes(span), value=value, fidelity=fidelity, klass=klass)
                )
            continue
        if not span.tier.attended:
            continue
        held = counts.get(span.span_id, (0, 0))
        choice = _attended(span, held, floor, value, klass, archive_tier, token_bytes, fidelity, marks)
        if choice is not None:
            out.append(choice)
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


def _attended(
    span: Span,
    counts: tuple[int, int],
    floor: AttendedFloor | None,
    value: float,
    klass: int,
    archive_tier: str,
    token_bytes: int,
    fidelity: Mapping[Rung, float],
    marks: RecallMarks,
) -> SpanOptions | None:
    held = span.held_tokens
    if not held:
        return None
    exact = floor.exact_token_bytes if floor is not None else token_bytes
    quantized_now, more = counts  # slots held quantized now; slots the tier would quantize now
    if span.tier is not Tier.ATTENDED_QUANTIZED:
        quantized_now = 0
    attended_q = fidelity[Rung.ATTENDED_Q]
    share = quantized_now / held
    now_bytes = (held - quantized_now) * exact + (
        quantized_now * floor.token_bytes if floor is not None else 0
    )
    now = RungOption(Rung.ATTENDED_Q if quantized_now else Rung.FULL, now_bytes, attended_q * share)
    options = [now]
    if floor is not None and more:
        saved = more * max(0, exact - floor.token_bytes)
        loss = attended_q * (quantized_now + more) / held
        options.append(RungOption(Rung.ATTENDED_Q, now_bytes - saved, loss))
    archivable = not span.pinned and span.state is SpanState.COMMITTED
    if archivable:
        archived = int(held * exact * ARCHIVE_DEVICE_SHARE.get(archive_tier, 0.0))
        loss = fidelity[Rung.DROPPED] if archive_tier == "drop" else fidelity[Rung.ARCHIVED]
        options.append(RungOption(Rung.ARCHIVED, archived, loss))
        if archived:  # an archive on the device: dropping the span frees what the archive would keep
            options.append(RungOption(Rung.DROPPED, 0, fidelity[Rung.DROPPED]))
    if len(options) < 2:
        return None
    hard = span.span_id in marks.recalled
    return SpanOptions(span.span_id, value, tuple(options), klass=klass, order=span.start, hard=hard)
