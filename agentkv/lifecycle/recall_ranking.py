"""Ranking spans by relevance to a new user message, before the model answers it.

Recall must decide *before* the new message is encoded (so that the message's
own KV is computed with the recalled spans in view), which rules out signals
that need a forward pass over the history. Two cheap signals remain:

- **Shared words, weighted by how much each tells** (BM25's idea). A word's weight
  is its rarity among the session's spans (IDF) times its surprisal under the
  model itself, with nothing but a newline as context (`background_logprobs`). A
  session has a few dozen spans, too few for IDF alone to know that "what",
  "should" and "?" carry nothing: a question used to match every other question
  in the history better than the message that held its answer. The model's
  unconditional next-token distribution is the background corpus a session lacks.
- The cosine of mean input embeddings (near-synonyms), counted only next to some
  shared word: embeddings alone are too weak a signal to spend budget on.

Overlap is counted on words, not token ids: byte-level BPE spells one word with
different ids depending on what precedes it (`" price"` after a space, `"price"`
after a quote or an underscore), so the text is split into words and casefolded
("unit price" finds `"unit_price": "189.99"`). A code or a number (any word with a
digit) counts whole and by its parts: `PS-3318-774` is found by the whole code and
by `3318`, and only the whole tells `4471` from `4417`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch

from agentkv.spans import Span

EMBEDDING_WEIGHT = 0.25

WORD = re.compile(r"[^\W_]+(?:[-/.:][^\W_]+)*")
"""A word: letters and digits, with the joiners codes are written with (`KX7-4471`, `12/06`, `v2.1`)."""

Information = Callable[[str], float]
"""How much a (casefolded) word tells on its own, before any session statistics (1.0 = no prior)."""


def words(text: str) -> frozenset[str]:
    """The casefolded words of `text`; a word with a digit (a code, a number) also by its parts."""
    out: set[str] = set()
    for match in WORD.finditer(text):
        word = match.group().casefold()
        out.add(word)
        if any(c.isdigit() for c in word):
            out.update(part for part in re.split(r"[-/.:]", word) if part)
    return frozenset(out)


def _idf(spans: Sequence[frozenset[str]]) -> dict[str, float]:
    """Inverse document frequency of each word over the session's spans."""
    df: dict[str, int] = {}
    for features in spans:
        for feature in features:
            df[feature] = df.get(feature, 0) + 1
    n = len(spans)
    return {t: max(0.0, math.log((n + 1) / (count + 0.5))) for t, count in df.items()}


def _mean_embedding(embed: Any, ids: Sequence[int]) -> torch.Tensor | None:
    """The mean input embedding of the distinct `ids` `[hidden]`, outside autograd (None without either)."""
    if embed is None or not ids:
        return None
    weight = embed.weight.detach()  # a model loaded for training still ranks without building a graph
    index = torch.tensor(list(set(ids)), dtype=torch.long, device=weight.device)
    return weight.index_select(0, index).float().mean(0).cpu()  # [hidden]


def _no_prior(word: str) -> float:
    del word
    return 1.0


def rank_for_recall(
    query: str,
    candidates: Sequence[Span],
    all_spans: Sequence[Span],
    *,
    text_of: Callable[[Span], str],
    query_ids: Sequence[int] = (),
    information: Information | None = None,
    embed: Any = None,
    memo: dict[Hashable, Any] | None = None,
) -> list[tuple[Span, float]]:
    """Candidates sorted by relevance to the query (best first), with their scores.

    Args:
        query: the new user message's content.
        candidates: spans that may be recalled.
        all_spans: every span of the session (for IDF statistics).
        text_of: a span's text (recall decodes its token ids once).
        query_ids: the message's token ids (the embedding signal).
        information: a word's weight before session statistics (the model's surprisal);
            None = IDF alone.
        embed: the model's input embedding module (optional).
        memo: a dict the caller keeps across calls: each span's words and mean
            embedding are computed once (a span's tokens only change when a rewrite
            truncates it, and the key includes its length).

    Returns:
        `(span, score)` pairs, best first; a score is the weighted fraction of the
        query's words the span contains (plus `EMBEDDING_WEIGHT` times the embedding
        cosine when there is any overlap), 0 without overlap.
    """
    memo = {} if memo is None else memo
    prior = information or _no_prior

    def span_words(span: Span) -> frozenset[str]:
        slot = ("words", span.span_id, len(span.token_ids))
        if slot not in memo:
            memo[slot] = words(text_of(span))
        return memo[slot]

    def span_embedding(span: Span) -> torch.Tensor | None:
        slot = ("embedding", span.span_id, len(span.token_ids))
        if slot not in memo:
            memo[slot] = _mean_embedding(embed, span.token_ids)
        return memo[slot]

    idf = _idf([span_words(s) for s in all_spans])
    asked = words(query)
    weight = {w: idf.get(w, 0.0) * prior(w) for w in asked}
    total = sum(weight.values())
    query_vec = _mean_embedding(embed, query_ids)
    ranked: list[tuple[Span, float]] = []
    for span in candidates:
        lexical = sum(weight[w] for w in asked & span_words(span)) / total if total > 0 else 0.0
        score = lexical
        if lexical > 0 and query_vec is not None:
            span_vec = span_embedding(span)
            if span_vec is not None:
                score += EMBEDDING_WEIGHT * float(torch.cosine_similarity(query_vec, span_vec, dim=0))
        ranked.append((span, score if lexical > 0 else 0.0))
    ranked.sort(key=lambda item: (item[1], item[0].start), reverse=True)
    return ranked
