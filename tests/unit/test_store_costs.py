"""The store's byte counts per span and rung (`agentkv.store.costs`): what a move does, it says first.

Every figure is checked against the tensors the cache holds after the move it predicts:
quantizing a span (8-bit or 4-bit keys), dropping its fine planes, removals pending compaction.
"""

from __future__ import annotations

from typing import Any

import pytest

from agentkv import AgentKVConfig, TransformersBackend
from tests.unit.attended_sessions import attended_session
from tests.unit.store_accounting import held_bytes


def _session(tiny_model: Any, tiny_tokenizer: Any, key_bits: int) -> Any:
    session = attended_session(tiny_model, tiny_tokenizer, key_bits)
    history: list[dict[str, Any]] = [{"role": "system", "content": "You are a helpful assistant."}]
    for turn in range(5):
        history.append({"role": "user", "content": f"lorem ipsum dolor {turn} sit amet " * (3 + 2 * turn)})
    session.extend(history)
    return session


def _held(session: Any) -> int:
    return held_bytes(session)[0]


@pytest.mark.parametrize("key_bits", [8, 4])
def test_each_rung_costs_what_the_move_leaves(tiny_model: Any, tiny_tokenizer: Any, key_bits: int) -> None:
    session = _session(tiny_model, tiny_tokenizer, key_bits)
    store = session.store
    spans = [s for s in session.spans if s.tier.attended]
    assert len(spans) >= 4
    store.quantize_attended_until(spans[:1], None)  # make the layers quantized ones: a mixed cache
    for span in spans:
        costs = store.attended_costs(spans)
        assert sum(c.now for c in costs.values()) == _held(session) == store.bytes_by_tier().device
        mine = costs[span.span_id]
        before = _held(session)
        if mine.quantizable:
            result = store.quantize_attended_until([span], None)
            span.tier = result.tiers.get(span.span_id, span.tier)
        after = store.attended_costs(spans)[span.span_id]
        assert _held(session) - before == (mine.keys8 if key_bits == 8 else mine.coarse) - mine.now
        assert after.now == (mine.keys8 if key_bits == 8 else mine.coarse)
        assert after.quantizable == 0 and after.quantized == mine.quantized + mine.quantizable
        if key_bits == 8:
            assert after.fine == after.quantized and after.keys8 == after.now
            held = _held(session)
            freed = store.coarsen_attended_until([span], 1 << 40)
            assert freed == after.now - after.coarse == held - _held(session)
            assert store.attended_costs(spans)[span.span_id].now == after.coarse
        else:
            assert mine.keys8 is None and after.fine == 0
    costs = store.attended_costs(spans)
    assert sum(c.now for c in costs.values()) == _held(session)


def test_removals_pending_compaction_are_counted_as_gone(tiny_model: Any, tiny_tokenizer: Any) -> None:
    session = _session(tiny_model, tiny_tokenizer, 8)
    store = session.store
    spans = [s for s in session.spans if s.tier.attended]
    store.quantize_attended_until(spans, None)
    gone = spans[2]
    kept = [s for s in spans if s is not gone]
    with store.deferred_removal():
        gone.tier = store.drop(gone)
        pending = store.bytes_by_tier().device
        predicted = sum(c.now for c in store.attended_costs(kept).values())
    assert pending == predicted == _held(session) == store.bytes_by_tier().device


@pytest.mark.parametrize("tier", ["int8", "int4", "host"])
def test_an_archive_costs_what_the_block_holds(tiny_model: Any, tiny_tokenizer: Any, tier: str) -> None:
    session = _session(tiny_model, tiny_tokenizer, 8)
    store = session.store
    spans = [s for s in session.spans if s.tier.attended]
    store.quantize_attended_until(spans[1:2], None)  # one archived from the attended quantized tier
    for span in spans[1:3]:
        predicted = store.attended_costs([span])[span.span_id]
        before = store.bytes_by_tier()
        span.tier = store.archive(span, tier)
        after = store.bytes_by_tier()
        if tier == "host":
            assert after.host - before.host == predicted.host == store.span_bytes(span)
        else:
            assert after.quantized - before.quantized == getattr(predicted, tier) == store.span_bytes(span)
        assert before.device - after.device == predicted.now


@pytest.mark.parametrize("tier", ["int8", "int4"])
def test_without_an_attended_tier_an_archive_on_the_device_is_still_counted(
    tiny_model: Any, tiny_tokenizer: Any, tier: str
) -> None:
    quantization = {"attended_bits": None}
    data: dict[str, Any] = {"policy": "lifecycle", "archive_tier": tier, "quantization": quantization}
    session = TransformersBackend(tiny_model, tiny_tokenizer, AgentKVConfig.from_dict(data)).session("s")
    session.extend([{"role": "user", "content": f"lorem ipsum {turn} sit amet " * 6} for turn in range(3)])
    store = session.store
    spans = [s for s in session.spans if s.tier.attended]
    costs = store.attended_costs(spans)
    # Nothing is quantizable in attention: the span's only step down is its archive, at the block's bytes.
    assert all(c.quantizable == 0 and c.keys8 is None and c.coarse == c.now for c in costs.values())
    span = spans[1]
    before = store.bytes_by_tier()
    span.tier = store.archive(span, tier)
    after = store.bytes_by_tier()
    assert after.quantized - before.quantized == getattr(costs[span.span_id], tier) > 0
    assert store.archived_device_bytes() == after.quantized
