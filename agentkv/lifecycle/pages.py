"""Page recall: bring back the pages of a long span that the new question needs, not the whole span.

Whole-message recall cannot afford a 500-token tool result whose one useful line
sits in its first page, next to the pinned and committed spans of a tight
budget. Here a committed span gets a page key digest (`agentkv.store.digest`:
per page of `page_tokens` tokens, the min and max key per layer, kv head and
channel, as Quest keeps them), held by the store on the device while the span's
KV is archived or dropped, and counted in the device budget.

Before a new user turn is encoded, the question's own tokens are run through the
model over the attended cache (its queries, RoPE'd at their positions; the cache
is left as it was) and every page is scored with Quest's bound
`sum_d max(q_d * min_d, q_d * max_d)`, maxed over the question's tokens and heads
and averaged over layers. Like Quest, the first `QUEST_SKIP_LAYERS` layers are not
used: their attention is spread over everything, so their bounds do not tell
pages apart (Quest, Tang et al. 2024, §4). Quest and ArkVale score pages with
the current decode step's query; we score once per user turn with the
question's queries, the natural step for an agent (one recall before a prefill,
no per-token gather).

Each page then also gets the word-overlap score that whole spans get
(`recall_ranking.rank_for_recall`), so an exact code in the question finds its
line, and a paraphrase still finds the page the model would attend to. The
recaller chooses pages and whole spans together within the budget room; a span
with chosen pages is brought back (restored, or recomputed from its token ids at
its logical positions) and compressed to those pages (`Span.kept`), so the
span table represents the partial span as any span compressed at commit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from agentkv.config import RecallConfig
from agentkv.lifecycle.port import SessionPort
from agentkv.spans import Span
from agentkv.store.digest import QUEST_SKIP_LAYERS, PageDigest, score_pages

__all__ = ["QUEST_SKIP_LAYERS", "Page", "PageIndex", "scale_bounds"]


@dataclass(frozen=True)
class Page:
    """One page of a span: what recall ranks and brings back in place of the whole span."""

    span: Span
    index: int
    offsets: tuple[int, ...]
    """Span offsets the page covers."""

    def as_span(self) -> Span:
        """A stand-in span holding only the page's tokens (word overlap ranks it like a message).

        Its id is negative and unique per (span, page), so rankings memoised by span id
        never mix a page with a real span.
        """
        first = self.offsets[0]
        return Span(
            span_id=-(self.span.span_id * 4096 + self.index + 1),
            kind=self.span.kind,
            token_ids=[self.span.token_ids[o] for o in self.offsets],
            start=self.span.start + first,
        )


class PageIndex:
    """Scores the pages of digested spans against a question (the store builds digests at commit)."""

    def __init__(self, port: SessionPort, config: RecallConfig) -> None:
        self.port = port
        self.config = config
        self.enabled = config.enabled and config.pages
        self.last_queries: tuple[torch.Tensor, ...] | None = None
        """The last question's per-layer queries (kept for tests and inspection)."""

    @property
    def page_tokens(self) -> int:
        """Tokens per page."""
        return self.config.page_tokens

    def digest(self, span: Span) -> PageDigest | None:
        """The span's digest, if the store holds one (built at its first commit)."""
        return self.port.store.page_digest(span)

    def pages(self, span: Span) -> list[Page]:
        """The span's pages (empty without a digest)."""
        digest = self.digest(span)
        if digest is None or digest.num_tokens != span.length:
            return []
        return [Page(span, p, tuple(digest.page_offsets(p))) for p in range(digest.num_pages)]

    def question_queries(self) -> tuple[torch.Tensor, ...] | None:
        """The pending question's queries for the digested layers (None when it cannot be probed)."""
        queries = self.port.question_queries()
        if queries is None or len(queries) <= QUEST_SKIP_LAYERS:
            self.last_queries = None
            return None
        self.last_queries = tuple(queries[QUEST_SKIP_LAYERS:])
        return self.last_queries

    def bounds(self, spans: Sequence[Span], queries: Sequence[torch.Tensor]) -> dict[int, torch.Tensor]:
        """Per span id, Quest's bound of each page `[P]` for the question's queries."""
        out: dict[int, torch.Tensor] = {}
        for span in spans:
            digest = self.digest(span)
            if digest is not None and digest.num_tokens == span.length:
                out[span.span_id] = score_pages(digest, list(queries))
        return out


def scale_bounds(bounds: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    """Bounds scaled to 0..1 over every page scored for this question (best page 1, worst 0).

    Bounds are logits: only their order within one question means anything, so they
    are min-max scaled before they are added to the word-overlap scores.
    """
    if not bounds:
        return {}
    values = torch.cat([b.flatten() for b in bounds.values()])
    low, high = float(values.min()), float(values.max())
    spread = high - low
    if spread <= 0:
        return {k: torch.zeros_like(b) for k, b in bounds.items()}
    return {k: (b - low) / spread for k, b in bounds.items()}
