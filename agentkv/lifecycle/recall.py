"""Recall: before the model answers a new user turn, make the spans most relevant to it attended.

Ranking lives in `agentkv.lifecycle.recall_ranking` (word overlap and embeddings,
no forward pass); this module chooses within the budget room and moves the
chosen spans back through the mover. With `recall.pages`, long demoted spans are
ranked page by page (`agentkv.lifecycle.pages`: word overlap plus the question's
attention bound on each page's key digest) and come back holding only the chosen pages.
"""

from __future__ import annotations

from typing import Any

from agentkv.chat import ChatMessage
from agentkv.config import RecallConfig
from agentkv.lifecycle.budget import BudgetKeeper
from agentkv.lifecycle.marks import RecallMarks
from agentkv.lifecycle.mover import Mover
from agentkv.lifecycle.pages import Page, PageIndex, scale_bounds
from agentkv.lifecycle.port import SessionPort
from agentkv.lifecycle.recall_ranking import choose_within_room, rank_for_recall
from agentkv.lifecycle.timing import SectionTimer
from agentkv.spans import Span, SpanState, Tier
from agentkv.store.protocol import AttendedFloor, AttendedQuantizer


class Recaller:
    """Ranks demoted spans against a new user message and brings the best back."""

    def __init__(
        self,
        port: SessionPort,
        config: RecallConfig,
        budget: BudgetKeeper,
        mover: Mover,
        marks: RecallMarks,
        timer: SectionTimer,
        pages: PageIndex,
        *,
        enabled: bool,
    ) -> None:
        self.port = port
        self.table = port.table
        self.config = config
        self.budget = budget
        self.mover = mover
        self.marks = marks
        self.timer = timer
        self.pages = pages
        """Page digests and scores (page recall, `recall.pages`)."""
        self.enabled = enabled and config.enabled
        self._token_keys: dict[int, str] = {}
        self._memo: dict[Any, Any] = {}
        """Per-span recall features and embeddings, computed once (`rank_for_recall(memo=...)`)."""

    def recall(self, message: ChatMessage) -> list[int]:
        """Before answering a new user turn, make the spans most relevant to it attended.

        Candidates are the spans budget pressure demoted (archived, and evicted ones when
        `rehydrate_evicted`) and the committed spans still on the device: a relevant span
        that is already attended is protected for this turn like a recalled one, so the
        demotions after the prefill cannot push it out in favour of less relevant spans.

        Recall may fill the budget up to its high watermark minus what cannot be demoted
        (pinned and active spans, the new message included): recalled spans displace
        lower-ranked committed spans, which the budget check after the prefill archives
        as usual. A fixed fraction of the budget would rule out recalling a long tool
        result at tight budgets, precisely where it matters. `max_spans` bounds the spans
        brought back; protecting an attended span only spends budget room.

        Every attended span's relevance to the message is kept for the turn
        (`RecallMarks.question_relevance`): under pressure the budget demotes what the
        message needs least first, so recall runs under any budget, not only once
        something was archived.

        Returns:
            Ids of the spans brought back to the device (restored or recomputed).
        """
        config = self.config
        if not self.enabled:
            return []
        spans = self.table.spans
        demoted = [
            s
            for s in spans
            if s.span_id in self.marks.recallable
            and (s.state is SpanState.ARCHIVED or (config.rehydrate_evicted and s.state is SpanState.EVICTED))
        ]
        if not demoted and self.budget.effective_limit() is None:
            return []  # nothing to bring back, and nothing the budget will demote
        attended = [
            s for s in spans if s.state is SpanState.COMMITTED and s.tier is Tier.DEVICE and not s.pinned
        ]
        with self.timer.timed("policy_seconds"):
            query = self.port.encode_text(message.content)
            units, pages = self._units(demoted, attended)
            ranked = rank_for_recall(
                query,
                units,
                spans,
                embed=self.port.token_embeddings(),
                canonical=self._canonical,
                memo=self._memo,
            )
            if self.pages.enabled:
                ranked = self._add_attention(ranked, pages, demoted + attended)
        attended_ids = {s.span_id for s in attended}
        self.marks.question_relevance = {
            span.span_id: score for span, score in ranked if span.span_id in attended_ids
        }
        ranked = [
            (span, score)
            for span, score in ranked
            if score > 0 and (config.min_score is None or score >= config.min_score)
        ]
        floor = self._floor()
        costs = [self._cost(pages.get(span.span_id, span), floor) for span, _ in ranked]
        picked = choose_within_room(ranked, costs, self._room(floor), relative_floor=config.relative_floor)
        chosen: list[tuple[Span, float]] = []
        protected: list[Span] = []
        paged: dict[int, tuple[Span, list[int], float]] = {}
        for unit, score in (ranked[i] for i in picked):
            page = pages.get(unit.span_id)
            if page is not None:
                span = page.span
                if span.span_id not in paged and len(chosen) + len(paged) >= config.max_spans:
                    continue
                _, offsets, best = paged.get(span.span_id, (span, [], score))
                paged[span.span_id] = (span, offsets + list(page.offsets), max(best, score))
            elif unit.state is SpanState.COMMITTED:  # already attended: keep it there for this turn
                self.marks.mark_recalled(unit.span_id, score)
                protected.append(unit)
            elif len(chosen) + len(paged) < config.max_spans:
                chosen.append((unit, score))
        self.mover.restore_together([span for span, _ in chosen] + [span for span, _, _ in paged.values()])
        recalled: list[int] = []
        for span, score in chosen:
            if self.mover.move(span, SpanState.COMMITTED, reason="recall") is not None:
                recalled.append(span.span_id)
                self.marks.mark_recalled(span.span_id, score)
        for span, offsets, score in paged.values():
            if self._bring_back_holding(span, offsets, reason="page recall"):
                self.table.counters.page_recalled_tokens += len(set(offsets) & set(span.kept_offsets))
                recalled.append(span.span_id)
                self.marks.mark_recalled(span.span_id, score)
        exact = self._recompute_exact(protected, floor)
        if recalled or exact:
            self.table.record("recall", spans=recalled, paged=sorted(paged), exact=exact)
        return recalled + exact

    def _recompute_exact(self, spans: list[Span], floor: AttendedFloor | None) -> list[int]:
        """Recompute relevant attended spans that the budget holds quantized, at full precision.

        Quantization noise is small on average but not on what a question asks to quote:
        a digit of a code or a letter of a name can flip at int4, while the same span at
        full precision is copied exactly. Recall knows which spans the question needs, so
        these are recomputed from their token ids (`_recompute`), best first, while the
        room allows.

        The room is the low watermark minus what the device holds with every other
        attended token at the floor of the demotion order. The budget check after the
        prefill quantizes committed spans before recalled ones, so an upgrade that fits
        only quantizes lower-priority spans; it never makes the budget archive a span.
        A recomputed span attends its context as the cache holds it now (partly
        quantized): exact up to that context, as any rehydration.

        Returns:
            Ids of the spans recomputed at full precision.
        """
        store = self._quantizer()
        limit = self.budget.effective_limit()
        if not self.config.recompute_quantized or store is None or floor is None or limit is None:
            return []
        room = int(limit * self.budget.limits.low) - self._floor_usage(store, floor)
        extra_per_token = max(0, floor.exact_token_bytes - floor.token_bytes)
        exact: list[int] = []
        with self.port.store.deferred_removal():  # one compaction for every span dropped here
            for span in spans:
                if span.tier is not Tier.DEVICE or not store.attended_quantized_tokens(span):
                    continue
                extra = span.length * extra_per_token
                if extra > room or not self._recompute(span, store):
                    continue
                room -= extra
                self.table.counters.exact_recalled_tokens += span.length
                exact.append(span.span_id)
        return exact

    def _recompute(self, span: Span, store: AttendedQuantizer) -> bool:
        """Recompute one attended span at full precision; False (a recorded fault, or nothing done) if not.

        An uncompressed span is recomputed lazily: its KV is dropped and its tokens join
        the prefill that follows (the new user turn's), so the upgrade costs no forward
        of its own over the cache. A span compressed at commit is evicted and rehydrated
        at once, then holds the offsets it held before.
        """
        if span.kept is None:
            with self.timer.timed("store_seconds"):
                try:
                    store.recompute_pending(span)
                except Exception as e:  # noqa: BLE001 - the span is still attended, quantized
                    self.mover.fault("exact recall", span, e)
                    return False
            self.table.counters.rehydrated_tokens += span.length
            return True
        offsets = span.kept_offsets
        if self.mover.move(span, SpanState.EVICTED, reason="exact recall") is None:
            return False
        if not self._bring_back_holding(span, offsets, reason="exact recall"):
            self.marks.recallable.add(span.span_id)  # its token ids remain: a later recall recomputes it
            return False
        return True

    def _floor_usage(self, store: AttendedQuantizer, floor: AttendedFloor) -> int:
        """Device bytes after this turn's prefill with every token the budget may quantize quantized.

        What the device counts now (attended KV, quantized archives, digests), less the
        evictable spans (the budget drops them first), less what quantizing the exact
        tokens would free (the sinks and the residual window stay exact), plus the new
        message's pending tokens at their quantized size.
        """
        usage = self.budget.usage_bytes()
        exact_held = 0
        pending = 0
        for span in self.table.spans:
            if span.tier is not Tier.DEVICE:
                continue
            if span.state is SpanState.EVICTABLE:
                usage -= self.port.store.span_bytes(span)
                continue
            exact_held += span.held_tokens - store.attended_quantized_tokens(span)
            pending += span.length - span.n_computed
        quantizable = max(0, exact_held - floor.exact_tokens)
        saved = quantizable * max(0, floor.exact_token_bytes - floor.token_bytes)
        return usage - saved + floor.span_cost(pending)

    def _units(self, demoted: list[Span], attended: list[Span]) -> tuple[list[Span], dict[int, Page]]:
        """What recall ranks: whole spans, and with page recall the pages of long demoted spans.

        Returns:
            The units (real spans and page stand-ins), and each stand-in's page by its id.
        """
        if not self.pages.enabled:
            return demoted + attended, {}
        units: list[Span] = []
        pages: dict[int, Page] = {}
        for span in demoted:
            span_pages = self.pages.pages(span)
            if len(span_pages) < 2:
                units.append(span)
                continue
            for page in span_pages:
                stand_in = page.as_span()
                pages[stand_in.span_id] = page
                units.append(stand_in)
        return units + attended, pages

    def _add_attention(
        self, ranked: list[tuple[Span, float]], pages: dict[int, Page], spans: list[Span]
    ) -> list[tuple[Span, float]]:
        """Add `attention_weight` times each unit's scaled Quest bound to its word-overlap score.

        A page gets its own bound; a whole span gets its best page's. Without the
        question's queries (no model to probe) the ranking stays word overlap alone.
        """
        queries = self.pages.question_queries()
        if queries is None:
            return ranked
        scaled = scale_bounds(self.pages.bounds(spans, queries))
        weight = self.config.attention_weight
        out: list[tuple[Span, float]] = []
        for unit, score in ranked:
            page = pages.get(unit.span_id)
            bound = 0.0
            if page is not None and page.span.span_id in scaled:
                bound = float(scaled[page.span.span_id][page.index])
            elif unit.span_id in scaled:
                bound = float(scaled[unit.span_id].max())
            out.append((unit, score + weight * bound))
        out.sort(key=lambda item: (item[1], item[0].start), reverse=True)
        return out

    def _bring_back_holding(self, span: Span, offsets: list[int], *, reason: str) -> bool:
        """Bring a span back (restored or recomputed at its logical positions) holding only `offsets`.

        The span is attended again like any span compressed at commit: `kept` lists
        the offsets it holds (the chosen pages, or what it held before an exact
        recompute); its token ids stay, so the rest can come back later.
        """
        # The offsets are what the question needs: commit-time compression (which re-runs on a
        # recomputed span) must not thin them out; the choice is this commit's compression.
        compressor, self.mover.compressor = self.mover.compressor, None
        try:
            moved = self.mover.move(span, SpanState.COMMITTED, reason=reason)
        finally:
            self.mover.compressor = compressor
        if moved is None:
            return False
        keep = sorted(set(offsets) & set(span.kept_offsets))
        if keep and len(keep) < span.held_tokens:
            with self.timer.timed("store_seconds"):
                self.port.store.compress(span, keep)
        return True

    def _room(self, floor: AttendedFloor | None) -> int | None:
        """Device bytes recall may fill: the high watermark minus pinned and active spans (None = no limit).

        Up to the high watermark, not the low one: the low watermark is where demotion
        stops, the high one is the limit the prefill that follows must respect.
        """
        limit = self.budget.effective_limit()
        if limit is None:
            return None
        fixed = [
            s.held_tokens + (s.length - s.n_computed)
            for s in self.table.spans
            if s.tier is Tier.DEVICE and (s.pinned or s.state is SpanState.ACTIVE)
        ]
        if floor is None:
            held = sum(fixed) * self.port.bytes_per_token
        else:
            held = sum(floor.span_cost(tokens) for tokens in fixed) + floor.exact_surplus
        return max(0, int(limit * self.budget.limits.high) - held)

    def _cost(self, unit: Span | Page, floor: AttendedFloor | None) -> int:
        """Device bytes a span or a page holds once attended (a dropped span is recomputed in full)."""
        if isinstance(unit, Page):
            tokens = len(unit.offsets)
        else:
            tokens = unit.n_computed if unit.tier is Tier.DROPPED else unit.held_tokens
        return tokens * self.port.bytes_per_token if floor is None else floor.span_cost(tokens)

    def _quantizer(self) -> AttendedQuantizer | None:
        """The store as an attended quantizer, when it holds any span quantized in attention."""
        store = self.port.store
        if isinstance(store, AttendedQuantizer) and store.attended_quantized_tokens():
            return store
        return None

    def _floor(self) -> AttendedFloor | None:
        """What attended KV costs at the least the budget holds it in; None: full precision.

        With an attended quantized tier the budget holds every span quantized in
        attention before it archives any, so a recalled span needs room at its quantized
        size (the budget check after the prefill quantizes lower-priority spans, then
        archives them, to make it), and so do the pinned and active spans that stay; the
        sinks and the residual window stay full precision, which the room sets aside.
        """
        store = self.port.store
        return store.attended_floor() if isinstance(store, AttendedQuantizer) else None

    def _canonical(self, token: int) -> str:
        """A token's stripped, casefolded text: the key recall counts word overlap on (cached)."""
        key = self._token_keys.get(token)
        if key is None:
            key = self.port.token_text(token).strip().casefold()
            self._token_keys[token] = key
        return key
