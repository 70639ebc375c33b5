"""Ranking archived spans by relevance to a new user message, before the model answers it.

Recall must decide *before* the new message is encoded (so that the message's
own KV is computed with the recalled spans in view), which rules out signals
that need a forward pass. Two cheap signals, both from the model's own
vocabulary: IDF-weighted token overlap (what BM25 does: "code" and "4417" in
the question find the span that said them) and the cosine of mean input
embeddings (near-synonyms). A span with no lexical overlap is not recalled:
embeddings alone are too weak a signal to spend budget on.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from agentkv.spans import Span

EMBEDDING_WEIGHT = 0.25


def _idf(spans: Sequence[Span]) -> dict[int, float]:
    """Inverse document frequency of each token id over the session's spans."""
    df: dict[int, int] = {}
    for span in spans:
        for token in set(span.token_ids):
            df[token] = df.get(token, 0) + 1
    n = len(spans)
    return {t: max(0.0, math.log((n + 1) / (count + 0.5))) for t, count in df.items()}


def _mean_embedding(embed: Any, ids: Sequence[int]) -> torch.Tensor | None:
    if embed is None or not ids:
        return None
    weight = embed.weight
    index = torch.tensor(list(set(ids)), dtype=torch.long, device=weight.device)
    return weight.index_select(0, index).float().mean(0).cpu()  # [hidden]


def rank_for_recall(
    query_ids: Sequence[int], candidates: Sequence[Span], all_spans: Sequence[Span], *, embed: Any = None
) -> list[tuple[Span, float]]:
    """Candidates sorted by relevance to the query (best first), with their scores.

    Args:
        query_ids: token ids of the new user message's content.
        candidates: spans that may be recalled.
        all_spans: every span of the session (for IDF statistics).
        embed: the model's input embedding module (optional).
    """
    idf = _idf(all_spans)
    query = set(query_ids)
    total = sum(idf.get(t, 0.0) for t in query)
    query_vec = _mean_embedding(embed, query_ids)
    ranked: list[tuple[Span, float]] = []
    for span in candidates:
        tokens = set(span.token_ids)
        lexical = sum(idf.get(t, 0.0) for t in query & tokens) / total if total > 0 else 0.0
        score = lexical
        if lexical > 0 and query_vec is not None:
            span_vec = _mean_embedding(embed, span.token_ids)
            if span_vec is not None:
                score += EMBEDDING_WEIGHT * float(torch.cosine_similarity(query_vec, span_vec, dim=0))
        ranked.append((span, score if lexical > 0 else 0.0))
    ranked.sort(key=lambda item: (item[1], item[0].start), reverse=True)
    return ranked
