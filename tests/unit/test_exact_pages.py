"""Where exact recall cuts a quantized span into pages, and which neighbours it adds."""

from __future__ import annotations

from agentkv.lifecycle.exact_pages import PageNames, SpanPages, text_pages
from agentkv.spans import Span, SpanKind


def cut(texts: list[str], page_tokens: int, offsets: list[int] | None = None) -> list[list[str]]:
    offsets = list(range(len(texts))) if offsets is None else offsets
    pages = text_pages(offsets, [texts[o] for o in offsets], page_tokens)
    assert [o for page in pages for o in page] == offsets, "the pages cover the offsets, in order"
    return [[texts[o] for o in page] for page in pages]


def test_a_page_ends_at_a_line_end_once_it_holds_a_quarter_page():
    texts = ["a", " b", "\n", "c", " d", " e", " f", "\n", "g", " h"]
    # page_tokens 8: a line may end a page from 2 tokens on.
    assert cut(texts, 8) == [["a", " b", "\n"], ["c", " d", " e", " f", "\n"], ["g", " h"]]


def test_a_code_is_not_cut_in_two_at_the_page_size():
    # 8 tokens of words, then a code of 4 tokens with no word start inside, then words.
    texts = [" w"] * 7 + [" PN", "-", "551", "02", " next", " words"]
    pages = cut(texts, 8)
    assert pages[0] == [" w"] * 7 + [" PN", "-", "551", "02"], "the page runs on to the next word start"
    assert pages[1] == [" next", " words"]


def test_no_page_outgrows_twice_the_page_size():
    texts = ["x"] * 40  # no line end, no word start
    assert [len(p) for p in cut(texts, 8)] == [16, 16, 8]


def test_a_gap_in_the_offsets_starts_a_new_page():
    texts = [" a", " b", " c", " d", " e", " f"]
    assert cut(texts, 32, offsets=[0, 1, 4, 5]) == [[" a", " b"], [" e", " f"]]


def test_neighbours_of_the_chosen_pages_come_following_page_first_and_never_twice():
    pages = SpanPages(pages=[(0,), (1,), (2,), (3,), (4,)], relevant=[3, 1])
    assert pages.context([3]) == [4, 2]
    assert pages.context([1, 2]) == [0, 3]
    assert pages.context([0, 4]) == [1, 3]


def test_a_page_keeps_its_name_and_a_new_cut_gets_new_ones():
    span = Span(span_id=7, kind=SpanKind.TOOL_RESULT, token_ids=list(range(10, 20)), start=100)
    names = PageNames()
    first = names.stand_in(span, (2, 3, 4))
    assert first.token_ids == [12, 13, 14] and first.start == 102
    assert names.stand_in(span, (2, 3, 4)).span_id == first.span_id
    assert names.stand_in(span, (2, 3)).span_id not in (first.span_id, span.span_id)
    assert first.span_id < 0
