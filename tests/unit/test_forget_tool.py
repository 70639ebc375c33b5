"""`forget_tool_outputs` as a LangChain tool in a real LangGraph graph: its call becomes the events."""

from __future__ import annotations

from typing import Annotated, Any, TypedDict

from langchain_core.messages import AIMessage, AnyMessage, HumanMessage, SystemMessage
from langchain_core.runnables import RunnableConfig
from langchain_core.tools import tool
from langchain_core.utils.function_calling import convert_to_openai_tool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages
from langgraph.prebuilt import ToolNode

from agentkv import AgentKVConfig, TransformersBackend
from agentkv.forget import FORGET_TOOL_NAME, FORGET_TOOL_PARAMETERS, ForgetRequested, side_thread_opening
from agentkv.spans import SpanKind, SpanState, Tier
from agentkv_langchain import ChatAgentKV
from agentkv_langchain.forget import forget_tool_outputs
from agentkv_langchain.tools import forced_call_prefix
from agentkv_langgraph import with_kv_lifecycle


class AgentState(TypedDict):
    messages: Annotated[list[AnyMessage], add_messages]


@tool
def search(query: str) -> str:
    """Search the web."""
    return f"search results for {query}: lorem ipsum dolor sit amet, sunny skies"


def build_graph(backend: TransformersBackend) -> Any:
    """plan -> (tools ->) agent. `plan` scripts the calls (a tiny random model cannot choose tools)."""
    llm = ChatAgentKV(backend=backend, max_new_tokens=3)

    def plan(state: AgentState, config: RunnableConfig) -> dict[str, Any]:
        last = state["messages"][-1]
        text = str(last.content)
        if not isinstance(last, HumanMessage):
            return {}
        # The model reads the user message first (as a real agent's would); its answer is replaced
        # by the scripted call below, which the session then encodes in its place.
        llm.invoke(state["messages"], config)
        if text.startswith("search"):
            n = text.split()[-1]
            call = {"name": "search", "args": {"query": f"q{n}"}, "id": f"call_{n}", "type": "tool_call"}
        elif text.startswith("forget"):
            handles = text.split()[1:]
            call = {
                "name": FORGET_TOOL_NAME,
                "args": {"handles": handles},
                "id": "call_forget",
                "type": "tool_call",
            }
        else:
            return {}
        return {"messages": [AIMessage(content="", tool_calls=[call], id=f"plan-{len(state['messages'])}")]}

    def agent(state: AgentState, config: RunnableConfig) -> dict[str, Any]:
        return {"messages": [llm.invoke(state["messages"], config)]}

    def route(state: AgentState) -> str:
        last = state["messages"][-1]
        return "tools" if isinstance(last, AIMessage) and last.tool_calls else "agent"

    builder = StateGraph(AgentState)
    builder.add_node("plan", plan)
    builder.add_node("tools", ToolNode([search, forget_tool_outputs]))
    builder.add_node("agent", agent)
    builder.add_edge(START, "plan")
    builder.add_conditional_edges("plan", route, ["tools", "agent"])
    builder.add_edge("tools", "agent")
    builder.add_edge("agent", END)
    return with_kv_lifecycle(builder.compile(checkpointer=InMemorySaver()), backend=backend)


def test_the_tool_call_becomes_a_request_applied_at_the_next_turn(tiny_model, tiny_tokenizer):
    # Recall off: with the tiny tokenizer any follow-up shares sub-word pieces with a result, and recall
    # would bring a forgotten one straight back (test_forget.py covers that rehydration).
    backend = TransformersBackend(
        tiny_model, tiny_tokenizer, AgentKVConfig.from_dict({"recall": {"enabled": False}})
    )
    graph = build_graph(backend)
    config: RunnableConfig = {"configurable": {"thread_id": "t"}}
    graph.invoke(
        {"messages": [SystemMessage("You are helpful.", id="sys"), HumanMessage("search 1")]}, config
    )
    graph.invoke({"messages": [HumanMessage("search 2")]}, config)
    graph.invoke({"messages": [HumanMessage("forget T1 T2")]}, config)
    session = backend.get("t")
    requests = [e for _, e in graph.agentkv.handler.events if isinstance(e, ForgetRequested)]
    assert requests == [ForgetRequested(handles=("T1", "T2"), source="agent", request_id="call_forget")]
    decision = session.forget.stats.decisions[-1]
    assert decision.trigger == "agent" and decision.chosen == ("T1", "T2")
    results = {s.owner: s for s in session.spans if s.kind is SpanKind.TOOL_RESULT}
    assert all(
        results[c].state is not SpanState.EVICTED for c in ("call_1", "call_2")
    )  # not before the boundary

    graph.invoke({"messages": [HumanMessage("thanks")]}, config)
    for call_id in ("call_1", "call_2"):
        assert results[call_id].state is SpanState.EVICTED and results[call_id].tier is Tier.DROPPED
    assert session.forget.stats.released_spans == 2
    session.check()


def test_the_side_thread_opening_is_the_forced_call_of_the_tool():
    schema = convert_to_openai_tool(forget_tool_outputs)["function"]
    assert schema["name"] == FORGET_TOOL_NAME
    assert schema["parameters"]["properties"]["handles"]["type"] == "array"
    assert "tool_call_id" not in schema["parameters"]["properties"]
    assert forced_call_prefix(FORGET_TOOL_NAME, FORGET_TOOL_PARAMETERS) + "[" == side_thread_opening()
