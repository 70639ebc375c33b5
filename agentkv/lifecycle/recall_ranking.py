"""Ranking spans by relevance to a new user message, before the model answers it.

Recall must decide *before* the new message is encoded (so that the message's
own KV is computed with the recalled spans in view), which rules out signals
that need a forward pass. Two cheap signals, both from the model's own
vocabulary: IDF-weighted token overlap (what BM25 does: "code" and "4417" in
the question find the span that said them) and the cosine of mean input
embeddings (near-synonyms). A span with no lexical overlap is not recalled:
embeddings alone are too weak a signal to spend budget on.

Byte-level BPE spells one word with different ids depending on what precedes it
(`" price"` after a space, `"price"` after a quote or an underscore, `" Price"`
at a sentence start), so overlap is counted on *canonical* tokens when the caller
supplies a `canonical` map (the manager maps each id to its stripped, casefolded
text): "unit price" in a question then finds `"unit_price": "189.99"` in a
tool result. Inside codes and numbers, pairs of adjacent tokens count as words of
their own: codes are split into many common pieces (digits are single tokens in
many vocabularies), and only their pairs tell `4471` from `4417`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch

from agentkv.spans import Span

EMBEDDING_WEIGHT = 0.25

Canonical = Callable[[int], Hashable]
"""Maps a token id to the key overlap is counted on (ids with the same key are the same word)."""


def _identity(token: int) -> Hashable:
    return token


def _features(token_ids: Sequence[int], canonical: Canonical) -> set[Hashable]:
    """Canonical tokens, plus adjacent pairs inside codes and numbers (what overlap is counted on).

    A pair counts when either side is not a plain word (digits, `-`, `/`): the pieces of
    `KX7-4471` or `4407`. Pairs of words are left out; they would reward a span for
    echoing the question's phrasing ("the broken headphones") over the span that
    holds the answer.
    """
    keys = [canonical(t) for t in token_ids]
    pairs = {(a, b) for a, b in zip(keys, keys[1:], strict=False) if not (_is_word(a) and _is_word(b))}
    return set(keys) | pairs


def _is_word(key: Hashable) -> bool:
    return isinstance(key, str) and key.isalpha()


def _idf(spans: Sequence[set[Hashable]]) -> dict[Hashable, float]:
    """Inverse document frequency of each feature over the session's spans."""
    df: dict[Hashable, int] = {}
    for features in spans:
        for feature in features:
            df[feature] = df.get(feature, 0) + 1
    n = len(spans)
    return {t: max(0.0, math.log((n + 1) / (count + 0.5))) for t, count in df.items()}


def _mean_embedding(embed: Any, ids: Sequence[int]) -> torch.Tensor | None:
    if embed is None or not ids:
        return None
    weight = embed.weight
    index = torch.tensor(list(set(ids)), dtype=torch.long, device=weight.device)
    return weight.index_select(0, index).float().mean(0).cpu()  # [hidden]


def rank_for_recall(
    query_ids: Sequence[int],
    candidates: Sequence[Span],
    all_spans: Sequence[Span],
    *,
    embed: Any = None,
    canonical: Canonical | None = None,
    memo: dict[Hashable, Any] | None = None,
) -> list[tuple[Span, float]]:
    """Candidates sorted by relevance to the query (best first), with their scores.

    Args:
        query_ids: token ids of the new user message's content.
        candidates: spans that may be recalled.
        all_spans: every span of the session (for IDF statistics).
        embed: the model's input embedding module (optional).
        canonical: token id → the key overlap is counted on (default: the id itself).
        memo: a dict the caller keeps across calls: each span's features and mean
            embedding are computed once (a span's tokens only change when a rewrite
            truncates it, and the key includes its length).

    Returns:
        `(span, score)` pairs, best first; a score is the IDF-weighted fraction of the
        query's tokens and token pairs the span contains (plus `EMBEDDING_WEIGHT` times the embedding
        cosine when there is any overlap), 0 without overlap.
    """
    key = canonical or _identity
    memo = {} if memo is None else memo

    def span_features(span: Span) -> set[Hashable]:
        slot = ("features", span.span_id, len(span.token_ids))
        if slot not in memo:
            memo[slot] = _features(span.token_ids, key)
        return memo[slot]

    def span_embedding(span: Span) -> torch.Tensor | None:
        slot = ("embedding", span.span_id, len(span.token_ids))
        if slot not in memo:
            memo[slot] = _mean_embedding(embed, span.token_ids)
        return memo[slot]

    idf = _idf([span_features(s) for s in all_spans])
    query = _features(query_ids, key)
    total = sum(idf.get(t, 0.0) for t in query)
    query_vec = _mean_embedding(embed, query_ids)
    ranked: list[tuple[Span, float]] = []
    for span in candidates:
        shared = query & span_features(span)
        lexical = sum(idf.get(t, 0.0) for t in shared) / total if total > 0 else 0.0
        score = lexical
        if lexical > 0 and query_vec is not None:
            span_vec = span_embedding(span)
            if span_vec is not None:
                score += EMBEDDING_WEIGHT * float(torch.cosine_similarity(query_vec, span_vec, dim=0))
        ranked.append((span, score if lexical > 0 else 0.0))
    ranked.sort(key=lambda item: (item[1], item[0].start), reverse=True)
    return ranked


