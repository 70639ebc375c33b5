"""Human approval lands on the plan the graph keeps, whichever node layout asks for it.

Two layouts are common: the model call and `interrupt()` in separate nodes (plan →
review), or in the same node (the node asks the model, then pauses for the human).
LangGraph re-runs an interrupted node from the top on resume, so in the second
layout the resumed node asks the model again and keeps that second answer; the
first one (the one the human saw) is cropped from the cache. The decision must be
applied to the plan the resumed node keeps: pinned when approved, released when
rejected, in both layouts, with or without `agentkv_owner` in the interrupt.
"""

from __future__ import annotations

from typing import Annotated, Any

import pytest
from langchain_core.messages import AIMessage, AnyMessage, HumanMessage, SystemMessage
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages
from langgraph.types import Command, interrupt
from typing_extensions import TypedDict

from agentkv import SpanState, TransformersBackend, UserConfirmed, UserRejected
from agentkv_langchain import ChatAgentKV
from agentkv_langgraph import OWNER_KEY, with_kv_lifecycle

SYSTEM = SystemMessage("You are a helpful assistant. Propose short plans.")


class State(TypedDict):
    messages: Annotated[list[AnyMessage], add_messages]
    verdict: Any


def separate_nodes(llm: ChatAgentKV, *, name_owner: bool) -> Any:
    """plan (model call) → review (interrupt) → END."""

    def plan(state: State) -> dict[str, Any]:
        return {"messages": [llm.invoke([SYSTEM, *state["messages"]])]}

    def review(state: State) -> dict[str, Any]:
        proposal = state["messages"][-1]
        payload = {"plan": proposal.content, **({OWNER_KEY: proposal.id} if name_owner else {})}
        return {"verdict": interrupt(payload)}

    builder = StateGraph(State)
    builder.add_node("plan", plan)
    builder.add_node("review", review)
    builder.add_edge(START, "plan")
    builder.add_edge("plan", "review")
    builder.add_edge("review", END)
    return builder.compile(checkpointer=InMemorySaver())


def same_node(llm: ChatAgentKV, *, name_owner: bool) -> Any:
    """plan_and_review (model call, then interrupt; re-run from the top on resume) → END."""

    def plan_and_review(state: State) -> dict[str, Any]:
        proposal = llm.invoke([SYSTEM, *state["messages"]])
        payload = {"plan": proposal.content, **({OWNER_KEY: proposal.id} if name_owner else {})}
        verdict = interrupt(payload)
        return {"messages": [proposal], "verdict": verdict}

    builder = StateGraph(State)
    builder.add_node("plan_and_review", plan_and_review)
    builder.add_edge(START, "plan_and_review")
    builder.add_edge("plan_and_review", END)
    return builder.compile(checkpointer=InMemorySaver())


@pytest.mark.parametrize("layout", [separate_nodes, same_node], ids=["separate-nodes", "same-node"])
@pytest.mark.parametrize("name_owner", [False, True], ids=["latest", "agentkv_owner"])
@pytest.mark.parametrize("verdict", ["approve", "reject"])
def test_the_decision_lands_on_the_kept_plan(
    tiny_backend: TransformersBackend, layout: Any, name_owner: bool, verdict: str
) -> None:
    llm = ChatAgentKV(backend=tiny_backend, max_new_tokens=8)
    graph = with_kv_lifecycle(layout(llm, name_owner=name_owner), backend=tiny_backend)
    config = {"configurable": {"thread_id": "hitl"}}
    graph.invoke({"messages": [HumanMessage("Plan a trip to Paris.")]}, config)
    out = graph.invoke(Command(resume=verdict), config)

    kept = [m for m in out["messages"] if isinstance(m, AIMessage)]
    assert len(kept) == 1 and out["verdict"] == verdict
    session = tiny_backend.get("hitl")
    (span,) = session.spans_owned_by(str(kept[0].id))  # the plan in the state is the cached one
    sent = [e for sid, e in graph.agentkv.handler.events if sid == "hitl"]
    decisions = [e for e in sent if isinstance(e, (UserConfirmed, UserRejected))]
    expected = UserConfirmed if verdict == "approve" else UserRejected
    assert [type(e) for e in decisions] == [expected]
    if verdict == "approve":
        assert span.pinned and span.state is SpanState.COMMITTED
    else:
        assert not span.pinned and span.state in (SpanState.EVICTABLE, SpanState.EVICTED)
    assert session.stats().events_noop == 0  # the decision named a span the session holds
    session.check()
