"""Pages of a quantized span for exact recall: where a long span is cut, and how its pages are named.

Exact recall (`agentkv.lifecycle.exact_recall`) recomputes a relevant span held at int4
in full precision; a 450-token tool result rarely fits the room of a tight budget,
while the line the question quotes from it does. Such a span is cut into pages, the
pages are ranked against the question like spans (`recall_ranking.rank_for_recall`),
and the best are recomputed in full precision while the rest of the span stays
attended at int4: the code being quoted is exact, and its context is still in view.

Pages follow the text, not a fixed grid: a page ends at a line end once it holds a
quarter of `page_tokens`, or at the next word start once it holds `page_tokens`, and
never holds more than twice that. A code such as `PN-55102` is several tokens with
no word start inside it, so it is not cut in two (on a fixed grid it can be, and
half a code recomputed exact is no better than the int4 near miss it replaces).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from agentkv.spans import Span


def text_pages(offsets: Sequence[int], texts: Sequence[str], page_tokens: int) -> list[tuple[int, ...]]:
    """Cut a span's `offsets` (sorted) into pages at line ends and word starts.

    Args:
        offsets: the span offsets to cut (those held quantized), sorted.
        texts: each offset's token text, aligned with `offsets`.
        page_tokens: the page size aimed at.

    Returns:
        The pages, each a tuple of offsets, in order; together they are `offsets`.
    """
    pages: list[tuple[int, ...]] = []
    page: list[int] = []
    line_min = max(1, page_tokens // 4)
    for i, offset in enumerate(offsets):
        if page:
            previous, text = texts[i - 1], texts[i]
            gap = offset != offsets[i - 1] + 1  # a token compressed away: a natural cut
            ends_line = "\n" in previous and len(page) >= line_min
            word_start = len(page) >= page_tokens and (text[:1].isspace() or previous[-1:].isspace())
            if gap or ends_line or word_start or len(page) >= 2 * page_tokens:
                pages.append(tuple(page))
                page = []
        page.append(offset)
    if page:
        pages.append(tuple(page))
    return pages


class PageNames:
    """Stand-in spans for pages, each with an id of its own for the life of the session.

    Recall's ranking memoises each span's words by its id, so a page needs an id no
    other span or page ever has: the same page (span and offsets) keeps its id, and a
    different cut of the same span gets new ones.
    """

    def __init__(self) -> None:
        self._ids: dict[tuple[int, tuple[int, ...]], int] = {}

    def stand_in(self, span: Span, offsets: tuple[int, ...]) -> Span:
        """A span holding only the page's tokens, with the page's own (negative) id."""
        key = (span.span_id, offsets)
        page_id = self._ids.get(key)
        if page_id is None:
            page_id = self._ids[key] = -(len(self._ids) + 1) - (1 << 40)  # clear of `Page.as_span` ids
        return Span(
            span_id=page_id,
            kind=span.kind,
            token_ids=[span.token_ids[o] for o in offsets],
            start=span.start + offsets[0],
        )


@dataclass(frozen=True)
class SpanPages:
    """A quantized span cut into pages, and which of them the question needs."""

    pages: list[tuple[int, ...]]
    """Each page's span offsets, in text order."""
    relevant: list[int]
    """Indices into `pages` of the pages worth recomputing, best first."""

    def context(self, chosen: Iterable[int]) -> list[int]:
        """The pages next to the `chosen` ones (the following page first), not chosen themselves."""
        taken = set(chosen)
        out: list[int] = []
        for i in sorted(taken):
            for j in (i + 1, i - 1):
                if 0 <= j < len(self.pages) and j not in taken and j not in out:
                    out.append(j)
        return out


RankedPages = Callable[[Span, list[int]], SpanPages]
"""`(span, offsets held quantized) -> SpanPages`: the caller's cut and ranking of a span's pages."""
