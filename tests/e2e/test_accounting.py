"""Usage figures that add up on a compiled graph.

Every model call reports `input_tokens = cache_read + tokens it encoded` exactly,
with or without a budget that demotes spans; `cache_read` never counts a token the
answer did not attend (a generated answer's pending tail is encoded by the next
call, an evicted span is not read). A thread's totals only grow, also when a
`Send` branch is adopted as the thread's continuation.
"""

from __future__ import annotations

from typing import Any

import pytest
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.messages import AIMessage, AnyMessage, HumanMessage, SystemMessage, ToolMessage
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, MessagesState, StateGraph

from agentkv import AgentKVConfig, SessionStats, TransformersBackend
from agentkv_langchain import ChatAgentKV
from agentkv_langgraph import with_kv_lifecycle

SYSTEM = SystemMessage("You are a helpful assistant.")


def get_code(name: str) -> str:
    """Look up a secret code by name."""
    return "The secret code is 4417. " * 6


def tool_graph(llm: ChatAgentKV) -> Any:
    """call (forced get_code) → tools → answer (no tools) → END."""
    bound = llm.bind_tools([get_code], tool_choice="get_code")

    def call(state: MessagesState) -> dict[str, list[AnyMessage]]:
        return {"messages": [bound.invoke([SYSTEM, *state["messages"]])]}

    def tools(state: MessagesState) -> dict[str, list[AnyMessage]]:
        last = state["messages"][-1]
        assert isinstance(last, AIMessage)
        calls = [*last.tool_calls, *last.invalid_tool_calls]
        return {"messages": [ToolMessage(get_code("x"), tool_call_id=str(c["id"])) for c in calls]}

    def answer(state: MessagesState) -> dict[str, list[AnyMessage]]:
        return {"messages": [llm.invoke([SYSTEM, *state["messages"]])]}

    builder = StateGraph(MessagesState)
    for name, node in (("call", call), ("tools", tools), ("answer", answer)):
        builder.add_node(name, node)
    for a, b in ((START, "call"), ("call", "tools"), ("tools", "answer"), ("answer", END)):
        builder.add_edge(a, b)
    return builder.compile(checkpointer=InMemorySaver())


@pytest.mark.parametrize(
    "config",
    [
        AgentKVConfig(policy="full"),
        AgentKVConfig(budget={"device_tokens": 160, "high_watermark": 1.0, "low_watermark": 0.6}),
    ],
    ids=["full", "budget"],
)
def test_input_tokens_are_cache_read_plus_new_tokens(long_tiny_model, tiny_tokenizer, config):
    backend = TransformersBackend(long_tiny_model, tiny_tokenizer, config)
    llm = ChatAgentKV(backend=backend, max_new_tokens=16)
    graph = with_kv_lifecycle(tool_graph(llm), backend=backend)
    run = {"configurable": {"thread_id": "acct"}}
    for turn in range(3):
        graph.invoke({"messages": [HumanMessage(f"What is the code for account {turn}?")]}, run)
    answers = [m for m in graph.get_state(run).values["messages"] if isinstance(m, AIMessage)]
    assert len(answers) == 6
    for answer in answers:
        usage, meta = answer.usage_metadata, answer.response_metadata
        assert usage is not None
        read = usage["input_token_details"]["cache_read"]
        assert usage["input_tokens"] == read + meta["prefill_tokens"], (answer.id, usage, meta)
    assert all(a.usage_metadata["input_token_details"]["cache_read"] > 0 for a in answers[1:])
    stats = backend.get("acct").stats()
    if config.budget.device_tokens is not None:
        assert stats.tokens_by_state["evicted"] + stats.tokens_by_state["archived"] > 0  # it did bite


class ThreadStats(BaseCallbackHandler):
    """The thread's stats when `node` starts (before its model call settles the fan-out)."""

    def __init__(self, backend: TransformersBackend, thread: str, node: str) -> None:
        self.backend, self.thread, self.node = backend, thread, node
        self.seen: list[SessionStats] = []

    def on_chain_start(self, serialized: Any, inputs: Any, *, metadata: Any = None, **kwargs: Any) -> None:
        if (metadata or {}).get("langgraph_node") == self.node and self.thread in self.backend:
            self.seen.append(self.backend.get(self.thread).stats())


def test_thread_totals_only_grow_when_a_branch_is_adopted(example, tiny_backend):
    module = example("tree_of_thought")
    llm = ChatAgentKV(backend=tiny_backend, max_new_tokens=6)
    thread = "tot-acct"
    graph = with_kv_lifecycle(module.build_graph(llm, k=2), backend=tiny_backend)
    probe = ThreadStats(tiny_backend, thread, "answer")
    graph.invoke(
        {"messages": [], "thoughts": []}, {"configurable": {"thread_id": thread}, "callbacks": [probe]}
    )
    assert graph.agentkv.handler.adopted and graph.agentkv.handler.adopted[0][0] == thread
    before = probe.seen[0]
    after = tiny_backend.get(thread).stats()
    totals = ("prefill_tokens", "reused_tokens", "generated_tokens", "events_applied", "transitions")
    for name in totals:
        assert getattr(after, name) >= getattr(before, name), name
    # The adopted branch's own work is added to the thread's totals, not swapped in for them.
    assert after.prefill_tokens > before.prefill_tokens
    assert after.events_applied > before.events_applied
