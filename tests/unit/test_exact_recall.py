"""Recall recomputes the relevant spans the budget holds quantized at full precision, when the room allows.

The attended quantized tier keeps a span in view at int4; the question that asks to quote
a code from it gets the span recomputed from its token ids instead, at full precision. With
every token before the span exact, that is the full cache again: the logits match it.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from agentkv import AgentKVConfig, SpanState, Tier, TransformersBackend
from agentkv.events import ToolCallCompleted
from agentkv.spans import Span, SpanKind
from tests.unit.held_kv import span_keys
from tests.unit.store_moves import quantize
from tests.unit.window_models import build_case, case_params

FILLER = "build log line ok compiled module linked fine "
TOOL_TEXT = FILLER * 10 + "error code KX7-4471 in step nine " + FILLER * 10
QUESTION = "Which error code KX7-4471 was in the build?"
NOTES = [
    f"note {k}: the release train for the {k}th team leaves on friday at the usual dock" for k in range(8)
]


def history() -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Please run the build and tell me how it went."},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "name": "build", "args": {}}]},
        {"role": "tool", "content": TOOL_TEXT, "tool_call_id": "call_1"},
        {"role": "assistant", "content": "The build ran."},
    ]
    for note in NOTES:
        messages += [{"role": "user", "content": note}, {"role": "assistant", "content": "noted"}]
    return messages


def asked() -> list[dict[str, Any]]:
    return [*history(), {"role": "user", "content": QUESTION}]


def tool_span(session: Any) -> Span:
    return next(s for s in session.spans if s.kind is SpanKind.TOOL_RESULT)


def quantized_then_asked(
    model: Any, tokenizer: Any, budget_tokens: int, on_ask: Any = None, **config: Any
) -> tuple[Any, Span]:
    """The tool result committed and held at int4 in attention, then a question naming its code."""
    # The old order by name holds the tool result at int4 (the default archives it, a note being needed).
    data = {"budget": {"device_tokens": budget_tokens, "placement_order": "attended_first"}, **config}
    session = TransformersBackend(model, tokenizer, AgentKVConfig.from_dict(data)).session("t")
    session.extend(history())
    session.apply(ToolCallCompleted(tool_call_id="call_1"))
    tool = tool_span(session)
    if not session.store.attended_quantized_tokens(tool):  # what budget pressure does to it
        quantize(session.store, [tool])
    assert session.store.attended_quantized_tokens(tool) > 0 and tool.tier is Tier.ATTENDED_QUANTIZED
    if on_ask is not None:
        on_ask(session)
    session.extend(asked())
    session.check()
    return session, tool


def no_room_at_the_floor(model: Any, tokenizer: Any) -> int:
    """A device budget in tokens that every token at int4 already fills to the low watermark."""
    free = TransformersBackend(model, tokenizer, AgentKVConfig()).session("free")
    free.extend(asked())
    floor = free.store.attended_floor()
    assert floor is not None
    bpt, low = floor.exact_token_bytes, AgentKVConfig().budget.low_watermark
    at_floor = floor.span_cost(free.logical_length) + floor.exact_surplus
    return int(at_floor / (low * bpt)) - 2


KEYS_AT_4 = {"quantization": {"attended_key_bits": 4}}
"""Keys held at 4 bits (the default is 8): every quantized token at the floor, as room is counted."""


def full_cache_logits(model: Any, tokenizer: Any) -> torch.Tensor:
    free = TransformersBackend(model, tokenizer, AgentKVConfig()).session("free")
    free.extend(asked())
    return free.continuation_logits([5, 6, 7])


def test_the_asked_span_is_recomputed_exact_and_the_logits_are_the_full_caches(
    tiny_model, tiny_tokenizer, monkeypatch
):
    forwards: list[int] = []

    def counted(runner_forward: Any) -> Any:
        def forward(cache: Any, feed: Any, **kwargs: Any) -> Any:
            forwards.append(len(feed))
            return runner_forward(cache, feed, **kwargs)

        return forward

    session, tool = quantized_then_asked(
        tiny_model,
        tiny_tokenizer,
        budget_tokens=100_000,
        on_ask=lambda s: monkeypatch.setattr(s.backend.runner, "forward", counted(s.backend.runner.forward)),
    )
    assert tool.state is SpanState.COMMITTED and tool.tier is Tier.DEVICE
    assert session.store.attended_quantized_tokens(tool) == 0
    assert session.stats().exact_recalled_tokens == tool.length
    # The recompute joined the question's prefill: one forward for both.
    (fed,) = forwards
    assert fed == tool.length + session.spans[-1].length
    # Every token before the tool result was exact, so recomputing it gives back the full cache.
    expected = full_cache_logits(tiny_model, tiny_tokenizer)
    torch.testing.assert_close(session.continuation_logits([5, 6, 7]), expected, rtol=1e-4, atol=1e-4)


def test_a_recomputed_span_is_encoded_by_the_call_not_read_from_the_cache(tiny_model, tiny_tokenizer):
    data = {"budget": {"device_tokens": 100_000, "placement_order": "attended_first"}}
    session = TransformersBackend(tiny_model, tiny_tokenizer, AgentKVConfig.from_dict(data)).session("t")
    session.extend(history())
    session.apply(ToolCallCompleted(tool_call_id="call_1"))
    tool = tool_span(session)
    quantize(session.store, [tool])
    result = session.extend(asked())
    assert session.stats().exact_recalled_tokens == tool.length
    assert result.prefilled_tokens == tool.length + session.spans[-1].length
    # Every attended token is read from the cache or encoded by this call, never both.
    assert result.reused_tokens + result.prefilled_tokens == session.logical_length


def test_switched_off_the_span_stays_quantized_and_the_logits_differ(tiny_model, tiny_tokenizer):
    session, tool = quantized_then_asked(
        tiny_model, tiny_tokenizer, budget_tokens=100_000, recall={"recompute_quantized": False}
    )
    assert session.store.attended_quantized_tokens(tool) > 0
    assert session.stats().exact_recalled_tokens == 0
    expected = full_cache_logits(tiny_model, tiny_tokenizer)
    assert not torch.allclose(session.continuation_logits([5, 6, 7]), expected, rtol=1e-4, atol=1e-4)


def test_the_upgrade_quantizes_lower_priority_spans_and_archives_none(tiny_model, tiny_tokenizer):
    free = TransformersBackend(tiny_model, tiny_tokenizer, AgentKVConfig()).session("free")
    free.extend(asked())
    floor = free.store.attended_floor()
    assert floor is not None
    total, tool_tokens = free.logical_length, tool_span(free).length
    bpt, low = floor.exact_token_bytes, AgentKVConfig().budget.low_watermark
    # Room for the tool result exact with everything else at int4, but not for the history exact.
    at_floor = floor.span_cost(total) + floor.exact_surplus + tool_tokens * (bpt - floor.token_bytes)
    budget_tokens = int(at_floor / (low * bpt)) + 8
    assert budget_tokens < total
    session, tool = quantized_then_asked(tiny_model, tiny_tokenizer, budget_tokens=budget_tokens, **KEYS_AT_4)
    assert session.store.attended_quantized_tokens(tool) == 0, "recomputed at full precision"
    stats = session.stats()
    assert stats.budget_satisfied and stats.device_bytes <= budget_tokens * bpt
    assert stats.attended_quantized_tokens > 0, "other spans went to int4 to make the room"
    # Only the released tool call left the device (the grace queue goes first); nothing was archived.
    kept = [s for s in session.spans if s.state in (SpanState.COMMITTED, SpanState.ACTIVE)]
    assert all(s.tier.attended for s in kept)
    assert not [s for s in session.spans if s.state is SpanState.ARCHIVED]


def test_without_room_at_full_precision_the_span_stays_quantized(tiny_model, tiny_tokenizer):
    free = TransformersBackend(tiny_model, tiny_tokenizer, AgentKVConfig()).session("free")
    free.extend(asked())
    # A limit the tool result exceeds at full precision on its own.
    budget_tokens = tool_span(free).length // 2 + 80
    session, tool = quantized_then_asked(tiny_model, tiny_tokenizer, budget_tokens=budget_tokens)
    # The tool result is not recomputed (a shorter relevant span may use the little room there is).
    assert session.stats().exact_recalled_tokens < tool.length
    assert tool.tier is not Tier.DEVICE  # still quantized in attention (or archived)
    assert session.stats().budget_satisfied


def test_a_span_compressed_at_commit_is_recomputed_holding_the_same_tokens(tiny_model, tiny_tokenizer):
    config = {"budget": {"device_tokens": 100_000}, "commit": {"keep_ratio": {"tool_result": 0.5}}}
    session = TransformersBackend(tiny_model, tiny_tokenizer, AgentKVConfig.from_dict(config)).session("t")
    session.extend(history()[:4])  # through the tool result, encoded
    session.apply(ToolCallCompleted(tool_call_id="call_1"))
    tool = tool_span(session)
    kept = tool.kept
    assert kept is not None and len(kept) < tool.length, "compressed at commit"
    session.extend(history())
    quantize(session.store, [tool])
    assert session.store.attended_quantized_tokens(tool) > 0
    session.extend(asked())
    session.check()
    assert session.store.attended_quantized_tokens(tool) == 0
    assert tool.kept == kept, "the recompute holds what the span held"
    assert session.stats().exact_recalled_tokens == tool.length


def test_room_left_after_the_protected_spans_goes_to_the_next_relevant_one(
    tiny_model, tiny_tokenizer, monkeypatch
):
    """Recall protecting nothing (its plan keeps no span) still leaves the spare room to exact recall.

    Which spans recall protects is a choice about bringing demoted spans back; with room to spare
    at the low watermark the relevant spans held at int4 are still recomputed, best match first.
    """
    import agentkv.lifecycle.recall as recall_module

    monkeypatch.setattr(recall_module.Recaller, "_plan", lambda *args, **kwargs: ([], []))
    session, tool = quantized_then_asked(tiny_model, tiny_tokenizer, budget_tokens=100_000)
    assert session.store.attended_quantized_tokens(tool) == 0, "recomputed at full precision"
    assert session.stats().exact_recalled_tokens >= tool.length


def page_of_code(session: Any, tool: Span) -> list[int]:
    """Offsets of the tool result's tokens that spell the error code."""
    texts = [session.backend.tokenizer.decode([t]) for t in tool.token_ids]
    ends = [len("".join(texts[: i + 1])) for i in range(len(texts))]
    start = "".join(texts).index("KX7-4471")
    return [i for i, end in enumerate(ends) if start < end <= start + len("KX7-4471") + len(texts[i])]


