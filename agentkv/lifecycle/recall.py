"""Recall: before the model answers a new user turn, make the spans most relevant to it attended.

Ranking lives in `agentkv.lifecycle.recall_ranking` (word overlap and embeddings,
no forward pass). This module turns the ranking into values and promotions, asks the
placement service (`agentkv.lifecycle.placer.Placer.plan_promotions`) which of them
the budget allows, and moves the granted spans back through the mover. What recall
found relevant is its answer (`Recalled`): the manager hands it to exact recall
(`agentkv.lifecycle.exact_recall`), which asks the same plan for its upgrades.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from agentkv.chat import ChatMessage
from agentkv.config import RecallConfig
from agentkv.lifecycle.exact_pages import PageNames, RankedPages, SpanPages, text_pages
from agentkv.lifecycle.options import promotion
from agentkv.lifecycle.placer import PlacementPeer, Placer
from agentkv.lifecycle.recall_ranking import Information, rank_for_recall
from agentkv.lifecycle.rungs import (
    ATTENDED_RUNGS,
    NEEDED_CLASS,
    PROMOTION_CLASS,
    GreedyDualValue,
    Rung,
    RungOption,
    SpanOptions,
)
from agentkv.lifecycle.timing import SectionTimer
from agentkv.spans import Span, SpanState, Tier
from agentkv.store.protocol import AttendedFloor


@dataclass(frozen=True)
class Recalled:
    """What recall did for a new user message, and what it found relevant (for exact recall)."""

    spans: list[int] = field(default_factory=list)
    """Ids of the spans brought back to the device (restored or recomputed)."""
    relevant: list[Span] = field(default_factory=list)
    """Attended spans relevant to the message, best first (the protected ones first)."""
    scores: dict[int, float] = field(default_factory=dict)
    """Each ranked span's relevance to the message, by span id."""
    floor: AttendedFloor | None = None
    """What attended KV costs at the floor of the demotion order (None: full precision)."""
    pages_of: RankedPages | None = None
    """Cuts an attended span's quantized offsets into pages ranked against the message."""