def choose_within_room(
    ranked: Sequence[tuple[Span, float]],
    costs: Sequence[int],
    room: int | None,
    *,
    relative_floor: float,
    resolution: int = 512,
) -> list[int]:
    """Indices into `ranked` of the spans to attend: the best match, then the most relevance that fits.

    The best-matching span is taken first whenever it fits: it is the one most
    likely to hold what the question asks for, whatever its length (a long tool
    result with the fitted parameter). The rest of the room is a 0/1 knapsack:
    the set of spans with the most summed relevance whose costs fit. Greedy by
    score would let one long, loosely relevant span (a 255-token policy text
    matching "broken headphones") take the room of three short ones, one of which
    holds the answer. Only spans at least `relative_floor` times as relevant as
    the best compete, so many barely relevant short spans cannot crowd out a few
    clearly relevant ones.

    Costs are rounded up to `room / resolution` so the dynamic programme stays
    `len(ranked) x resolution` however large the budget; the rounding only ever
    overestimates a cost, so the chosen spans always fit.

    Args:
        ranked: `(span, score)` best first, as `rank_for_recall` returns them.
        costs: What attending each ranked span costs (bytes, or any unit `room` is in).
        room: The capacity; None = unlimited.
        relative_floor: Fraction of the best score a span needs to compete.
        resolution: Capacity buckets of the dynamic programme.

    Returns:
        Chosen indices, in ranked order (best first).
    """
    if not ranked or ranked[0][1] <= 0:
        return []
    floor = ranked[0][1] * relative_floor
    eligible = [i for i, (_, score) in enumerate(ranked) if score > 0 and score >= floor]
    if room is None or sum(costs[i] for i in eligible) <= room:
        return eligible
    first: list[int] = []
    if costs[eligible[0]] <= room:
        first = [eligible[0]]
        room -= costs[eligible[0]]
        eligible = eligible[1:]
    return first + _knapsack(
        [ranked[i][1] for i in eligible], [costs[i] for i in eligible], eligible, room, resolution
    )


def _knapsack(
    values: Sequence[float], costs: Sequence[int], ids: Sequence[int], room: int, resolution: int
) -> list[int]:
    """The ids whose summed value is largest with summed cost at most `room` (sorted)."""
    if not ids or room <= 0:
        return []
    unit = max(1, math.ceil(room / resolution))
    capacity = room // unit
    best = torch.zeros(capacity + 1, dtype=torch.float64)  # best[c]: most value within c units
    taken = torch.zeros(len(ids), capacity + 1, dtype=torch.bool)
    weights = [math.ceil(cost / unit) for cost in costs]
    for row, (value, weight) in enumerate(zip(values, weights, strict=True)):
        if weight > capacity:
            continue
        with_item = torch.full_like(best, -1.0)
        with_item[weight:] = best[: capacity + 1 - weight] + value
        taken[row] = with_item > best
        best = torch.maximum(best, with_item)
    chosen: list[int] = []
    c = capacity
    for row in range(len(ids) - 1, -1, -1):
        if taken[row, c]:
            chosen.append(ids[row])
            c -= weights[row]
    return sorted(chosen)