def test_a_span_too_long_for_the_room_gets_the_quoted_page_recomputed(tiny_model, tiny_tokenizer):
    free = TransformersBackend(tiny_model, tiny_tokenizer, AgentKVConfig()).session("free")
    free.extend(asked())
    floor = free.store.attended_floor()
    assert floor is not None
    total, tool_tokens = free.logical_length, tool_span(free).length
    bpt, low = floor.exact_token_bytes, AgentKVConfig().budget.low_watermark
    # Room at the floor for a quarter of the tool result in full precision, not for all of it.
    at_floor = floor.span_cost(total) + floor.exact_surplus + tool_tokens // 4 * (bpt - floor.token_bytes)
    budget_tokens = int(at_floor / (low * bpt)) + 8
    session, tool = quantized_then_asked(tiny_model, tiny_tokenizer, budget_tokens=budget_tokens)
    assert tool.tier is Tier.ATTENDED_QUANTIZED and tool.kept is None  # some of it is still held at int4
    quantized = set(session.store.quantized_offsets(tool))
    code = page_of_code(session, tool)
    assert not quantized & set(code), "the page holding the asked-for code is in full precision"
    assert quantized, "the rest of the tool result stays attended at int4"
    recomputed = session.stats().exact_recalled_tokens
    assert len(code) <= recomputed < tool.length
    assert session.stats().budget_satisfied


