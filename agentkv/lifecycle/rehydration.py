"""Lazy rehydration: a dropped span's KV is recomputed from its token ids when it is needed again.

Nothing the agent said is lost, only moved: every span keeps its token ids, so
an evicted span can come back by running its tokens through the model at their
logical positions (the session's `recompute`, with a mask by logical position).
"""

from __future__ import annotations

from agentkv.lifecycle.port import SessionPort
from agentkv.spans import Span, Tier
from agentkv.store.kvstore import KVStore


def rehydrate(span: Span, port: SessionPort) -> None:
    """Recompute a dropped span's KV; the span is then attended, uncompressed and unfrozen.

    Exact when every token logically before the span is attended at full
    precision; otherwise the span is recomputed against what the cache holds
    now (an approximation, as with any lazy rehydration).

    Raises:
        Exception: whatever the recompute raised; the span stays dropped.
    """
    if span.tier is not Tier.DROPPED:
        return
    if span.n_computed:
        port.recompute(span)
    port.store.adopt_recomputed(span)
    span.frozen = False
    port.table.counters.rehydrated_tokens += span.n_computed


def rehydrate_lazily(span: Span, port: SessionPort) -> bool:
    """Make a dropped span attended with all its tokens pending: the next prefill recomputes it.

    Its tokens join whatever that prefill encodes (a new user turn), at their logical
    positions, so bringing it back costs no forward of its own. Only the local
    `KVStore`, whose prefill computes every pending span, supports it.

    Returns:
        False (nothing changed) when the span is not dropped or the store cannot.
    """
    if span.tier is not Tier.DROPPED or not isinstance(port.store, KVStore):
        return False
    span.n_computed = 0
    port.store.adopt_recomputed(span)
    span.frozen = False
    port.table.counters.rehydrated_tokens += span.length
    return True
