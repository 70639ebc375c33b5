"""with_kv_lifecycle, per-run settings, graph YAML, branch helpers and AgentKVMiddleware on real graphs."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any, TypedDict

import pytest
from langchain_core.messages import AIMessage, HumanMessage
from langchain_core.runnables import RunnableConfig
from langchain_core.tools import tool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph
from langgraph.graph.state import CompiledStateGraph
from langgraph.types import Command, interrupt

from agentkv import SpanState, TurnEnded, UserConfirmed, UserRejected
from agentkv_langchain import ChatAgentKV
from agentkv_langgraph import (
    OWNER_KEY,
    KVLifecycleCallbackHandler,
    branch_config,
    branch_id,
    load_config,
    load_graph_yaml,
    with_kv_lifecycle,
)

GRAPH_YAML = Path(__file__).resolve().parents[2] / "examples" / "graph.yaml"


class ChatState(TypedDict):
    messages: list[Any]


def chat_graph(llm: ChatAgentKV) -> Any:
    def reply(state: ChatState, config: RunnableConfig) -> dict[str, Any]:
        answer = llm.invoke(state["messages"], config)
        return {"messages": [*state["messages"], answer]}

    builder = StateGraph(ChatState)
    builder.add_node("reply", reply)
    builder.add_edge(START, "reply")
    builder.add_edge("reply", END)
    return builder.compile(checkpointer=InMemorySaver())


def thread(name: str, **agentkv: Any) -> RunnableConfig:
    configurable: dict[str, Any] = {"thread_id": name}
    if agentkv:
        configurable["agentkv"] = agentkv
    return {"configurable": configurable}


# -- with_kv_lifecycle ---------------------------------------------------------------------------


def test_the_result_is_still_the_compiled_graph(tiny_backend):
    llm = ChatAgentKV(backend=tiny_backend, max_new_tokens=4)
    graph = with_kv_lifecycle(chat_graph(llm), backend=tiny_backend)
    assert isinstance(graph, CompiledStateGraph)
    assert graph.agentkv.handler in graph.config["callbacks"]
    out = graph.invoke({"messages": [HumanMessage("hello")]}, thread("a"))
    assert isinstance(out["messages"][-1], AIMessage)
    assert graph.get_state(thread("a")).values["messages"][-1].id == out["messages"][-1].id
    assert graph.agentkv.handler.events == [("a", TurnEnded())]
    again = graph.with_config(recursion_limit=5)  # LangGraph's own copies keep the binding
    assert again.agentkv is graph.agentkv
    again.invoke({"messages": [HumanMessage("hi")]}, thread("b"))
    assert ("b", TurnEnded()) in graph.agentkv.handler.events


def test_per_run_settings_apply_to_the_sessions_a_run_creates(tiny_backend, caplog):
    llm = ChatAgentKV(backend=tiny_backend, max_new_tokens=4)
    graph = with_kv_lifecycle(chat_graph(llm), backend=tiny_backend)
    graph.invoke({"messages": [HumanMessage("hello")]}, thread("small", budget={"device_tokens": 64}))
    assert tiny_backend.get("small").config.budget.device_tokens == 64
    graph.invoke({"messages": [HumanMessage("hello")]}, thread("plain"))
    assert tiny_backend.get("plain").config == tiny_backend.config
    # An existing session keeps its settings (it cannot be re-budgeted mid-conversation).
    with caplog.at_level(logging.INFO, logger="agentkv.langgraph"):
        graph.invoke({"messages": [HumanMessage("again")]}, thread("plain", budget={"device_tokens": 32}))
    assert tiny_backend.get("plain").config.budget.device_tokens is None
    assert any("apply to new sessions only" in r.getMessage() for r in caplog.records)
    # Backend-wide keys are ignored per run, with a warning.
    with caplog.at_level(logging.WARNING, logger="agentkv.langgraph"):
        graph.invoke({"messages": [HumanMessage("hello")]}, thread("m", model="gpt2", policy="window"))
    assert tiny_backend.get("m").config.policy.name == "window"
    assert any("model cannot change per run" in r.getMessage() for r in caplog.records)


def test_invalid_per_run_settings_name_their_path(tiny_backend):
    graph = with_kv_lifecycle(chat_graph(ChatAgentKV(backend=tiny_backend)), backend=tiny_backend)
    with pytest.raises(ValueError, match=r"configurable\.agentkv\.budget\.device_tokens: must be > 0"):
        graph.invoke({"messages": [HumanMessage("hello")]}, thread("bad", budget={"device_tokens": -5}))


def test_graph_yaml_configures_the_graph(tiny_backend, tmp_path):
    shipped = load_config(GRAPH_YAML)  # the example YAML validates
    assert shipped.budget.device_tokens == 1024
    path = tmp_path / "graph.yaml"
    path.write_text(
        "graph: {entry: agent}\n"
        "agentkv:\n"
        "  budget: {device_tokens: 512, host_tokens: 4096}\n"
        "  archive_tier: int8\n"
        "  rules: {custom:plan_approved: {owner: pin}}\n",
        encoding="utf-8",
    )
    document, config = load_graph_yaml(path)
    assert document["graph"] == {"entry": "agent"}
    assert config == load_config(path)
    graph = with_kv_lifecycle(
        chat_graph(ChatAgentKV(backend=tiny_backend)), backend=tiny_backend, config=path
    )
    assert graph.agentkv.config == config
    graph.invoke({"messages": [HumanMessage("hello")]}, thread("y"))
    session = tiny_backend.get("y")
    assert session.config.budget.device_tokens == 512  # from the YAML, not the backend
    assert session.config.archive_tier == "int8"


def test_async_runs_drive_the_handler(tiny_backend):
    class S(TypedDict):
        verdict: Any

    def review(state: S) -> dict[str, Any]:
        return {"verdict": interrupt({OWNER_KEY: "plan-9"})}

    builder = StateGraph(S)
    builder.add_node("review", review)
    builder.add_edge(START, "review")
    builder.add_edge("review", END)
    graph = with_kv_lifecycle(builder.compile(checkpointer=InMemorySaver()), backend=tiny_backend)

    async def run() -> None:
        await graph.ainvoke({"verdict": None}, thread("async"))
        await graph.ainvoke(Command(resume=False), thread("async"))

    asyncio.run(run())
    assert graph.agentkv.handler.events == [("async", UserRejected(owner="plan-9")), ("async", TurnEnded())]


# -- branches ---------------------------------------------------------------------------------------


def test_branch_id_reads_send_tasks_and_explicit_ids():
    push = {"langgraph_triggers": ("__pregel_push",), "langgraph_checkpoint_ns": "think:1234-abcd"}
    assert branch_id(push) == "1234-abcd"
    nested = {**push, "langgraph_checkpoint_ns": "outer:99|think:5678"}
    assert branch_id(nested) == "5678"
    assert branch_id({**push, "agentkv_branch": "mine"}) == "mine"
    assert branch_id({"langgraph_triggers": ("branch:to:x",), "langgraph_checkpoint_ns": "x:1"}) is None
    assert branch_id(None) is None


def test_branch_config_outside_a_send_task_needs_an_id():
    with pytest.raises(ValueError, match="not a LangGraph Send task"):
        branch_config({"metadata": {"langgraph_triggers": ("branch:to:x",)}})
    config = branch_config({"metadata": {"thread_id": "t"}, "tags": ["x"]}, "b7")
    assert config["metadata"] == {"thread_id": "t", "agentkv_branch": "b7"}
    assert config["tags"] == ["x"]


# -- create_agent middleware ---------------------------------------------------------------------------


@tool
def weather(city: str = "") -> str:
    """Weather report for a city."""
    return "sunny, 24 C, light wind " * 5


def agent_with_middleware(
    backend: Any, *, use_middleware: bool = True
) -> tuple[Any, KVLifecycleCallbackHandler]:
    from langchain.agents import create_agent
    from langchain.agents.middleware import HumanInTheLoopMiddleware, wrap_model_call

    from agentkv_langchain.middleware import AgentKVMiddleware

    @wrap_model_call
    def force_then_answer(request: Any, handler: Any) -> Any:
        """Scripted tool choice (a tiny random model cannot choose); repair unparseable forced calls."""
        forced = isinstance(request.messages[-1], HumanMessage)
        response = handler(request.override(tool_choice="weather" if forced else "none"))
        ai = response.result[-1]
        if forced and not ai.tool_calls:
            call = {"name": "weather", "args": {}, "id": f"call_{ai.id}", "type": "tool_call"}
            response.result[-1] = AIMessage(content="", tool_calls=[call], id=ai.id)
            # The generated span stands for the repaired message (no history rewrite later).
            backend.session(ai.response_metadata["session_id"]).bind_message(response.result[-1])
        return response

    hitl = HumanInTheLoopMiddleware(interrupt_on={"weather": True})
    llm = ChatAgentKV(backend=backend, max_new_tokens=4)
    if use_middleware:
        kv = AgentKVMiddleware(backend, hitl=hitl)
        agent = create_agent(
            llm, [weather], middleware=[kv, hitl, force_then_answer], checkpointer=InMemorySaver()
        )
        return agent, kv.handler
    # The callback handler alone reads the HITL request and the resume value itself.
    agent = create_agent(llm, [weather], middleware=[hitl, force_then_answer], checkpointer=InMemorySaver())
    graph = with_kv_lifecycle(agent, backend=backend)
    return graph, graph.agentkv.handler


@pytest.mark.parametrize("use_middleware", [True, False], ids=["middleware", "callback-handler"])
@pytest.mark.parametrize(
    ("decision", "expected"),
    [({"type": "approve"}, UserConfirmed), ({"type": "reject", "message": "not now"}, UserRejected)],
    ids=["approve", "reject"],
)
def test_create_agent_tools_turns_and_human_decisions(tiny_backend, decision, expected, use_middleware):
    agent, handler = agent_with_middleware(tiny_backend, use_middleware=use_middleware)
    config = thread("agent")
    agent.invoke({"messages": [HumanMessage("What is the weather in Paris?")]}, config)
    assert agent.get_state(config).next  # paused for the human
    assert handler.events == []
    agent.invoke(Command(resume={"decisions": [decision]}), config)
    session = tiny_backend.get("agent")
    call_span = next(s for s in session.spans if s.kind.value == "tool_call")
    names = [type(e).__name__ for _, e in handler.events]
    # Both layouts name the message the decision is about: the call the resumed node keeps.
    assert handler.events[0] == ("agent", expected(owner=call_span.owner))
    assert names[-1] == "TurnEnded"
    result = next(s for s in session.spans if s.kind.value == "tool_result")
    if expected is UserConfirmed:
        assert "ToolCallCompleted" in names
        assert call_span.pinned and call_span.state is SpanState.COMMITTED  # the approved call is kept
        assert result.state is SpanState.COMMITTED
    else:
        assert "ToolCallCompleted" not in names  # the tool never ran
        assert call_span.state is SpanState.EVICTABLE
    assert handler.errors == 0
