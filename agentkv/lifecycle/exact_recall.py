"""Exact recall: a relevant span the budget holds quantized is recomputed at full precision.

Quantization noise is small on average but not on what a question asks to quote: a
digit of a code or a letter of a name can flip at int4, while the same span at full
precision is copied exactly. Recall knows which attended spans the new user message
needs (`agentkv.lifecycle.recall`); those the attended quantized tier holds at int4
are recomputed from their token ids, as far as the placement plan grants.

A relevant span longer than `WHOLE_SPAN_PAGES` pages is recomputed in part first:
its pages (`agentkv.lifecycle.exact_pages`) that the caller ranks as relevant are
recomputed in full precision, best first; the rest of the span stays attended at
int4. The pages next to the chosen ones come next (the following page first): a log
entry or a table row often continues on the line after the one the question's words
match. The room goes to what the question needs most densely: a 600-token tool
result that ranks second on a word it shares with the question must not take, whole,
the room the line holding the answer in the third span needs. Only room left over
recomputes the rest of the long spans. A page is recomputed over the cache as it is
(the span's own earlier tokens at int4 included) and replaces the quantized KV of
its tokens.

Which upgrades happen is the placement plan's choice, not a room this module
predicts: every upgrade is a promotion (its extra bytes at full precision), planned
with every span and the new message's tokens down to the low watermark
(`Placer.plan_promotions`). A unit's value is its span's relevance per token, so the
plan keeps what the question needs most densely; pages the question's words are not
on weigh nothing and take only room left over. An upgrade is given up after every
span is held quantized, before any fine key plane is dropped or any span leaves
attention; with 8-bit keys in play neither happens for an upgrade at all. The
question's best match (its best page with its neighbours, or the whole span) is given
up last: when everything quantized cannot make its room, the spans the question does
not need leave attention for it (least value first; they stay recallable from their
token ids), and those moves are made now (the budget after the prefill quantizes
before it archives, and would take the room back). A tight budget thereby holds the
answer's source exact and drops what the question does not read, where holding
everything at int4 would leave no room to recompute anything. A recomputed span
attends its context as the cache holds it now (partly quantized): exact up to that
context, as any rehydration.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from agentkv.lifecycle.exact_pages import RankedPages
from agentkv.lifecycle.options import promotion
from agentkv.lifecycle.placer import PlacementPeer, Placer
from agentkv.lifecycle.rungs import ATTENDED_RUNGS, PROMOTION_CLASS, Rung, RungOption, SpanOptions
from agentkv.lifecycle.timing import SectionTimer
from agentkv.spans import Span, SpanState, Tier
from agentkv.store.protocol import AttendedFloor, AttendedQuantizer

WHOLE_SPAN_PAGES = 2
"""A relevant span of at most this many pages is recomputed whole; a longer one page by page, best first."""


@dataclass(frozen=True)
class _Unit:
    """One upgrade to full precision: a span whole (`offsets` None) or some of its quantized tokens."""

    span: Span
    offsets: list[int] | None
    options: SpanOptions


class ExactRecall(PlacementPeer):
    """Recomputes the relevant spans held quantized in attention at full precision."""

    def __init__(self, placer: Placer, timer: SectionTimer, *, enabled: bool) -> None:
        super().__init__(placer, timer)
        self.enabled = enabled

    def recompute(
        self,
        spans: list[Span],
        floor: AttendedFloor | None,
        pages: RankedPages | None = None,
        scores: Mapping[int, float] | None = None,
    ) -> list[int]:
        """Recompute `spans` (relevant, attended, best first) that are held quantized, as the plan grants.

        Each upgrade is a promotion the placement service plans with every span (`_units`):
        a span of at most `WHOLE_SPAN_PAGES` pages whole, a longer one by its pages (when
        `pages` ranks them and the session can recompute single tokens). `scores`: each
        span's relevance (default: by rank).

        Returns:
            Ids of the spans recomputed at full precision, whole or in part.
        """
        store = self.port.store
        placer = self.placer
        limit = placer.effective_limit()
        if not self.enabled or floor is None or limit is None or not isinstance(store, AttendedQuantizer):
            return []
        quantized = [s for s in spans if s.tier is Tier.ATTENDED_QUANTIZED]
        if not quantized:
            return []
        if not self.port.recomputes_offsets:
            pages = None
        if scores is None:
            scores = {s.span_id: 1.0 / (i + 1) for i, s in enumerate(quantized)}
        extra_per_token = max(0, floor.exact_token_bytes - floor.token_bytes)
        units = self._units(store, quantized, pages, scores, extra_per_token)
        plan = placer.plan_promotions(
            [u.options for u in units],
            placer.limits.low_bytes(limit),
            keep_attended=frozenset({quantized[0].span_id, *self.marks.recalled}),  # recall's stay
            spare=True,
        )
        leaving = {i for i, rung in plan.rungs.items() if rung not in ATTENDED_RUNGS}
        granted = [u for u in units if u.options.span_id in plan.raised and u.span.span_id not in leaving]
        if not granted:
            return []
        whole = [u.span for u in granted if u.offsets is None]
        by_span: dict[int, tuple[Span, list[int]]] = {}
        for unit in granted:
            if unit.offsets is not None:
                by_span.setdefault(unit.span.span_id, (unit.span, []))[1].extend(unit.offsets)
        parts: list[tuple[Span, list[int]]] = []
        for span, offsets in by_span.values():
            if len(offsets) == len(store.quantized_offsets(span)):
                whole.append(span)  # every page back: recomputed whole, its tokens join the prefill
            else:
                parts.append((span, sorted(offsets)))
        exact: list[int] = []
        # Pages first: a whole span recomputed lazily waits for the prefill, and a page after it
        # in the conversation must attend it.
        with store.deferred_removal():  # one compaction for every span dropped here
            placer.apply_exits(plan)  # the budget after the prefill quantizes before it archives
            if parts and self._recompute_offsets(parts):
                exact += [span.span_id for span, _ in parts]
            for span in whole:
                if self._recompute(span):
                    self.table.counters.exact_recalled_tokens += span.length
                    exact.append(span.span_id)
        return exact

    def _units(
        self,
        store: AttendedQuantizer,
        spans: list[Span],
        pages: RankedPages | None,
        scores: Mapping[int, float],
        extra_per_token: int,
    ) -> list[_Unit]:
        """Every upgrade exact recall asks the plan for, in priority order.

        A unit's value is its span's relevance per token it makes exact: the plan keeps
        the most relevant per byte. The pages of a long span next to its relevant ones
        weigh as the span (a log entry or a table row often continues on the following
        line); its other pages weigh nothing and take only room left over. The question's
        best match (its best page with its neighbours, or the whole span) is given up
        last: after everything the question does not need has given up its steps. Ties go
        to the earlier unit (`order`).
        """
        fidelity = self.port.rung_fidelity()
        units: list[_Unit] = []

        def add(span: Span, offsets: list[int] | None, weight: float, last: bool = False) -> None:
            tokens = span.length if offsets is None else len(offsets)
            if not tokens:
                return
            unit_id = -2 - len(units)
            options = promotion(
                unit_id,
                weight * tokens,
                RungOption(Rung.FULL, tokens * extra_per_token, fidelity[Rung.FULL]),
                RungOption(Rung.ATTENDED_Q, 0, fidelity[Rung.ATTENDED_Q]),
                klass=PROMOTION_CLASS,
                order=-len(units),
                last=last,
            )
            units.append(_Unit(span, offsets, options))

        rest: list[tuple[Span, list[int]]] = []
        for rank, span in enumerate(spans):
            score = max(scores.get(span.span_id, 0.0), 0.0)
            cut = pages(span, store.quantized_offsets(span)) if pages is not None else None
            if cut is None or len(cut.pages) <= WHOLE_SPAN_PAGES:
                add(span, None, score, last=rank == 0)
                continue
            taken: list[int] = []
            for i, page in enumerate(cut.relevant):
                group = [page] if i else [page, *cut.context([page])]
                group = [j for j in group if j not in taken]
                add(span, [o for j in group for o in cut.pages[j]], score, last=rank == 0 and i == 0)
                taken += group
            context = cut.context(taken)
            if context:
                add(span, [o for j in context for o in cut.pages[j]], score)
                taken += context
            left = [o for j in range(len(cut.pages)) if j not in taken for o in cut.pages[j]]
            if left:
                rest.append((span, left))
        for span, offsets in rest:
            add(span, offsets, 0.0)
        return units

    def _recompute_offsets(self, parts: list[tuple[Span, list[int]]]) -> bool:
        """Recompute tokens of spans at full precision in one forward; False (a recorded fault) if not."""
        if not self.mover.recompute_offsets(parts, reason="exact page recall"):
            return False
        tokens = sum(len(offsets) for _, offsets in parts)
        self.table.counters.exact_recalled_tokens += tokens
        self.table.counters.rehydrated_tokens += tokens
        return True

    def _recompute(self, span: Span) -> bool:
        """Recompute one attended span at full precision; False (a recorded fault, or nothing done) if not.

        An uncompressed span is recomputed lazily: its KV is dropped and its tokens join
        the prefill that follows (the new user turn's), so the upgrade costs no forward
        of its own over the cache. A span compressed at commit is evicted and rehydrated
        at once, then holds the offsets it held before.
        """
        if span.kept is None:
            return self.mover.recompute_pending(span, reason="exact recall")
        offsets = span.kept_offsets
        if self.mover.move(span, SpanState.EVICTED, reason="exact recall") is None:
            return False
        if not self.mover.move_holding(span, offsets, reason="exact recall"):
            self.marks.recallable.add(span.span_id)  # its token ids remain: a later recall recomputes it
            return False
        return True
