"""Lazy rehydration: a dropped span's KV is recomputed from its token ids when it is needed again.

Nothing the agent said is lost, only moved: every span keeps its token ids, so
an evicted span can come back by running its tokens through the model at their
logical positions (the session's `recompute`, with a mask by logical position).
"""

from __future__ import annotations

from agentkv.lifecycle.port import SessionPort
from agentkv.spans import Span, Tier


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
