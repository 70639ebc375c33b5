"""Question-observed compression on a real (tiny) model.

Under `commit.observe: question` a tool result keeps, at commit, the tokens its
turn's question attends to (SnapKV with the question as the observation window).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812 - the usual torch alias

from agentkv import AgentKVConfig, SpanState, TransformersBackend
from agentkv.events import ToolCallCompleted
from agentkv.lifecycle.compression import SNAP_KERNEL, observation_window
from agentkv.spans import SpanKind

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
    backend = TransformersBackend(model, tokenizer, AgentKVConfig.from_dict(config))
    return backend.session("t")


def _tool(session):
    return next(s for s in session.spans if s.kind is SpanKind.TOOL_RESULT)


def _commit_tool(session) -> None:
    session.apply(ToolCallCompleted(tool_call_id="call_1"))
    assert _tool(session).state is SpanState.COMMITTED


def test_question_observed_compression_keeps_what_the_question_attends(tiny_model, tiny_tokenizer):
    eager = type(tiny_model)(tiny_model.config).eval()
    eager.load_state_dict(tiny_model.state_dict())
    eager.set_attn_implementation("eager")
    session = _session(
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
