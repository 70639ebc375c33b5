"""`tool_choice` as OpenAI defines it, on the tiny model, with the grammar off (`grammar=False`).

With the grammar on (the default) the choice is made under the call grammar; that path
is tested in `test_grammar.py`. Off, and on engine sessions (no decode hook):
- "any" / "required": a call is forced and the **model** picks the tool among the
  bound ones (each name scored by the model after `<tool_call>{"name": "`), not the
  first listed one.
- "none": the `<tool_call>` tag cannot be written, so a model that would start a
  call writes its text answer instead of returning `content=''`.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from langchain_core.messages import HumanMessage, SystemMessage

import agentkv_langchain.chat_models as chat_models_module
from agentkv import AgentKVConfig, TransformersBackend
from agentkv_langchain import ChatAgentKV
from agentkv_langchain.tools import ANY_TOOL, CALL_NAME_OPENING, ToolCallBan, choose_tool, resolve_tool_choice

HISTORY = [
    SystemMessage("You are a helpful assistant.", id="sys"),
    HumanMessage("The secret code is 4417.", id="h1"),
]


def tool(name: str) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": f"The {name} tool.",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]},
        },
    }


@pytest.fixture()
def backend(tiny_model, tiny_tokenizer) -> TransformersBackend:
    return TransformersBackend(tiny_model, tiny_tokenizer, AgentKVConfig(policy="full"))


def test_resolve_any_means_the_models_pick():
    assert resolve_tool_choice("any", ["a", "b"]) == ANY_TOOL
    assert resolve_tool_choice("required", ["a", "b"]) == ANY_TOOL
    assert resolve_tool_choice(True, ["a", "b"]) == ANY_TOOL
    assert resolve_tool_choice("any", ["only"]) == "only"  # one tool: nothing to choose


@pytest.mark.parametrize("choice", ["any", "required"])
def test_forced_call_goes_to_the_tool_the_model_prefers(backend, choice):
    names = ["search", "lookup", "weather"]
    llm = ChatAgentKV(backend=backend, max_new_tokens=8, grammar=False)
    result = llm.bind_tools([tool(n) for n in names], tool_choice=choice).invoke(
        HISTORY, {"metadata": {"thread_id": "t"}}
    )
    calls = [*result.tool_calls, *result.invalid_tool_calls]
    assert len(calls) == 1 and calls[0]["name"] in names
    # The pick is the model's own: the name it scores highest in the same context.
    probe = backend.session("probe")
    probe.extend(llm._plan(HISTORY, None, {"tools": [tool(n) for n in names]}, probe).messages)
    scores = {n: probe.answer_logprob(f'{n}"', prefix=CALL_NAME_OPENING) for n in names}
    assert calls[0]["name"] == max(scores, key=lambda n: scores[n])


def test_choose_tool_takes_the_best_score_first_on_ties():
    scores = {"a": -3.0, "b": -1.0, "c": -1.0}
    assert choose_tool(lambda answer, prefix: scores[answer[:-1]], ["a", "b", "c"]) == "b"


def boost_tool_call(tokenizer: Any) -> Any:
    """A processor that makes the model write `<tool_call>` first, whatever it would write."""
    target = tokenizer("<tool_call>", add_special_tokens=False)["input_ids"]

    def boost(produced: Any, logits: torch.Tensor) -> torch.Tensor:
        step = len(produced)
        if step < len(target):
            logits = logits.clone()
            logits[target[step]] = logits.max() + 50.0
        return logits

    return boost


def test_tool_call_ban_forbids_only_the_tag(tiny_tokenizer):
    ban = ToolCallBan(tiny_tokenizer)
    logits = torch.zeros(len(tiny_tokenizer))
    free = ban([], logits)
    after_open = ban(tiny_tokenizer("hello <", add_special_tokens=False)["input_ids"], logits)
    texts = [tiny_tokenizer.decode([i]) for i in range(len(tiny_tokenizer))]
    for i, text in enumerate(texts):
        assert (free[i] == float("-inf")) == ("<tool" in text)
        # After "<", a token that completes "<tool" is banned too.
        assert (after_open[i] == float("-inf")) == ("<tool" in text or text.startswith("tool"))
    assert (after_open == 0).sum() > len(texts) // 2  # everything else stays allowed


def test_none_returns_the_text_answer_when_the_model_starts_a_call(backend, monkeypatch):
    """A model that would open `<tool_call>` answers in text under tool_choice="none"."""
    boost = boost_tool_call(backend.tokenizer)
    ban = ToolCallBan(backend.tokenizer)
    monkeypatch.setattr(
        chat_models_module, "tool_call_ban", lambda _backend: lambda p, logits: ban(p, boost(p, logits))
    )
    llm = ChatAgentKV(backend=backend, max_new_tokens=8, grammar=False)
    result = llm.bind_tools([tool("search")], tool_choice="none").invoke(HISTORY)
    assert result.text.strip() and "<tool" not in result.text
    assert not result.tool_calls and not result.invalid_tool_calls
    # Without the ban the same model opens a call: the ban is what makes the difference.
    session = backend.session("unbanned")
    session.extend([{"role": "user", "content": "hi"}])
    assert session.generate(max_new_tokens=4, logits_processor=boost).startswith("<tool")


def test_engine_sessions_keep_tool_choice_without_a_decode_hook(tiny_tokenizer: Any) -> None:
    """Engine sessions: no logits hook nor name scoring; "none" stops at the tag, "any" calls the first."""
    from agentkv import EngineBackend
    from agentkv.engines.http import FakeTransport

    answer = {
        "choices": [{"text": "plain", "token_ids": [5, 6], "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2},
    }
    transport = FakeTransport(routes={"POST /v1/completions": answer})
    config = AgentKVConfig.from_dict({"engine": {"vllm_url": "http://v:8000", "served_model": "m"}})
    backend = EngineBackend(tiny_tokenizer, config, bytes_per_token=16, transport=transport)
    llm = ChatAgentKV(backend=backend, session_id="engine")
    message = llm.bind_tools([tool("search")], tool_choice="none").invoke(HISTORY)
    assert message.content == "plain" and not message.tool_calls
    (body,) = transport.sent("POST", "/v1/completions")
    assert "<tool_call>" in body["stop"]
    forced = llm.bind_tools([tool("search"), tool("lookup")], tool_choice="any").invoke(
        [*HISTORY, HumanMessage("Find it.", id="h2")]
    )
    assert [c["name"] for c in [*forced.tool_calls, *forced.invalid_tool_calls]] == ["search"]
