"""Intent relevance: keep (and recall) what the new input is about.

In the spirit of IntentKV-style query-aware selection (and of Quest, Tang et al.
2024, https://arxiv.org/abs/2406.10774, which ranks KV pages by their best
query·key score): generic scorers look at the attention of past queries, which
forgets facts nobody asked about yet. When the user's new turn arrives, its
queries say what is needed *now*; a token whose key scores high against any of
them is relevant. The same measure over whole spans (`span_relevance`) ranks
archived spans for recall.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from agentkv.policies.base import Policy, SpanView


@dataclass
class IntentPolicy(Policy):
    """Score token i = max over new-input queries of q·k_i/sqrt(D), averaged over layers and heads.

    Uses `view.query_states` (the new input's RoPE'd queries, the true attention
    logits) when present, else `view.query_keys` (key-to-key similarity: cheaper to
    collect, only a proxy because keys and queries live in different projections).
    """

    needs_attention = False
    needs_query = True
    needs_keys = True

    def score(self, view: SpanView) -> torch.Tensor:
        """`[n]` float32 CPU relevance of each candidate to the new input."""
        queries = view.query_states if view.query_states is not None else view.query_keys
        if queries is None:
            msg = "IntentPolicy needs view.query_states or view.query_keys (needs_query=True); got neither"
            raise ValueError(msg)
        per_layer = []
        for q, k in _layer_pairs(queries, view.keys):
            logits = _logits(q, k)  # [B, H, m, n]
            per_layer.append(logits.amax(dim=-2).mean(dim=(0, 1)).cpu())  # [n]
        if not per_layer:
            return torch.zeros(view.num_tokens)
        return torch.stack(per_layer).mean(dim=0)


def span_relevance(queries: Sequence[torch.Tensor], span_keys: Sequence[torch.Tensor]) -> float:
    """How relevant a whole span is to the new input: ColBERT-style MaxSim over layers and heads.

    For each query token, its best q·k/sqrt(D) over the span's tokens; averaged over
    query tokens, batch, heads and layers. Averaging over queries (rather than a
    max of maxes) rewards spans that answer several parts of the input and is less
    noisy; it does not grow with span length, so long spans are not favoured.

    Args:
        queries: Per layer, the new input's queries `[B, H_q, m, D]` or keys `[B, H_kv, m, D]`.
        span_keys: Per layer, the span's keys `[B, H_kv, n, D]`, on any device (an
            archived span's keys usually live on the CPU; queries are moved to them).

    Returns:
        The relevance (higher = recall first); `-inf` for a span with no tokens.

    Raises:
        ValueError: Layer counts or head counts do not match.
    """
    per_layer = []
    for q, k in _layer_pairs(queries, span_keys):
        if k.shape[-2] == 0 or q.shape[-2] == 0:
            return float("-inf")
        logits = _logits(q, k)  # [B, H, m, n]
        per_layer.append(logits.amax(dim=-1).mean())
    if not per_layer:
        return float("-inf")
    return float(torch.stack([p.cpu() for p in per_layer]).mean())


def _layer_pairs(
    queries: Sequence[torch.Tensor], keys: Sequence[torch.Tensor]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    if len(queries) != len(keys):
        msg = f"queries cover {len(queries)} layers but keys cover {len(keys)}; expected the same layers"
        raise ValueError(msg)
    return list(zip(queries, keys, strict=True))


def _logits(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """q·kᵀ/sqrt(D) with keys repeated over each query group (GQA): `[B, H_q, m, n]`."""
    heads_q, heads_k = q.shape[1], k.shape[1]
    if heads_q % heads_k:
        msg = f"query heads ({heads_q}) must be a multiple of key heads ({heads_k})"
        raise ValueError(msg)
    k = k.float().repeat_interleave(heads_q // heads_k, dim=1)  # [B, H_q, n, D]
    q = q.to(k.device).float()  # [B, H_q, m, D]
    return torch.matmul(q, k.transpose(-1, -2)) * q.shape[-1] ** -0.5
