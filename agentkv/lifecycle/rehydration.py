"""Lazy rehydration: a dropped span's KV is recomputed from its token ids when it is needed again.

Nothing the agent said is lost, only moved: every span keeps its token ids, so
an evicted span can come back by running its tokens through the model at their
logical positions (the session's `recompute`, with a mask by logical position).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from agentkv.spans import Span, Tier
from agentkv.store.protocol import KVStoreProtocol

Recompute = Callable[[Span], None]
"""`SessionPort.recompute`: compute a dropped span's KV at its logical positions (raises on failure)."""
RecomputeOffsets = Callable[[Sequence[tuple[Span, Sequence[int]]]], dict[int, Tier]]
"""`SessionPort.recompute_offsets`: some tokens of attended spans at full precision; their tiers after."""


def rehydrate(span: Span, store: KVStoreProtocol, recompute: Recompute) -> Tier | None:
    """Recompute a dropped span's KV; the span is then attended, uncompressed and unfrozen.

    Exact when every token logically before the span is attended at full
    precision; otherwise the span is recomputed against what the cache holds
    now (an approximation, as with any lazy rehydration).

    Returns:
        The tier the span is on now, for the mover to write (None: it was not dropped, nothing done).

    Raises:
        Exception: whatever the recompute raised; the span stays dropped.
    """
    if span.tier is not Tier.DROPPED:
        return None
    if span.n_computed:
        recompute(span)
    tier = store.adopt_recomputed(span)
    span.frozen = False
    return tier


def rehydrate_lazily(span: Span, store: KVStoreProtocol) -> Tier | None:
    """Make a dropped span attended with all its tokens pending: the next prefill recomputes it.

    Its tokens join whatever that prefill encodes (a new user turn), at their logical
    positions, so bringing it back costs no forward of its own, where the store's
    prefill computes pending spans (`KVStoreProtocol.recompute_lazily`).

    Returns:
        The tier the span is on now, for the mover to write; None (nothing changed) when the
        span is not dropped or the store cannot.
    """
    if span.tier is not Tier.DROPPED:
        return None
    tier = store.recompute_lazily(span)
    if tier is None:
        return None
    span.frozen = False
    return tier
