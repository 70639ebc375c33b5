"""A thread continued after `SessionClosed()` starts over instead of answering without its history.

`SessionClosed` releases every span of the conversation. When the same thread gets
another model call, the session encodes the history it is given anew (as
`backend.close(thread)` and a fresh session would): the answer attends the whole
history, equals the answer of a fresh thread given the same messages, and reports
no released token as read from the cache.
"""

from __future__ import annotations

from typing import Any

import pytest
from langchain_core.messages import AIMessage, AnyMessage, HumanMessage, SystemMessage
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, MessagesState, StateGraph

from agentkv import SessionClosed, TransformersBackend
from agentkv_langchain import ChatAgentKV
from agentkv_langgraph import send_event, with_kv_lifecycle

SYSTEM = SystemMessage("You are a helpful assistant.")


class State(MessagesState):
    close: bool


def closing_graph(llm: ChatAgentKV) -> Any:
    """agent → finish (sends `SessionClosed` when the input asks for it) → END."""

    def agent(state: State) -> dict[str, list[AnyMessage]]:
        return {"messages": [llm.invoke([SYSTEM, *state["messages"]])]}

    def finish(state: State) -> dict[str, Any]:
        if state.get("close"):
            send_event(SessionClosed())
        return {}

    builder = StateGraph(State)
    builder.add_node("agent", agent)
    builder.add_node("finish", finish)
    builder.add_edge(START, "agent")
    builder.add_edge("agent", "finish")
    builder.add_edge("finish", END)
    return builder.compile(checkpointer=InMemorySaver())


def test_a_thread_continued_after_session_closed_starts_over(tiny_backend: TransformersBackend):
    llm = ChatAgentKV(backend=tiny_backend, max_new_tokens=8)
    graph = with_kv_lifecycle(closing_graph(llm), backend=tiny_backend)
    closed = {"configurable": {"thread_id": "closed"}}
    first = HumanMessage("The secret code is 4417. Remember the code.")
    graph.invoke({"messages": [first], "close": True}, closed)
    session = tiny_backend.get("closed")
    assert session.stats().tokens_by_state["evicted"] > 0  # the conversation was released
    question = HumanMessage("What is the secret code?")
    out = graph.invoke({"messages": [question], "close": False}, closed)
    again = out["messages"][-1]

    # The same history on a fresh thread.
    fresh = {"configurable": {"thread_id": "fresh"}}
    history = out["messages"][:-2]
    reference = graph.invoke({"messages": [*history, question], "close": False}, fresh)["messages"][-1]

    assert isinstance(again, AIMessage) and isinstance(reference, AIMessage)
    assert again.content == reference.content
    usage, meta = again.usage_metadata, again.response_metadata
    assert usage is not None and reference.usage_metadata is not None
    assert usage["input_tokens"] == reference.usage_metadata["input_tokens"]
    # Only what the session still attended (a pinned prefix) can be read; the rest is encoded again.
    assert usage["input_tokens"] == usage["input_token_details"]["cache_read"] + meta["prefill_tokens"]
    assert meta["prefill_tokens"] >= usage["input_tokens"] - len(session.spans[0].token_ids)
    assert session.stats().attended_tokens == tiny_backend.get("fresh").stats().attended_tokens
    assert session.stats().tokens_by_state["evicted"] == 0


def test_answering_a_closed_session_without_its_history_is_refused(tiny_backend: TransformersBackend):
    session = tiny_backend.session("direct")
    session.extend([{"role": "user", "content": "The secret code is 4417."}])
    session.generate(max_new_tokens=4)
    session.apply(SessionClosed())
    with pytest.raises(ValueError, match="SessionClosed"):
        session.generate(max_new_tokens=4)
    session.extend([{"role": "user", "content": "What is the code?"}])  # starts over from this history
    assert session.generate(max_new_tokens=4) is not None
    assert session.stats().tokens_by_state["evicted"] == 0
