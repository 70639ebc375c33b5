"""Issue 10's one-line setup on the default model (SmolLM2-135M-Instruct).

`ChatAgentKV()` with no arguments loads the default model on the process-wide
backend that `with_kv_lifecycle(graph)` uses, so the model calls and the lifecycle
events meet in one session table without wiring; and `tool_use="call_then_answer"`
lets this small model drive a `create_agent` tool loop to its end (one call, then
a text answer) instead of calling the same tool until `GraphRecursionError`.
"""

from __future__ import annotations

import pytest
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langgraph.checkpoint.memory import InMemorySaver

from agentkv import AgentKVConfig, ToolCallCompleted, TurnEnded
from agentkv_langchain import ChatAgentKV
from agentkv_langgraph import shared_backend, with_kv_lifecycle

pytestmark = pytest.mark.integration


@tool
def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    return f"It is sunny and 24 C in {city}."


@tool
def get_time(city: str) -> str:
    """Get the local time in a city."""
    return f"It is 14:05 in {city}."


def test_chat_model_without_arguments_shares_the_lifecycle_backend():
    llm = ChatAgentKV()
    assert llm.backend is shared_backend()
    assert llm.model_name == "SmolLM2-135M-Instruct.Q4_1"
    # Every accepted config form for the same model meets the same backend.
    assert ChatAgentKV(config={"policy": "full"}).backend is llm.backend
    assert ChatAgentKV(config=AgentKVConfig()).backend is llm.backend


def test_create_agent_tool_loop_ends_on_the_default_model():
    from langchain.agents import create_agent

    llm = ChatAgentKV(max_new_tokens=48, tool_use="call_then_answer")
    agent = with_kv_lifecycle(create_agent(llm, [get_time, get_weather], checkpointer=InMemorySaver()))
    assert agent.agentkv.backend is llm.backend
    config = {"configurable": {"thread_id": "one-line"}, "recursion_limit": 12}
    out = agent.invoke({"messages": [HumanMessage("What is the weather in Paris?")]}, config)
    messages = out["messages"]
    calls = [m for m in messages if isinstance(m, AIMessage) and m.tool_calls]
    results = [m for m in messages if isinstance(m, ToolMessage)]
    assert len(calls) == 1 and len(results) == 1
    # "any" is the model's pick among the bound tools: here the weather tool, not the first listed.
    assert calls[0].tool_calls[0]["name"] == "get_weather"
    final = messages[-1]
    assert isinstance(final, AIMessage) and not final.tool_calls and final.text.strip()
    events = agent.agentkv.handler.events_for("one-line")
    assert ToolCallCompleted(tool_call_id=results[0].tool_call_id) in events and events[-1] == TurnEnded()
    assert agent.agentkv.handler.errors == 0


def test_create_agent_middleware_without_a_backend_shares_the_model_backend():
    from langchain.agents import create_agent

    from agentkv_langchain import AgentKVMiddleware

    llm = ChatAgentKV(max_new_tokens=48, tool_use="call_then_answer")
    kv = AgentKVMiddleware()  # no backend: the process-wide one, as ChatAgentKV() uses
    assert kv.handler.backend is llm.backend
    agent = create_agent(llm, [get_weather], middleware=[kv], checkpointer=InMemorySaver())
    config = {"configurable": {"thread_id": "one-line-middleware"}, "recursion_limit": 12}
    out = agent.invoke({"messages": [HumanMessage("What is the weather in Paris?")]}, config)
    results = [m for m in out["messages"] if isinstance(m, ToolMessage)]
    assert len(results) == 1
    events = kv.handler.events_for("one-line-middleware")
    assert ToolCallCompleted(tool_call_id=results[0].tool_call_id) in events and events[-1] == TurnEnded()
    # The events met the model's spans: the tool result is committed in the thread's session.
    session = llm.backend.get("one-line-middleware")
    (result,) = session.spans_owned_by(results[0].tool_call_id)
    assert result.state.value == "committed"
    assert kv.handler.errors == 0