class Recaller(PlacementPeer):
    """Ranks demoted spans against a new user message and brings the best back."""

    def __init__(self, placer: Placer, timer: SectionTimer, config: RecallConfig, *, enabled: bool) -> None:
        super().__init__(placer, timer)
        self.config = config
        self.enabled = enabled and config.enabled
        self._token_texts: dict[int, str] = {}
        self._logprobs: Any = None
        """The model's background log-probs `[V]` once asked (False: the port has none)."""
        self._word_information: dict[str, float] = {}
        self._memo: dict[Any, Any] = {}
        """Per-span recall features and embeddings, computed once (`rank_for_recall(memo=...)`)."""
        self._page_names = PageNames()
        """Stand-ins for the pages exact recall ranks (ids of their own, so the memo never mixes them)."""

    def recall(self, message: ChatMessage) -> Recalled:
        """Before answering a new user turn, make the spans most relevant to it attended.

        Candidates are the spans budget pressure demoted (archived, and evicted ones when
        `rehydrate_evicted`) and the committed spans still on the device: a relevant span
        that is already attended is protected for this turn like a recalled one, so the
        demotions after the prefill cannot push it out in favour of less relevant spans.

        What comes back is the placement plan's choice (`_plan`): recalled spans displace
        what the question does not need, which the budget check after the prefill
        demotes as usual. A fixed fraction of the budget would rule out recalling a long
        tool result at tight budgets, precisely where it matters. `max_spans` bounds the
        spans brought back; protecting an attended span only spends budget room.

        The attended spans relevant to the message are kept for the turn
        (`RecallMarks.needed`): under pressure the budget demotes them after the rest,
        so recall runs under any budget, not only once something was archived.

        Returns:
            The spans brought back, and what the message needs (`Recalled`).
        """
        config = self.config
        if not self.enabled:
            return Recalled()
        spans = self.table.spans
        demoted = [
            s
            for s in spans
            if s.span_id in self.marks.recallable
            and (s.state is SpanState.ARCHIVED or (config.rehydrate_evicted and s.state is SpanState.EVICTED))
        ]
        if not demoted and self.placer.effective_limit() is None:
            return Recalled()  # nothing to bring back, and nothing the budget will demote
        attended = [s for s in spans if s.state is SpanState.COMMITTED and s.tier.attended and not s.pinned]
        with self.timer.timed("policy_seconds"):
            query_ids = self.port.encode_text(message.content)
            ranked = rank_for_recall(
                message.content,
                demoted + attended,
                spans,
                text_of=self._text,
                query_ids=query_ids,
                information=self._information(),
                embed=self.port.token_embeddings(),
                memo=self._memo,
            )
        ranked = [
            (span, score)
            for span, score in ranked
            if score > 0 and (config.min_score is None or score >= config.min_score)
        ]
        attended_ids = {s.span_id for s in attended}
        eligible = self._eligible(ranked)
        self.marks.needed = {span.span_id for span, _ in eligible if span.span_id in attended_ids}
        floor = self.placer.floor()
        chosen, protected = self._plan(eligible, attended_ids, floor)
        for span, score in protected:  # already attended: keep it there for this turn
            self.marks.mark_recalled(span.span_id, score)
        chosen = chosen[: config.max_spans]
        self.mover.restore_together([span for span, _ in chosen])
        recalled: list[int] = []
        for span, score in chosen:
            if self.mover.move(span, SpanState.COMMITTED, reason="recall") is not None:
                recalled.append(span.span_id)
                self.marks.mark_recalled(span.span_id, score)
        # Room left after the protected spans goes to the next most relevant attended spans.
        protected_ids = {s.span_id for s, _ in protected}
        others = [s for s, _ in ranked if s.span_id in attended_ids and s.span_id not in protected_ids]
        return Recalled(
            spans=recalled,
            relevant=[s for s, _ in protected] + others,
            scores={s.span_id: score for s, score in ranked},
            floor=floor,
            pages_of=self._ranked_pages(message, query_ids, ranked[0][1] if ranked else 0.0),
        )

    def _ranked_pages(self, message: ChatMessage, query_ids: list[int], best: float) -> RankedPages:
        """Exact recall's pages: a span's quantized offsets cut into pages, ranked like spans.

        A page is worth recomputing when it is at least `relative_floor` times as relevant
        as the best span recall ranked (`best`), the rule by which spans compete for recall:
        the page holding the words the question asks about, not a line of a weakly matching
        span that shares only "on" with it.
        """

        def ranked_pages(span: Span, offsets: list[int]) -> SpanPages:
            texts = [self._token_text(span.token_ids[o]) for o in offsets]
            cut = text_pages(offsets, texts, self.config.page_tokens)
            stand_ins = [self._page_names.stand_in(span, page) for page in cut]
            index_of = {stand_in.span_id: i for i, stand_in in enumerate(stand_ins)}
            with self.timer.timed("policy_seconds"):
                ranked = rank_for_recall(
                    message.content,
                    stand_ins,
                    self.table.spans,
                    text_of=self._text,
                    query_ids=query_ids,
                    information=self._information(),
                    embed=self.port.token_embeddings(),
                    memo=self._memo,
                )
            least = self.config.relative_floor * best
            relevant = [index_of[unit.span_id] for unit, score in ranked if score > 0 and score >= least]
            return SpanPages(cut, relevant)

        return ranked_pages

    def _eligible(self, ranked: list[tuple[Span, float]]) -> list[tuple[Span, float]]:
        """The ranked spans at least `relative_floor` times as relevant as the best: what competes for room.

        Many barely relevant short spans must not crowd out a few clearly relevant ones.
        """
        if not ranked:
            return []
        least = ranked[0][1] * self.config.relative_floor
        return [(span, score) for span, score in ranked if score >= least]

    def _plan(
        self, eligible: list[tuple[Span, float]], attended_ids: set[int], floor: AttendedFloor | None
    ) -> tuple[list[tuple[Span, float]], list[tuple[Span, float]]]:
        """The demoted spans to bring back and the attended ones to keep, as one plan grants them.

        Every eligible demoted span asks for its return to attention, at what the budget
        would hold it in (`floor`), with its value raised by its relevance; the eligible
        attended spans weigh the same way. The placement service plans every span down to
        the high watermark (the limit the prefill that follows must respect; the low one
        is where demotion stops): what the question does not need gives up its steps
        first, and a promotion the plan keeps fits. The best match competes last, so it is
        taken whenever it fits, whatever its length (a long tool result holding the
        fitted parameter); when it cannot fit, the room it leaves goes back to the rest.
        """
        demoted = [(s, score) for s, score in eligible if s.span_id not in attended_ids]
        kept_attended = [(s, score) for s, score in eligible if s.span_id in attended_ids]
        limit = self.placer.effective_limit()
        if limit is None or not eligible:
            return demoted, kept_attended
        relevance = {s.span_id: score for s, score in eligible}
        best = eligible[0][0].span_id
        promotions = [
            self._promotion(span, score, floor, first=span.span_id == best) for span, score in demoted
        ]
        klass_of = {best: PROMOTION_CLASS} if best in attended_ids else {}
        target = self.placer.limits.high_bytes(limit)
        plan = self.placer.plan_promotions(promotions, target, relevance=relevance, klass_of=klass_of)

        def kept(span_id: int) -> bool:
            if span_id in attended_ids:
                return plan.rungs.get(span_id, Rung.FULL) in ATTENDED_RUNGS
            return span_id in plan.raised

        return (
            [(s, score) for s, score in demoted if kept(s.span_id)],
            [(s, score) for s, score in kept_attended if kept(s.span_id)],
        )

    def _promotion(
        self, span: Span, score: float, floor: AttendedFloor | None, *, first: bool
    ) -> SpanOptions:
        """A demoted span's return to attention, as the plan weighs it (its value raised by its relevance)."""
        fidelity = self.port.rung_fidelity()
        tokens = span.n_computed if span.tier is Tier.DROPPED else span.held_tokens
        back = Rung.FULL if floor is None else Rung.ATTENDED_Q
        cost = tokens * self.port.bytes_per_token if floor is None else floor.span_cost(tokens)
        now = Rung.DROPPED if span.tier is Tier.DROPPED else Rung.ARCHIVED
        held = self.port.store.span_bytes(span) if span.tier is Tier.QUANTIZED else 0
        value = GreedyDualValue().value(span.span_id, span.score, span.held_tokens, 1.0 + score)
        return promotion(
            span.span_id,
            value,
            RungOption(back, cost, fidelity[back]),
            RungOption(now, held, fidelity[now]),
            klass=PROMOTION_CLASS if first else NEEDED_CLASS,
            order=span.start,
        )

    def _text(self, span: Span) -> str:
        """A span's text, from its tokens' texts (cached per token; `rank_for_recall` caches per span)."""
        return "".join(self._token_text(token) for token in span.token_ids)

    def _token_text(self, token: int) -> str:
        """One token's text, cached."""
        text = self._token_texts.get(token)
        if text is None:
            text = self._token_texts[token] = self.port.token_text(token)
        return text

    def _information(self) -> Information | None:
        """A word's surprisal under the model with no context but a newline (None: no local model).

        The word is looked up by its first token with a leading space, the way it
        appears inside a sentence; the model's distribution is computed once per backend.
        """
        if self._logprobs is None:
            self._logprobs = self.port.background_logprobs()
            if self._logprobs is None:
                self._logprobs = False
        logprobs = self._logprobs
        if logprobs is False:
            return None
        cache = self._word_information

        def information(word: str) -> float:
            value = cache.get(word)
            if value is None:
                ids = self.port.encode_text(" " + word)
                value = cache[word] = float(-logprobs[ids[0]]) if ids else 0.0
            return value

        return information
