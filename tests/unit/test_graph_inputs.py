"""Issue 10 items 4, 6 and 8, and the one-line setup's config forms, on compiled graphs.

- `from agentkv_langchain import AgentKVMiddleware` works (item 4).
- A `ToolMessage` whose `tool_call_id` answers no call is encoded with a warning;
  an error `ToolMessage` given as input becomes `ToolCallFailed`; a message dict
  without `content` is refused unless it is an assistant message with tool calls
  (item 6).
- `events_applied` counts what the graph caused; the session's own implicit turn
  ends are counted apart, in `events_internal` (item 8).
- `with_kv_lifecycle(config=...)` and `shared_backend(...)` read the same forms.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
from langchain_core.messages import AIMessage, AnyMessage, HumanMessage, SystemMessage, ToolMessage
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import START, MessagesState, StateGraph

from agentkv import AgentKVConfig, ToolCallFailed, TransformersBackend, TurnEnded
from agentkv_langchain import ChatAgentKV
from agentkv_langchain.backends import resolve_config
from agentkv_langgraph import with_kv_lifecycle

SYSTEM = SystemMessage("You are a helpful assistant.", id="sys")


@pytest.fixture()
def backend(tiny_model, tiny_tokenizer) -> TransformersBackend:
    return TransformersBackend(tiny_model, tiny_tokenizer, AgentKVConfig(policy="full"))


def agent_graph(backend: TransformersBackend) -> Any:
    llm = ChatAgentKV(backend=backend, max_new_tokens=4)

    def agent(state: MessagesState) -> dict[str, list[AnyMessage]]:
        return {"messages": [llm.invoke([SYSTEM, *state["messages"]])]}

    builder = StateGraph(MessagesState)
    builder.add_node("agent", agent)
    builder.add_edge(START, "agent")
    return with_kv_lifecycle(builder.compile(checkpointer=InMemorySaver()), backend=backend)


def test_middleware_is_importable_from_the_package():
    from agentkv_langchain import AgentKVMiddleware
    from agentkv_langchain.middleware import AgentKVMiddleware as Direct

    assert AgentKVMiddleware is Direct
    import agentkv_langchain

    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        agentkv_langchain.Nope  # noqa: B018


def history_with_call(status: str, call_id: str = "call_1", result_for: str = "call_1") -> list[AnyMessage]:
    return [
        HumanMessage("Weather in Paris?"),
        AIMessage("", tool_calls=[{"name": "get_weather", "args": {"city": "Paris"}, "id": call_id}]),
        ToolMessage(
            "boom: service down" if status == "error" else "sunny", tool_call_id=result_for, status=status
        ),
    ]


def test_error_tool_message_input_becomes_tool_call_failed(backend):
    graph = agent_graph(backend)
    graph.invoke({"messages": history_with_call("error")}, {"configurable": {"thread_id": "t"}})
    events = graph.agentkv.handler.events_for("t")
    assert ToolCallFailed(tool_call_id="call_1", error="boom: service down") in events
    result = next(s for s in backend.get("t").spans if s.owner == "call_1")
    assert result.state.value == "committed"  # the default rules keep a failed call's output (its call goes)
    # The same history again (next turn) does not report the failure twice.
    graph.invoke({"messages": [HumanMessage("And now?")]}, {"configurable": {"thread_id": "t"}})
    failed = [e for e in graph.agentkv.handler.events_for("t") if isinstance(e, ToolCallFailed)]
    assert len(failed) == 1


def test_tool_result_for_an_unknown_call_is_encoded_with_a_warning(backend, caplog):
    graph = agent_graph(backend)
    with caplog.at_level(logging.WARNING, logger="agentkv.chat"):
        graph.invoke(
            {"messages": history_with_call("success", result_for="call_typo")},
            {"configurable": {"thread_id": "t"}},
        )
    warnings = [r.getMessage() for r in caplog.records if "call_typo" in r.getMessage()]
    assert len(warnings) == 1 and "answers no earlier tool call" in warnings[0] and "call_1" in warnings[0]
    assert any(s.owner == "call_typo" for s in backend.get("t").spans)  # encoded all the same


def test_tool_result_without_an_id_is_encoded_with_a_warning_once(backend, caplog):
    history = [{"role": "user", "content": "hi"}, {"role": "tool", "content": "result without an id"}]
    with caplog.at_level(logging.WARNING, logger="agentkv.chat"):
        backend.session("t").extend(history)
        backend.session("t").extend([*history, {"role": "user", "content": "and?"}])
    warnings = [r.getMessage() for r in caplog.records if "without a tool_call_id" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].startswith("messages[1]: tool result without a tool_call_id")
    assert "give it the id of the tool call it answers" in warnings[0]
    assert any(s.text and "result without an id" in s.text for s in backend.get("t").spans)


@pytest.mark.parametrize(
    "message", [{"role": "user"}, {"role": "tool", "tool_call_id": "x"}, {"role": "assistant"}]
)
def test_message_without_content_is_refused(backend, message):
    session = backend.session("t")
    with pytest.raises(ValueError, match=r"messages\[1\]: a '\w+' message needs 'content'") as info:
        session.extend([{"role": "system", "content": "s"}, message])
    assert "only an assistant message with tool_calls may omit it" in str(info.value)


def test_assistant_with_tool_calls_may_omit_content(backend):
    session = backend.session("t")
    session.extend(
        [
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "tool_calls": [{"id": "c1", "name": "get_weather", "args": {}}]},
        ]
    )
    assert session.messages[-1].tool_calls[0].id == "c1"


def test_events_applied_counts_only_what_the_graph_sent(backend):
    graph = agent_graph(backend)
    for turn in range(2):
        graph.invoke({"messages": [HumanMessage(f"Hello {turn}")]}, {"configurable": {"thread_id": "t"}})
    sent = graph.agentkv.handler.events_for("t")
    assert sent == [TurnEnded(), TurnEnded()]
    stats = backend.get("t").stats()
    assert stats.events_applied == 2  # the two turn ends the runs sent, nothing synthetic
    assert stats.events_noop == 0
    # The session ended turn 0 (the system prompt) itself when the first user message came.
    assert stats.events_internal >= 1


def test_config_forms_are_the_same_everywhere(tmp_path, backend):
    path = tmp_path / "graph.yaml"
    path.write_text("agentkv:\n  policy: snapkv\n  budget: {device_tokens: 64}\n", encoding="utf-8")
    expected = AgentKVConfig.from_dict({"policy": "snapkv", "budget": {"device_tokens": 64}})
    assert resolve_config(path) == resolve_config(str(path)) == expected
    assert resolve_config({"policy": "snapkv", "budget": {"device_tokens": 64}}) == expected
    assert resolve_config(expected) is expected
    assert resolve_config(None) is None
    assert resolve_config(None, model="some/model").model == "some/model"
    with pytest.raises(TypeError, match="expected an AgentKVConfig, a mapping"):
        resolve_config(42)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"agentkv.policy.windw"):
        resolve_config({"policy": {"name": "snapkv", "windw": 3}})
    graph = agent_graph(backend)
    for form in (path, {"policy": "snapkv", "budget": {"device_tokens": 64}}, expected):
        bound = with_kv_lifecycle(graph, backend=backend, config=form)
        assert bound.agentkv.config == expected


def test_backend_and_model_are_exclusive(backend):
    with pytest.raises(ValueError, match="either backend= .* or model= / config="):
        ChatAgentKV(backend=backend, model="x")


def test_with_kv_lifecycle_names_what_it_got_instead_of_a_compiled_graph(backend):
    builder = StateGraph(MessagesState)
    builder.add_node("agent", lambda state: {"messages": []})
    builder.add_edge(START, "agent")
    with pytest.raises(
        TypeError, match=r"expected a compiled graph \(builder.compile\(...\)\), got StateGraph$"
    ):
        with_kv_lifecycle(builder, backend=backend)
    with pytest.raises(TypeError, match="got ChatAgentKV .a chat model needs no wrapping"):
        with_kv_lifecycle(ChatAgentKV(backend=backend), backend=backend)  # type: ignore[type-var]
