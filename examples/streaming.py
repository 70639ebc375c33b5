"""Streaming a LangGraph agent: every mode keeps each thread on its own KV cache.

Two threads take turns (A1, B1, A2, B2) on one graph, streamed the ways apps
stream: `graph.stream(stream_mode="messages" | "updates" | "values")`,
`graph.astream(...)`, `graph.astream_events(version="v2")`, and the model alone
with `llm.stream(messages, {"configurable": {"thread_id": ...}})`. Nothing in the
nodes names a session: `ChatAgentKV` reads the thread from the run's config, so
each thread's second turn reads its history from the cache (`cache_read`) and
its lifecycle events land on its own session. Run `python examples/streaming.py`.
"""

from __future__ import annotations

import asyncio
from typing import Any

from langchain_core.messages import AIMessage, AIMessageChunk, AnyMessage, HumanMessage, SystemMessage
from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import START, MessagesState, StateGraph

from agentkv import TransformersBackend
from agentkv_langchain import ChatAgentKV
from agentkv_langgraph import shared_backend, with_kv_lifecycle

SYSTEM = SystemMessage("You are a concise assistant. Answer in one short sentence.")
TURNS = {
    "alice": ("My parcel number is ZX-4417. Say it back.", "What was my parcel number?"),
    "bob": ("I live in Lyon. Where do I live?", "Which city did I mention?"),
}
MODES = ("messages", "updates", "values", "astream", "astream_events", "model_stream")


def build_graph(llm: ChatAgentKV) -> Any:
    """One agent node that calls the model with the conversation; no agentkv call in it."""

    def agent(state: MessagesState) -> dict[str, list[AnyMessage]]:
        return {"messages": [llm.invoke([SYSTEM, *state["messages"]])]}

    builder = StateGraph(MessagesState)
    builder.add_node("agent", agent)
    builder.add_edge(START, "agent")
    return builder.compile(checkpointer=InMemorySaver())


def thread_config(mode: str, thread: str) -> RunnableConfig:
    return {"configurable": {"thread_id": f"{mode}-{thread}"}}


def run_mode(graph: Any, llm: ChatAgentKV, mode: str) -> dict[str, list[dict[str, Any]]]:
    """Two threads × two turns in one streaming mode; per thread and turn: text, session, cache_read."""
    out: dict[str, list[dict[str, Any]]] = {thread: [] for thread in TURNS}
    history: dict[str, list[AnyMessage]] = {thread: [SYSTEM] for thread in TURNS}
    for turn in range(2):
        for thread, questions in TURNS.items():
            config = thread_config(mode, thread)
            question = HumanMessage(questions[turn])
            if mode == "model_stream":
                history[thread].append(question)
                merged: AIMessageChunk | None = None
                for chunk in llm.stream(history[thread], config):
                    merged = chunk if merged is None else merged + chunk
                assert merged is not None
                answer: AIMessage = AIMessage(
                    content=merged.content,
                    id=merged.id,
                    usage_metadata=merged.usage_metadata,
                    response_metadata=merged.response_metadata,
                )
                history[thread].append(answer)
            else:
                stream(graph, mode, {"messages": [question]}, config)
                answer = graph.get_state(config).values["messages"][-1]
            usage = answer.usage_metadata or {}
            out[thread].append(
                {
                    "text": str(answer.content),
                    "session": answer.response_metadata.get("session_id"),
                    "cache_read": (usage.get("input_token_details") or {}).get("cache_read", 0),
                }
            )
    return out


def stream(graph: Any, mode: str, payload: dict[str, Any], config: RunnableConfig) -> int:
    """Drive one run in `mode`; returns how many items the stream yielded."""
    if mode in ("messages", "updates", "values"):
        return sum(1 for _ in graph.stream(payload, config, stream_mode=mode))

    async def drain() -> int:
        if mode == "astream":
            return len([item async for item in graph.astream(payload, config, stream_mode="messages")])
        return len([event async for event in graph.astream_events(payload, config, version="v2")])

    return asyncio.run(drain())


def main(backend: TransformersBackend | None = None, *, max_new_tokens: int = 24) -> dict[str, Any]:
    """Run every streaming mode; return per mode the turns, and the sessions and events seen.

    Returns:
        `modes` (mode → thread → turns with `text`, `session`, `cache_read`), `sessions`
        (live session ids), `events` (`(session, event name)` in order), `handler_errors`.
    """
    backend = backend or shared_backend()
    llm = ChatAgentKV(backend=backend, max_new_tokens=max_new_tokens)
    graph = with_kv_lifecycle(build_graph(llm), backend=backend)
    modes = {mode: run_mode(graph, llm, mode) for mode in MODES}
    handler = graph.agentkv.handler
    return {
        "modes": modes,
        "sessions": sorted(s.session_id for s in backend.sessions()),
        "events": [(sid, type(event).__name__) for sid, event in handler.events],
        "handler_errors": handler.errors,
    }


if __name__ == "__main__":
    result = main()
    print(f"{'mode':<16}{'thread':<8}{'session':<24}{'cache_read (turn 1, 2)':<24}")
    for mode, threads in result["modes"].items():
        for thread, turns in threads.items():
            reads = ", ".join(str(t["cache_read"]) for t in turns)
            print(f"{mode:<16}{thread:<8}{turns[-1]['session']:<24}{reads:<24}")
    print("sessions:", result["sessions"])
