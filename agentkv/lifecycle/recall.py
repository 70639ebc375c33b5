"""Recall: before the model answers a new user turn, make the spans most relevant to it attended.

Ranking lives in `agentkv.lifecycle.recall_ranking` (word overlap and embeddings,
no forward pass); this module chooses within the budget room and moves the
chosen spans back through the mover.
"""

from __future__ import annotations

from typing import Any

from agentkv.chat import ChatMessage
from agentkv.config import RecallConfig
from agentkv.lifecycle.budget import BudgetKeeper
from agentkv.lifecycle.marks import RecallMarks
from agentkv.lifecycle.mover import Mover
from agentkv.lifecycle.port import SessionPort
from agentkv.lifecycle.recall_ranking import choose_within_room, rank_for_recall
from agentkv.lifecycle.timing import SectionTimer
from agentkv.spans import Span, SpanState, Tier


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
        if not demoted:
            return []
        attended = [
            s for s in spans if s.state is SpanState.COMMITTED and s.tier is Tier.DEVICE and not s.pinned
        ]
        with self.timer.timed("policy_seconds"):
            query = self.port.encode_text(message.content)
            ranked = rank_for_recall(
                query,
                demoted + attended,
                spans,
                embed=self.port.token_embeddings(),
                canonical=self._canonical,
                memo=self._memo,
            )
        ranked = [
            (span, score)
            for span, score in ranked
            if score > 0 and (config.min_score is None or score >= config.min_score)
        ]
        costs = [self._cost(span) for span, _ in ranked]
        picked = choose_within_room(ranked, costs, self._room(), relative_floor=config.relative_floor)
        chosen: list[tuple[Span, float]] = []
        for span, score in (ranked[i] for i in picked):
            if span.state is SpanState.COMMITTED:  # already attended: keep it there for this turn
                self.marks.mark_recalled(span.span_id, score)
            elif len(chosen) < config.max_spans:
                chosen.append((span, score))
        self.mover.restore_together([span for span, _ in chosen])
        recalled: list[int] = []
        for span, score in chosen:
            if self.mover.move(span, SpanState.COMMITTED, reason="recall") is not None:
                recalled.append(span.span_id)
                self.marks.mark_recalled(span.span_id, score)
        if recalled:
            self.table.record("recall", spans=recalled)
        return recalled

    def _room(self) -> int | None:
        """Device bytes recall may fill: the high watermark minus pinned and active spans (None = no limit).

        Up to the high watermark, not the low one: the low watermark is where demotion
        stops, the high one is the limit the prefill that follows must respect.
        """
        limit = self.budget.effective_limit()
        if limit is None:
            return None
        fixed = sum(
            s.held_tokens + (s.length - s.n_computed)
            for s in self.table.spans
            if s.tier is Tier.DEVICE and (s.pinned or s.state is SpanState.ACTIVE)
        )
        return max(0, int(limit * self.budget.limits.high) - fixed * self.port.bytes_per_token)

    def _cost(self, span: Span) -> int:
        """Device bytes a span holds once attended (a dropped span is recomputed in full)."""
        tokens = span.n_computed if span.tier is Tier.DROPPED else span.held_tokens
        return tokens * self.port.bytes_per_token

    def _canonical(self, token: int) -> str:
        """A token's stripped, casefolded text: the key recall counts word overlap on (cached)."""
        key = self._token_keys.get(token)
        if key is None:
            key = self.port.token_text(token).strip().casefold()
            self._token_keys[token] = key
        return key
