"""Exact recall: a relevant span the budget holds quantized is recomputed at full precision.

Quantization noise is small on average but not on what a question asks to quote: a
digit of a code or a letter of a name can flip at int4, while the same span at full
precision is copied exactly. Recall knows which attended spans the new user message
needs (`agentkv.lifecycle.recall`); those the attended quantized tier holds at int4
are recomputed from their token ids, best first, while the room allows.

A relevant span longer than `WHOLE_SPAN_PAGES` pages is recomputed in part first:
its pages (`agentkv.lifecycle.exact_pages`) that the caller ranks as relevant are
recomputed in full precision, best first, while the room allows; the rest of the
span stays attended at int4. The pages next to the chosen ones come next (the
following page first): a log entry or a table row often continues on the line after
the one the question's words match. The room goes to what the question needs most
densely: a 600-token tool result that ranks second on a word it shares with the
question must not take, whole, the room the line holding the answer in the third
span needs. Only once every relevant span has its pages does room left over
recompute the rest of the long spans, in their rank order. A page is recomputed
over the cache as it is (the span's own earlier tokens at int4 included) and
replaces the quantized KV of its tokens.

The room is the low watermark minus what the device would hold with every other
attended token at the floor of the demotion order (`AttendedFloor`; the placement
service's `Placer.floor_usage`). The budget check after the prefill quantizes
committed spans before recalled ones, so an upgrade that fits only quantizes
lower-priority spans. When the room at the floor cannot hold even the question's
best match (its best page and that page's neighbours, or the whole span when it is
short), room is made
for that one unit: the placement service plans in the `needed_last` order, so the
spans the question does not need give up attention first (least value first; they
stay recallable from their token ids). A tight budget thereby holds the answer's
source exact and drops what the question does not read, where holding everything
at int4 would leave no room to recompute anything. A recomputed span
attends its context as the cache holds it now (partly quantized): exact up to that
context, as any rehydration.
"""

from __future__ import annotations

from agentkv.lifecycle.exact_pages import RankedPages, SpanPages
from agentkv.lifecycle.placement import NEEDED_LAST
from agentkv.lifecycle.placer import PlacementPeer, Placer
from agentkv.lifecycle.timing import SectionTimer
from agentkv.spans import Span, SpanState, Tier
from agentkv.store.protocol import AttendedFloor, AttendedQuantizer

WHOLE_SPAN_PAGES = 2
"""A relevant span of at most this many pages is recomputed whole; a longer one page by page, best first."""


