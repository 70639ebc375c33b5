"""Page recall and question-observed compression on a real (tiny) model.

Page recall brings back the pages of an archived long span that the new question
needs (`agentkv.lifecycle.pages`); question-observed compression keeps the tokens
of a tool result that its turn's question attends to (`commit.observe: question`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812 - the usual torch alias

from agentkv import AgentKVConfig, SpanState, Tier, TransformersBackend
from agentkv.events import ToolCallCompleted
from agentkv.lifecycle.compression import SNAP_KERNEL, observation_window
from agentkv.lifecycle.pages import QUEST_SKIP_LAYERS
from agentkv.spans import Span, SpanKind
from agentkv.store.digest import score_pages

TOL = 1e-4
PROBE = [5, 6, 7]
FILLER = "build log line ok compiled module linked fine "
TOOL_TEXT = FILLER * 6 + "error code KX7-4471 in step nine " + FILLER * 6


def _history(tool_text: str = TOOL_TEXT) -> list[dict]:
    return [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Please run the build and tell me how it went."},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "name": "build", "args": {}}]},
        {"role": "tool", "content": tool_text, "tool_call_id": "call_1"},
        {"role": "assistant", "content": "The build ran."},
    ]


def _session(model, tokenizer, **config):
    data = {"archive_tier": "drop", "recall": {"pages": True, "page_tokens": 8, "attention_weight": 0.0}}
    data.update(config)
    backend = TransformersBackend(model, tokenizer, AgentKVConfig.from_dict(data))
    return backend, backend.session("t")


def _archive(session, span) -> None:
    """What budget pressure does to a span: archive it (dropped: nothing on host) and make it recallable."""
    assert session.manager.move(span, SpanState.ARCHIVED, reason="test") is not None
    session.manager.recallable.add(span.span_id)
    assert span.tier is Tier.DROPPED and span.state is SpanState.EVICTED  # archived to `drop`


def _tool(session):
    return next(s for s in session.spans if s.kind is SpanKind.TOOL_RESULT)


def _commit_tool(session) -> None:
    session.apply(ToolCallCompleted(tool_call_id="call_1"))
    assert _tool(session).state is SpanState.COMMITTED


def test_a_committed_span_gets_a_digest_counted_in_the_device_budget(tiny_model, tiny_tokenizer):
    _, session = _session(tiny_model, tiny_tokenizer)
    session.extend(_history())
    _commit_tool(session)
    tool = _tool(session)
    digest = session.store.page_digest(tool)
    assert digest is not None
    assert digest.num_tokens == tool.length and digest.page_tokens == 8
    assert len(digest.mins) == tiny_model.config.num_hidden_layers - QUEST_SKIP_LAYERS
    tiers = session.store.bytes_by_tier()
    digests = [session.store.page_digest(s) for s in session.spans]
    assert tiers.digest == sum(d.nbytes for d in digests if d is not None) > 0
    assert session.stats().budget_used_bytes == tiers.device + tiers.quantized + tiers.digest
    assert session.stats().digest_bytes == tiers.digest
    # The digest outlives the span's KV: it is what recall scores once the span is dropped.
    _archive(session, tool)
    assert session.store.page_digest(tool) is not None
    session.check()


def _asked_about_the_archived_code(tiny_model: Any, tiny_tokenizer: Any) -> tuple[Any, Span]:
    """A session whose tool result was committed and archived, then a question naming its code."""
    _, session = _session(tiny_model, tiny_tokenizer)
    history = _history()
    session.extend(history)
    _commit_tool(session)
    tool = _tool(session)
    _archive(session, tool)
    history.append({"role": "user", "content": "Which error code did KX7-4471 step report?"})
    session.extend(history)
    return session, tool


def test_page_recall_brings_back_only_the_page_the_question_names(tiny_model, tiny_tokenizer):
    session, tool = _asked_about_the_archived_code(tiny_model, tiny_tokenizer)

    assert tool.state is SpanState.COMMITTED and tool.tier is Tier.DEVICE
    assert tool.kept is not None and 0 < len(tool.kept) < tool.length
    # Every kept token lies in a page that holds a piece of the code, and the code's page is kept.
    code = tiny_tokenizer.encode("KX7-4471", add_special_tokens=False)
    text = tool.token_ids
    hit = next(i for i in range(len(text)) if text[i : i + len(code)] == code)
    assert hit in tool.kept
    assert {o // 8 for o in tool.kept} <= {(hit + j) // 8 for j in range(-8, len(code) + 8)}
    assert session.stats().page_recalled_tokens == len(tool.kept)
    session.check()


def test_recalled_pages_give_the_logits_of_a_full_cache_restricted_to_them(tiny_model, tiny_tokenizer):
    session, tool = _asked_about_the_archived_code(tiny_model, tiny_tokenizer)
    assert tool.kept is not None and len(tool.kept) < tool.length

    # Reference: one plain forward over every token. The assistant's answer was encoded while
    # the whole result was attended; the new question and the probe see only the kept offsets
    # (every token before the result is attended, so the recompute is exact).
    ids = session.token_ids() + PROBE
    n = len(ids)
    question = session.spans[-2] if session.spans[-1].kind is SpanKind.PROMPT else session.spans[-1]
    assert question.kind is SpanKind.USER
    allowed = torch.ones(n, n).tril().bool()
    hidden = [tool.start + o for o in range(tool.length) if o not in set(tool.kept)]
    allowed[question.start :, hidden] = False
    mask = torch.zeros(1, 1, n, n).masked_fill(~allowed, torch.finfo(torch.float32).min)
    with torch.inference_mode():
        reference = tiny_model(
            input_ids=torch.tensor([ids]), position_ids=torch.arange(n)[None], attention_mask=mask
        ).logits[0, -len(PROBE) :]
    delta = (session.continuation_logits(PROBE) - reference).abs().max().item()
    assert delta <= TOL, f"page-recalled logits off by {delta}"


def test_pages_are_chosen_by_the_questions_attention_bound(tiny_model, tiny_tokenizer):
    # No word of the question is in the tool result: only the attention bound can choose.
    _, session = _session(
        tiny_model,
        tiny_tokenizer,
        recall={"pages": True, "page_tokens": 8, "attention_weight": 1.0, "relative_floor": 1.0},
    )
    history = _history()
    session.extend(history)
    _commit_tool(session)
    tool = _tool(session)
    _archive(session, tool)
    digest = session.store.page_digest(tool)
    assert digest is not None
    history.append({"role": "user", "content": "zz qq"})
    session.extend(history)
    queries = session.manager.pages.last_queries
    question = next(s for s in reversed(session.spans) if s.kind is SpanKind.USER)
    assert queries is not None and queries[0].shape[1] == question.length
    bounds = score_pages(digest, list(queries))
    # relative_floor 1.0: only the page(s) with the highest bound compete, and the best one fits.
    best = int(torch.argmax(bounds))
    assert tool.state is SpanState.COMMITTED
    assert set(tool.kept or []) == set(digest.page_offsets(best))
    session.check()


def test_page_recall_respects_the_device_budget(tiny_model, tiny_tokenizer):
    backend, session = _session(
        tiny_model,
        tiny_tokenizer,
        budget={"device_tokens": 150, "low_watermark": 0.8},
        quantization={"attended_bits": None},  # the budget archives (drops) the tool result at once
    )
    history = _history()
    session.extend(history)
    session.apply(ToolCallCompleted(tool_call_id="call_1"))  # committed (digested), then over budget
    for i in range(4):
        history.append({"role": "user", "content": f"note {i}: lorem ipsum dolor sit amet {i}"})
        history.append({"role": "assistant", "content": f"noted {i}"})
        session.extend(history)
        session.check()
    tool = _tool(session)
    assert tool.state is SpanState.EVICTED and tool.tier is Tier.DROPPED  # archive tier `drop`
    assert session.store.page_digest(tool) is not None and tool.span_id in session.manager.recallable
    history.append({"role": "user", "content": "Which error code KX7-4471 was in the build?"})
    session.extend(history)
    assert tool.tier is Tier.DEVICE and tool.kept is not None and len(tool.kept) < tool.length
    assert session.stats().budget_used_bytes <= 150 * backend.runner.bytes_per_token
    session.check()


def test_question_observed_compression_keeps_what_the_question_attends(tiny_model, tiny_tokenizer):
    eager = type(tiny_model)(tiny_model.config).eval()
    eager.load_state_dict(tiny_model.state_dict())
    eager.set_attn_implementation("eager")
    _, session = _session(
        eager,
        tiny_tokenizer,
        commit={"observe": "question", "keep_ratio": {"tool_result": 0.25}},
    )
    session.extend(_history()[:4])
    tool = _tool(session)
    ids = session.token_ids()
    window = observation_window(session.table, tool)
    user = next(s for s in session.spans if s.kind is SpanKind.USER)
    call = next(s for s in session.spans if s.kind is SpanKind.TOOL_CALL)
    assert window == user.token_ids + call.token_ids

    # Reference: eager attention of the window read after the conversation, on the tool's tokens.
    with torch.inference_mode():
        out = eager(input_ids=torch.tensor([ids + window]), output_attentions=True)
    rows = torch.stack([a[0, :, -len(window) :, : len(ids)] for a in out.attentions])  # [L, H, W, S]
    attention = rows.float().mean(dim=(0, 1, 2))[tool.start : tool.end]  # [n]
    pooled = F.avg_pool1d(
        attention.view(1, 1, -1), SNAP_KERNEL, stride=1, padding=SNAP_KERNEL // 2, count_include_pad=False
    ).view(-1)
    keep = round(0.25 * tool.length)
    expected = sorted(torch.topk(pooled, keep).indices.tolist())

    _commit_tool(session)
    assert tool.kept == expected
    assert session.stats().observed_commits == 1
    assert session.stats().compressed_tokens == tool.length - keep
    session.check()


def test_pages_come_back_into_the_attended_int4_tier(tiny_model, tiny_tokenizer):
    _, session = _session(
        tiny_model,
        tiny_tokenizer,
        quantization={"attended_bits": 4, "group_size": 8, "attended_residual_tokens": 8},
    )
    history = _history()
    session.extend(history)
    _commit_tool(session)
    tool = _tool(session)
    assert session.store.page_digest(tool) is not None
    _archive(session, tool)
    history.append({"role": "user", "content": "Which error code did KX7-4471 step report?"})
    session.extend(history)
    assert tool.tier is Tier.DEVICE and tool.kept is not None and len(tool.kept) < tool.length
    held = session.store.attended_tokens(tool, keys=False, queries=False)
    assert held is not None and sorted(held.offsets.tolist()) == tool.kept
    session.check()


def test_recalled_pages_come_back_whole_after_commit_time_compression(tiny_model, tiny_tokenizer):
    _, session = _session(
        tiny_model, tiny_tokenizer, commit={"observe": "question", "keep_ratio": {"tool_result": 0.25}}
    )
    history = _history()
    session.extend(history)
    _commit_tool(session)
    tool = _tool(session)
    assert tool.kept is not None and len(tool.kept) == round(0.25 * tool.length)  # compressed at commit
    _archive(session, tool)
    history.append({"role": "user", "content": "Which error code did KX7-4471 step report?"})
    session.extend(history)
    assert tool.tier is Tier.DEVICE and tool.kept
    pages = {o // 8 for o in tool.kept}
    whole = sorted(o for p in pages for o in range(p * 8, min(p * 8 + 8, tool.length)))
    assert tool.kept == whole  # the digest was built before compression: every page comes back whole
    session.check()