def test_a_recomputed_page_over_an_exact_context_holds_the_full_caches_kv(tiny_model, tiny_tokenizer):
    """Recomputing tokens in place replaces their int4 KV by exactly what the full cache holds there.

    The first page of the tool result attends only exact tokens (everything before the
    tool result, and its own page), so its recomputed keys and values are the full cache's.
    """
    free = TransformersBackend(tiny_model, tiny_tokenizer, AgentKVConfig()).session("free")
    free.extend(history())
    session = TransformersBackend(tiny_model, tiny_tokenizer, AgentKVConfig()).session("t")
    session.extend(history())
    tool = tool_span(session)
    quantize(session.store, [tool])
    page = session.store.quantized_offsets(tool)[:24]
    assert page and page == list(range(page[0], page[0] + 24))
    before = session.stats().attended_tokens
    assert session.manager.mover.recompute_offsets([(tool, page)], reason="test")
    session.check()
    assert tool.tier is Tier.ATTENDED_QUANTIZED  # the rest of the span is still held at int4
    assert session.stats().attended_tokens == before, "the page replaced its old copies"
    assert not set(page) & set(session.store.quantized_offsets(tool))
    got, want = span_keys(session, tool, page), span_keys(free, tool_span(free), page)
    for held, reference in zip(got, want, strict=True):
        torch.testing.assert_close(held, reference, rtol=1e-5, atol=1e-5)


