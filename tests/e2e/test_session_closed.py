"""A thread continued after `SessionClosed()` starts over instead of answering without its history.

`SessionClosed` releases every span of the conversation. When the same thread gets
another model call, the session encodes the history it is given anew (as
`backend.close(thread)` and a fresh session would): the answer attends the whole
history, equals the answer of a fresh thread given the same messages, and reports
no released token as read from the cache.
"""

from __future__ import annotations

from typing import Any

from langchain_core.messages import AIMessage, AnyMessage, HumanMessage, SystemMessage
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, MessagesState, StateGraph

from agentkv import AgentKVConfig, SessionClosed, TransformersBackend
from agentkv.spans import Tier
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


def test_a_thread_continued_after_session_closed_starts_over(long_tiny_model, tiny_tokenizer):
    backend = TransformersBackend(long_tiny_model, tiny_tokenizer, AgentKVConfig(policy="full"))
    llm = ChatAgentKV(backend=backend, max_new_tokens=8)
    graph = with_kv_lifecycle(closing_graph(llm), backend=backend)
    first = HumanMessage("The secret code is 4417. Remember the code.")
    question = HumanMessage("What is the secret code?")
    answers = {}
    for thread, close in (("closed", True), ("open", False)):
        config = {"configurable": {"thread_id": thread}}
        graph.invoke({"messages": [first], "close": close}, config)
        if close:
            assert backend.get(thread).stats().tokens_by_state["evicted"] > 0  # released
        answers[thread] = graph.invoke({"messages": [question], "close": False}, config)["messages"][-1]

    again, reference = answers["closed"], answers["open"]
    assert isinstance(again, AIMessage) and isinstance(reference, AIMessage)
    # The released history came back from its tokens: the same answer as a thread never closed.
    assert again.content == reference.content
    usage, meta = again.usage_metadata, again.response_metadata
    assert usage is not None and reference.usage_metadata is not None
    assert usage["input_tokens"] == reference.usage_metadata["input_tokens"]
    # Nothing released counts as read: it was encoded again (recomputed from its tokens) in this call.
    assert usage["input_tokens"] == usage["input_token_details"]["cache_read"] + meta["prefill_tokens"]
    assert meta["rehydrated_tokens"] > 0 and meta["prefill_tokens"] >= meta["rehydrated_tokens"]
    closed, never = backend.get("closed").stats(), backend.get("open").stats()
    assert closed.attended_tokens == never.attended_tokens
    assert closed.tokens_by_state["evicted"] == 0


def test_generate_after_session_closed_brings_the_history_back(tiny_backend: TransformersBackend):
    session = tiny_backend.session("direct")
    session.extend([{"role": "user", "content": "The secret code is 4417."}])
    session.generate(max_new_tokens=4)
    session.apply(SessionClosed())
    assert session.stats().attended_tokens < session.stats().logical_tokens
    session.generate(max_new_tokens=4)  # straight on: the released spans are recomputed first
    assert session.stats().tokens_by_state["evicted"] == 0
    assert all(s.tier is Tier.DEVICE and s.n_computed > 0 for s in session.spans)
    session.check()