class ExactRecall(PlacementPeer):
    """Recomputes the relevant spans held quantized in attention at full precision."""

    def __init__(self, placer: Placer, timer: SectionTimer, *, enabled: bool) -> None:
        super().__init__(placer, timer)
        self.enabled = enabled

    def recompute(
        self, spans: list[Span], floor: AttendedFloor | None, pages: RankedPages | None = None
    ) -> list[int]:
        """Recompute `spans` (relevant, attended, best first) that are held quantized, while the room allows.

        A span longer than `WHOLE_SPAN_PAGES` pages, or one that does not fit whole, has
        its best pages recomputed first, when `pages` ranks them and the session can
        recompute single tokens; room left once every relevant span had its turn goes to
        the rest of those spans.

        Returns:
            Ids of the spans recomputed at full precision, whole or in part.
        """
        store = self.port.store
        placer = self.placer
        limit = placer.effective_limit()
        if not self.enabled or floor is None or limit is None or not isinstance(store, AttendedQuantizer):
            return []
        if not any(s.tier is Tier.ATTENDED_QUANTIZED for s in self.table.spans):
            return []
        quantized = placer.quantized_now()
        room = placer.limits.low_bytes(limit) - placer.floor_usage(quantized, floor)
        extra_per_token = max(0, floor.exact_token_bytes - floor.token_bytes)
        if not self.port.recomputes_offsets:
            pages = None
        cuts: dict[int, SpanPages | None] = {}

        def cut_of(span: Span) -> SpanPages | None:
            if span.span_id not in cuts:
                cuts[span.span_id] = pages(span, store.quantized_offsets(span)) if pages is not None else None
            return cuts[span.span_id]

        best = next((s for s in spans if s.tier is Tier.ATTENDED_QUANTIZED), None)
        if best is not None:
            need = self._need(best, cut_of(best), extra_per_token)
            if need > room:
                room = self._make_room(need, room, limit, floor)
        whole: list[Span] = []
        parts: list[tuple[Span, SpanPages, list[int]]] = []
        for span in spans:
            if span.tier is not Tier.ATTENDED_QUANTIZED:
                continue
            extra = span.length * extra_per_token
            cut = cut_of(span)
            if (cut is None or len(cut.pages) <= WHOLE_SPAN_PAGES) and extra <= room:
                whole.append(span)
                room -= extra
            elif cut is not None and room >= extra_per_token:
                chosen, room = self._fit(cut, cut.relevant, room, extra_per_token)
                if chosen:
                    more, room = self._fit(cut, cut.context(chosen), room, extra_per_token)
                    parts.append((span, cut, chosen + more))
        for i, (span, cut, chosen) in enumerate(parts):  # room left over: the rest of the long spans
            taken = set(chosen)
            rest = [j for j in range(len(cut.pages)) if j not in taken]
            more, room = self._fit(cut, rest, room, extra_per_token)
            parts[i] = (span, cut, chosen + more)
        # A span that got every page back is recomputed whole: its tokens join the prefill.
        whole += [span for span, cut, chosen in parts if len(chosen) == len(cut.pages)]
        parts = [part for part in parts if len(part[2]) < len(part[1].pages)]
        exact: list[int] = []
        # Pages first: a whole span recomputed lazily waits for the prefill, and a page after it
        # in the conversation must attend it.
        with store.deferred_removal():  # one compaction for every span dropped here
            paged = [(span, sorted(o for i in chosen for o in cut.pages[i])) for span, cut, chosen in parts]
            if paged and self._recompute_offsets(paged):
                exact += [span.span_id for span, _ in paged]
            for span in whole:
                if self._recompute(span):
                    self.table.counters.exact_recalled_tokens += span.length
                    exact.append(span.span_id)
        return exact

    @staticmethod
    def _need(span: Span, cut: SpanPages | None, extra_per_token: int) -> int:
        """Bytes the best match needs at full precision: whole, or its best page and its neighbours."""
        if cut is None or len(cut.pages) <= WHOLE_SPAN_PAGES:
            return span.length * extra_per_token
        chosen = cut.relevant[:1]
        return sum(len(cut.pages[i]) for i in chosen + cut.context(chosen)) * extra_per_token

    def _make_room(self, need: int, room: int, limit: int, floor: AttendedFloor) -> int:
        """Free `need - room` bytes for the best match: the spans the question does not need go first.

        The placement service plans the moves in the `needed_last` order: every span the
        current question does not need gives up its steps (int4, then leaving attention,
        least value first) before a needed one does. With 8-bit keys in play only
        quantizing makes this room: no fine plane is dropped and no span leaves for it.
        What leaves stays recallable from its token ids. Returns the room, measured again.
        """
        placer = self.placer
        # Room is counted at the floor (every quantizable token quantized, the new message's
        # pending tokens at their quantized size): usage brought to the floor it must reach
        # frees it, whatever mix of quantizing, coarsening and leaving the plan chooses.
        floor_now = placer.floor_usage(placer.quantized_now(), floor)
        pending = floor.span_cost(placer.pending_tokens())
        # With 8-bit keys in play only quantizing makes this room (`spare_above`: usage now):
        # no span leaves attention and no fine key plane is dropped for an upgrade.
        placer.demote_to(
            floor_now - pending - (need - room), limit, order=NEEDED_LAST, spare_above=placer.usage_bytes()
        )
        room = placer.limits.low_bytes(limit) - placer.floor_usage(placer.quantized_now(), floor)
        return room

    @staticmethod
    def _fit(cut: SpanPages, indices: list[int], room: int, extra_per_token: int) -> tuple[list[int], int]:
        """The pages among `indices` that fit, taken in that order, and the room left."""
        chosen: list[int] = []
        for i in indices:
            cost = len(cut.pages[i]) * extra_per_token
            if cost <= room:
                chosen.append(i)
                room -= cost
        return chosen, room

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