def test_a_failed_page_recompute_is_a_recorded_fault_and_the_span_stays_quantized(
    tiny_model, tiny_tokenizer, monkeypatch
):
    free = TransformersBackend(tiny_model, tiny_tokenizer, AgentKVConfig()).session("free")
    free.extend(asked())
    floor = free.store.attended_floor()
    assert floor is not None
    total, tool_tokens = free.logical_length, tool_span(free).length
    bpt, low = floor.exact_token_bytes, AgentKVConfig().budget.low_watermark
    at_floor = floor.span_cost(total) + floor.exact_surplus + tool_tokens // 4 * (bpt - floor.token_bytes)
    budget_tokens = int(at_floor / (low * bpt)) + 8

    def broken(parts: Any) -> None:
        raise RuntimeError("device lost")

    session, tool = quantized_then_asked(
        tiny_model,
        tiny_tokenizer,
        budget_tokens=budget_tokens,
        on_ask=lambda s: monkeypatch.setattr(s.manager.mover, "recompute_tokens", broken),
    )
    assert session.stats().faults >= 1
    assert set(page_of_code(session, tool)) <= set(session.store.quantized_offsets(tool))
    assert tool.tier is Tier.ATTENDED_QUANTIZED and tool.state is SpanState.COMMITTED


def test_a_long_span_ranked_first_gives_its_pages_so_a_short_relevant_one_fits_whole(
    tiny_model, tiny_tokenizer
):
    """The room fits the whole tool result (ranked first), or its quoted pages and the short note.

    Taken whole, the tool result would spend the room the note needs; page by page, both get
    what the question asks about in full precision, and the room left goes back to the tool result.
    """
    note_text = "ticket TK-9981 covers KX7-4471"
    before = history()
    before[5:5] = [{"role": "user", "content": note_text}, {"role": "assistant", "content": "noted"}]
    free = TransformersBackend(tiny_model, tiny_tokenizer, AgentKVConfig()).session("free")
    free.extend([*before, {"role": "user", "content": QUESTION}])
    floor = free.store.attended_floor()
    assert floor is not None
    total, tool_tokens = free.logical_length, tool_span(free).length
    bpt, low = floor.exact_token_bytes, AgentKVConfig().budget.low_watermark
    # Room at the floor for the whole tool result in full precision and a token or two, not the note too.
    at_floor = floor.span_cost(total) + floor.exact_surplus + (tool_tokens + 2) * (bpt - floor.token_bytes)
    budget_tokens = int(at_floor / (low * bpt)) + 8
    data = {"budget": {"device_tokens": budget_tokens, "placement_order": "attended_first"}, **KEYS_AT_4}
    session = TransformersBackend(tiny_model, tiny_tokenizer, AgentKVConfig.from_dict(data)).session("t")
    session.extend(before)
    session.apply(ToolCallCompleted(tool_call_id="call_1"))
    tool = tool_span(session)
    note = next(s for s in session.spans if note_text in tiny_tokenizer.decode(s.token_ids))
    for span in (tool, note):
        if not session.store.attended_quantized_tokens(span):
            quantize(session.store, [span])
        assert session.store.attended_quantized_tokens(span) > 0
    assert note.length + 4 < 2 * AgentKVConfig().recall.page_tokens < tool.length
    session.extend([*before, {"role": "user", "content": QUESTION}])
    session.check()
    assert session.store.attended_quantized_tokens(note) == 0, "the short note quoting the code is exact"
    quantized = set(session.store.quantized_offsets(tool))
    assert not quantized & set(page_of_code(session, tool)), "the tool result's quoted page is exact"
    assert quantized, "the tool result is not recomputed whole"
    assert session.stats().budget_satisfied


