"""Recall plans with what a span costs at the floor of the demotion order.

With the attended quantized tier the budget holds every span at int4 in attention before
it archives any, so recall counts a span it brings back (and the pinned and active spans
that cannot leave) at int4 size, with the sinks and the residual window at full precision.
A long tool result that could never come back at full precision under a tight budget comes
back, and the budget check after the prefill still meets the limit.
"""

from __future__ import annotations

from typing import Any

import torch

from agentkv import AgentKVConfig, SpanState, Tier, TransformersBackend
from agentkv.events import ToolCallCompleted
from agentkv.spans import Span, SpanKind
from tests.unit.store_moves import quantize

FILLER = "build log line ok compiled module linked fine "
TOOL_TEXT = FILLER * 12 + "error code KX7-4471 in step nine " + FILLER * 12
QUESTION = "Which error code KX7-4471 was in the build?"


def history() -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Please run the build and tell me how it went."},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "name": "build", "args": {}}]},
        {"role": "tool", "content": TOOL_TEXT, "tool_call_id": "call_1"},
        {"role": "assistant", "content": "The build ran."},
        {"role": "user", "content": "note: the release train leaves on friday"},
        {"role": "assistant", "content": "noted"},
    ]


def tool_span(session: Any) -> Span:
    return next(s for s in session.spans if s.kind is SpanKind.TOOL_RESULT)


def archived_then_asked(model: Any, tokenizer: Any, **config: Any) -> tuple[Any, Span, int]:
    """The tool result committed, archived (dropped), then a question naming its code."""
    free = TransformersBackend(model, tokenizer, AgentKVConfig()).session("free")
    free.extend(history())
    tool_tokens = tool_span(free).length
    bpt = free.runner.bytes_per_token
    # The limit holds much less than the tool result at full precision, far more than at int4.
    budget_tokens = tool_tokens // 2
    data = {"archive_tier": "drop", "budget": {"device_tokens": budget_tokens}, **config}
    session = TransformersBackend(model, tokenizer, AgentKVConfig.from_dict(data)).session("t")
    session.extend(history())
    session.apply(ToolCallCompleted(tool_call_id="call_1"))
    tool = tool_span(session)
    if tool.tier.attended:  # what budget pressure does to it
        assert session.manager.move(tool, SpanState.ARCHIVED, reason="test") is not None
        session.manager.recallable.add(tool.span_id)
    assert tool.tier is Tier.DROPPED
    session.extend([*history(), {"role": "user", "content": QUESTION}])
    session.check()
    return session, tool, budget_tokens * bpt


def test_attended_token_bytes_is_what_a_long_span_costs_quantized(tiny_model, tiny_tokenizer):
    session = TransformersBackend(tiny_model, tiny_tokenizer, AgentKVConfig()).session("t")
    session.extend(history())
    store = session.store
    floor = store.attended_floor()
    assert floor is not None
    assert floor.exact_token_bytes == session.runner.bytes_per_token
    assert floor.exact_tokens == 4 + 64  # the default sinks and residual window
    before = store.bytes_by_tier().device
    tool = tool_span(session)
    freed = quantize(store, [tool])
    assert tool.tier is Tier.ATTENDED_QUANTIZED
    n = store.attended_quantized_tokens(tool)
    assert n > 64
    # Its keys are held at 8 bits (the default) until pressure drops their fine planes.
    fine = n * floor.fine_token_bytes
    assert store.fine_key_tokens(tool) == n and fine > 0
    held = n * floor.exact_token_bytes - freed
    assert n * floor.token_bytes + fine <= held <= floor.span_cost(n) + fine
    assert store.coarsen_attended_until([tool], fine) == fine
    freed += fine
    # At the floor the span costs at least its tokens and at most that plus one key group's statistics.
    held = n * floor.exact_token_bytes - freed
    assert n * floor.token_bytes <= held <= floor.span_cost(n)
    assert floor.span_cost(n) - n * floor.token_bytes == floor.span_bytes > 0
    assert store.bytes_by_tier().device == before - freed
    off = TransformersBackend(
        tiny_model, tiny_tokenizer, AgentKVConfig.from_dict({"quantization": {"attended_bits": None}})
    )
    assert off.session("u").store.attended_floor() is None


def test_recall_brings_back_a_span_that_fits_once_quantized(tiny_model, tiny_tokenizer):
    session, tool, limit = archived_then_asked(tiny_model, tiny_tokenizer)
    assert tool.state is SpanState.COMMITTED and tool.tier.attended, "recalled (recomputed)"
    stats = session.stats()
    assert stats.budget_satisfied and stats.device_bytes <= limit
    assert stats.attended_quantized_tokens > 0  # it fits because lower-priority spans went to int4
    # The recomputed span holds every token of the tool result, in attention.
    held = session.store.attended_tokens(tool, keys=False, queries=False)
    assert held is not None and sorted(held.offsets.tolist()) == list(range(tool.length))
    logits = session.continuation_logits([5, 6, 7])
    assert torch.isfinite(logits).all()


def test_without_the_attended_tier_the_same_span_has_no_room(tiny_model, tiny_tokenizer):
    session, tool, limit = archived_then_asked(
        tiny_model, tiny_tokenizer, quantization={"attended_bits": None}
    )
    assert tool.tier is Tier.DROPPED, "at full precision the tool result is larger than the whole budget"
    assert session.stats().device_bytes <= limit
