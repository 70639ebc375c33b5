"""Store verbs applied the way the lifecycle's mover applies them: the verb, then the tier it returns.

A store never writes `span.tier` (the mover does); a test that drives a store directly uses these
helpers, so each span's tier keeps saying what the store holds (`KVStore.check` compares the two).
"""

from __future__ import annotations

from collections.abc import Sequence

from agentkv.spans import Span
from agentkv.store.kvstore import KVStore
from agentkv.store.protocol import MoveResult


def write_tiers(spans: Sequence[Span], result: MoveResult) -> None:
    """Write the tiers a verb returned on the spans it names."""
    for span in spans:
        span.tier = result.tiers.get(span.span_id, span.tier)


def quantize(store: KVStore, spans: Sequence[Span], free_bytes: int | None = None) -> int:
    """Hold `spans` quantized in attention, in order, until `free_bytes` (None: all); bytes freed."""
    result = store.quantize_attended_until(spans, free_bytes)
    write_tiers(spans, result)
    return result.freed


def archive(store: KVStore, span: Span, tier: str) -> None:
    """Move an attended span to the archive tier `tier`."""
    span.tier = store.archive(span, tier)


def restore(store: KVStore, spans: Sequence[Span]) -> None:
    """Bring archived spans back into attention."""
    write_tiers(spans, store.restore_many(spans))


def drop(store: KVStore, span: Span) -> None:
    """Release a span's KV."""
    span.tier = store.drop(span)