def test_with_no_room_at_the_floor_spans_the_question_does_not_need_leave_for_its_best_match(
    tiny_model, tiny_tokenizer
):
    """Every token at int4 already fills the budget: the quoted page is made room for, not left at int4.

    The spans the question does not need give up attention first (they stay recallable
    from their token ids); the budget still holds.
    """
    budget_tokens = no_room_at_the_floor(tiny_model, tiny_tokenizer)
    session, tool = quantized_then_asked(tiny_model, tiny_tokenizer, budget_tokens=budget_tokens, **KEYS_AT_4)
    assert tool.tier.attended
    quantized = set(session.store.quantized_offsets(tool))
    assert not quantized & set(page_of_code(session, tool)), "the page holding the asked-for code is exact"
    gone = [s for s in session.spans if s.state is SpanState.ARCHIVED]  # the default archive: the host
    assert gone, "a committed span the question does not need left attention to make the room"
    assert all(s.span_id in session.recallable for s in gone), "what left can come back"
    waiting = [s for s in session.spans if s.state is SpanState.EVICTABLE and s.tier.attended]
    assert not waiting, "released scaffolding leaves before any committed span"
    assert session.stats().budget_satisfied


def test_with_8_bit_keys_held_the_room_comes_from_fine_planes_before_any_span_leaves(
    tiny_model, tiny_tokenizer
):
    """The same budget with keys at 8 bits (the default): one plan makes the room, by the rungs' costs.

    Holding a key at 4 bits is a step of the plan like any other: the spans the question
    does not need drop their fine planes before any of them leaves attention.
    """
    budget_tokens = no_room_at_the_floor(tiny_model, tiny_tokenizer)
    session, tool = quantized_then_asked(tiny_model, tiny_tokenizer, budget_tokens=budget_tokens)
    quantized = set(session.store.quantized_offsets(tool))
    assert not quantized & set(page_of_code(session, tool)), "the page holding the asked-for code is exact"
    gone = [s for s in session.spans if s.state is SpanState.ARCHIVED]
    assert not gone or session.store.fine_key_tokens() == 0, "a span left while fine planes were held"
    assert session.stats().budget_satisfied


@pytest.mark.parametrize("case", case_params(["gemma3", "qwen2-window"]))
def test_on_a_windowed_model_the_recomputed_span_attends_the_window_before_it(case: str, tiny_tokenizer):
    """The sliding layers dropped the window before the tool result; its recompute gets it back exactly."""
    model = build_case(case)
    session, tool = quantized_then_asked(model, tiny_tokenizer, budget_tokens=100_000)
    assert tool.tier is Tier.DEVICE and session.stats().exact_recalled_tokens == tool.length
    expected = full_cache_logits(model, tiny_tokenizer)
    torch.testing.assert_close(session.continuation_logits([5, 6, 7]), expected, rtol=1e-4, atol=1e-4)
