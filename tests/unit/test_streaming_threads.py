"""Issue 10 item 1: every streaming entry point runs on the thread's own session.

Two threads, two turns each, interleaved (A1, B1, A2, B2), in each way an app
streams: `llm.stream` / `llm.astream` with the thread in the config, a compiled
graph streamed with `stream_mode` "messages", "updates" and "values" (sync and
async), and `astream_events(version="v2")`. Each thread must land on its own
session (none on "default"), read its history from the cache on its second turn,
get its lifecycle events, and answer exactly what the invoke path answers
(greedy decoding on the tiny model).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from langchain_core.messages import AIMessage, AnyMessage, HumanMessage, SystemMessage
from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import START, MessagesState, StateGraph

from agentkv import AgentKVConfig, TransformersBackend, TurnEnded
from agentkv_langchain import ChatAgentKV
from agentkv_langgraph import with_kv_lifecycle

THREADS = ("thread-a", "thread-b")
QUESTIONS = {
    "thread-a": ("The secret code is 4417. What is it?", "And the code again?"),
    "thread-b": ("The weather in Paris is sunny. How is it?", "And tomorrow?"),
}
SYSTEM = SystemMessage("You are a helpful assistant.", id="sys")
GRAPH_MODES = ("messages", "updates", "values")


def fresh(tiny_model: Any, tiny_tokenizer: Any) -> tuple[TransformersBackend, ChatAgentKV]:
    backend = TransformersBackend(tiny_model, tiny_tokenizer, AgentKVConfig(policy="full"))
    return backend, ChatAgentKV(backend=backend, max_new_tokens=6)


def graph_for(llm: ChatAgentKV, backend: TransformersBackend, *, streaming_node: bool = False) -> Any:
    """One agent node; `streaming_node` makes it call `llm.stream` (no config) instead of `invoke`."""

    def agent(state: MessagesState) -> dict[str, list[AnyMessage]]:
        messages = [SYSTEM, *state["messages"]]
        if streaming_node:
            chunks = list(llm.stream(messages))
            merged = chunks[0]
            for chunk in chunks[1:]:
                merged = merged + chunk
            answer: AnyMessage = AIMessage(
                content=merged.content,
                id=merged.id,
                usage_metadata=merged.usage_metadata,
                response_metadata=merged.response_metadata,
            )
        else:
            answer = llm.invoke(messages)
        return {"messages": [answer]}

    builder = StateGraph(MessagesState)
    builder.add_node("agent", agent)
    builder.add_edge(START, "agent")
    return with_kv_lifecycle(builder.compile(checkpointer=InMemorySaver()), backend=backend)


def config(thread: str) -> RunnableConfig:
    return {"configurable": {"thread_id": thread}}


def reference_answers(tiny_model: Any, tiny_tokenizer: Any) -> dict[str, list[str]]:
    """What the invoke path answers, per thread and turn."""
    backend, llm = fresh(tiny_model, tiny_tokenizer)
    graph = graph_for(llm, backend)
    out: dict[str, list[str]] = {t: [] for t in THREADS}
    for turn in range(2):
        for thread in THREADS:
            state = graph.invoke({"messages": [HumanMessage(QUESTIONS[thread][turn])]}, config(thread))
            out[thread].append(str(state["messages"][-1].content))
    return out


@pytest.fixture(scope="module")
def expected(tiny_model: Any, tiny_tokenizer: Any) -> dict[str, list[str]]:
    return reference_answers(tiny_model, tiny_tokenizer)


def check_threads(
    backend: TransformersBackend, graph: Any, answers: dict[str, list[str]], expected: Any
) -> None:
    live = {s.session_id for s in backend.sessions()}
    assert live == set(THREADS), f"sessions: {live}"
    assert answers == expected
    for thread in THREADS:
        state = graph.get_state(config(thread)).values["messages"]
        second = state[-1]
        assert second.usage_metadata["input_token_details"]["cache_read"] > 0
        assert second.response_metadata["session_id"] == thread
        events = graph.agentkv.handler.events_for(thread)
        assert sum(isinstance(e, TurnEnded) for e in events) == 2
    assert graph.agentkv.handler.events_for("default") == []


@pytest.mark.parametrize("mode", GRAPH_MODES)
@pytest.mark.parametrize("streaming_node", [False, True])
def test_graph_stream_modes_keep_threads_apart(tiny_model, tiny_tokenizer, expected, mode, streaming_node):
    backend, llm = fresh(tiny_model, tiny_tokenizer)
    graph = graph_for(llm, backend, streaming_node=streaming_node)
    answers: dict[str, list[str]] = {t: [] for t in THREADS}
    for turn in range(2):
        for thread in THREADS:
            items = list(
                graph.stream(
                    {"messages": [HumanMessage(QUESTIONS[thread][turn])]}, config(thread), stream_mode=mode
                )
            )
            assert items, "the stream yielded nothing"
            answers[thread].append(str(graph.get_state(config(thread)).values["messages"][-1].content))
    check_threads(backend, graph, answers, expected)


@pytest.mark.parametrize("mode", [*GRAPH_MODES, "events"])
def test_graph_astream_modes_keep_threads_apart(tiny_model, tiny_tokenizer, expected, mode):
    backend, llm = fresh(tiny_model, tiny_tokenizer)
    graph = graph_for(llm, backend)

    async def run(thread: str, turn: int) -> None:
        payload = {"messages": [HumanMessage(QUESTIONS[thread][turn])]}
        if mode == "events":
            kinds = [e["event"] async for e in graph.astream_events(payload, config(thread), version="v2")]
            assert "on_chat_model_stream" in kinds or "on_chat_model_end" in kinds
        else:
            assert [item async for item in graph.astream(payload, config(thread), stream_mode=mode)]

    answers: dict[str, list[str]] = {t: [] for t in THREADS}
    for turn in range(2):
        for thread in THREADS:
            asyncio.run(run(thread, turn))
            answers[thread].append(str(graph.get_state(config(thread)).values["messages"][-1].content))
    check_threads(backend, graph, answers, expected)


@pytest.mark.parametrize("use_async", [False, True])
@pytest.mark.parametrize("where", ["configurable", "metadata"])
def test_model_stream_reads_the_thread_from_the_config(
    tiny_model, tiny_tokenizer, expected, use_async, where
):
    """`llm.stream` / `llm.astream` outside a graph: the thread comes from the call's own config."""
    backend, llm = fresh(tiny_model, tiny_tokenizer)
    history: dict[str, list[AnyMessage]] = {t: [SYSTEM] for t in THREADS}
    cache_read: dict[str, list[int]] = {t: [] for t in THREADS}
    answers: dict[str, list[str]] = {t: [] for t in THREADS}

    async def collect_async(messages: list[AnyMessage], cfg: RunnableConfig) -> list[Any]:
        return [chunk async for chunk in llm.astream(messages, cfg)]

    for turn in range(2):
        for thread in THREADS:
            history[thread].append(HumanMessage(QUESTIONS[thread][turn]))
            cfg: RunnableConfig = (
                {"configurable": {"thread_id": thread}}
                if where == "configurable"
                else {"metadata": {"thread_id": thread}}
            )
            chunks = (
                asyncio.run(collect_async(history[thread], cfg))
                if use_async
                else list(llm.stream(history[thread], cfg))
            )
            merged = chunks[0]
            for chunk in chunks[1:]:
                merged = merged + chunk
            assert merged.response_metadata["session_id"] == thread
            cache_read[thread].append(merged.usage_metadata["input_token_details"]["cache_read"])
            answers[thread].append(str(merged.content))
            history[thread].append(AIMessage(content=merged.content, id=merged.id))
    assert {s.session_id for s in backend.sessions()} == set(THREADS)
    assert answers == expected
    for thread in THREADS:
        assert cache_read[thread][1] > 0
