"""`agentkv.sessions`: a backend ends sessions beyond a most-sessions limit or idle too long.

Without a bound, every LangGraph thread ever seen keeps its KV (24 threads, 24 live
sessions). With `max_live` / `idle_seconds`, the least recently used or idle threads
are closed; a thread that comes back re-encodes the history its call sends and answers
as a thread that was never ended.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import pytest
from langchain_core.messages import AIMessage, AnyMessage, HumanMessage
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import START, MessagesState, StateGraph

from agentkv import AgentKVConfig, TransformersBackend, UnknownSessionError
from agentkv.backend.retention import SessionUse, sessions_to_end
from agentkv.config import SessionsConfig
from agentkv_langchain import ChatAgentKV
from agentkv_langgraph import with_kv_lifecycle


class FakeClock:
    """A clock the test moves by hand (no test reads the wall clock)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def graph_over(backend: TransformersBackend) -> Any:
    llm = ChatAgentKV(backend=backend, max_new_tokens=3)

    def agent(state: MessagesState) -> dict[str, list[AnyMessage]]:
        return {"messages": [llm.invoke(state["messages"])]}

    builder = StateGraph(MessagesState)
    builder.add_node("agent", agent)
    builder.add_edge(START, "agent")
    return with_kv_lifecycle(builder.compile(checkpointer=InMemorySaver()), backend=backend)


def ask(graph: Any, thread: str, text: str) -> AIMessage:
    out = graph.invoke({"messages": [HumanMessage(text)]}, {"configurable": {"thread_id": thread}})
    answer = out["messages"][-1]
    assert isinstance(answer, AIMessage)
    return answer


def test_sessions_to_end_idle_first_then_least_recently_used() -> None:
    uses = [
        SessionUse("a", 10.0, True),
        SessionUse("b", 50.0, True),
        SessionUse("c", 60.0, False),  # being opened / has branches
        SessionUse("d", 70.0, True),
    ]
    assert sessions_to_end(uses, SessionsConfig(), 100.0) == []
    assert sessions_to_end(uses, SessionsConfig(idle_seconds=45.0), 100.0) == ["a", "b"]
    assert sessions_to_end(uses, SessionsConfig(max_live=2), 100.0) == ["a", "b"]
    assert sessions_to_end(uses, SessionsConfig(max_live=1), 100.0) == ["a", "b", "d"]  # c is never ended
    assert sessions_to_end(uses, SessionsConfig(max_live=3, idle_seconds=80.0), 100.0) == ["a"]


def test_yaml_sessions_section_loads_and_is_validated() -> None:
    config = AgentKVConfig.from_yaml_text("agentkv:\n  sessions:\n    max_live: 4\n    idle_seconds: 600\n")
    assert config.sessions == SessionsConfig(max_live=4, idle_seconds=600.0)
    with pytest.raises(ValueError) as info:
        AgentKVConfig.from_yaml_text("agentkv:\n  sessions:\n    max_live: 0\n    idle_secs: 5\n")
    lines = str(info.value).splitlines()
    assert "agentkv.sessions.max_live: must be >= 1, got 0 (line 3)" in lines
    assert any(
        line.startswith("agentkv.sessions.idle_secs: unknown key (did you mean 'idle_seconds'?)")
        for line in lines
    )


def test_unbounded_backend_keeps_every_thread(tiny_model, tiny_tokenizer) -> None:
    backend = TransformersBackend(tiny_model, tiny_tokenizer, AgentKVConfig(policy="full"))
    graph = graph_over(backend)
    for i in range(6):
        ask(graph, f"t{i}", "hello")
    assert len(list(backend.sessions())) == 6


def test_most_sessions_limit_ends_the_least_recently_used_threads(tiny_model, tiny_tokenizer) -> None:
    config = AgentKVConfig.from_dict({"policy": "full", "sessions": {"max_live": 4}})
    backend = TransformersBackend(tiny_model, tiny_tokenizer, config, clock=FakeClock())
    clock = backend.clock
    assert isinstance(clock, FakeClock)
    graph = graph_over(backend)
    for i in range(24):
        clock.now += 1
        ask(graph, f"t{i}", f"hello number {i}")
    live = sorted(s.session_id for s in backend.sessions())
    assert live == ["t20", "t21", "t22", "t23"]
    assert backend.ended_sessions == 20
    assert backend.device_bytes() == sum(s.stats().device_bytes for s in backend.sessions())


def test_ended_thread_re_encodes_its_history_and_answers_as_if_never_ended(
    tiny_model, tiny_tokenizer
) -> None:
    config = AgentKVConfig.from_dict({"policy": "full", "sessions": {"idle_seconds": 60}})
    clock = FakeClock()
    bounded = TransformersBackend(tiny_model, tiny_tokenizer, config, clock=clock)
    plain = TransformersBackend(tiny_model, tiny_tokenizer, AgentKVConfig(policy="full"))
    ours, reference = graph_over(bounded), graph_over(plain)
    first = [ask(g, "kept", "My order is QX-7305.") for g in (ours, reference)]
    assert first[0].content == first[1].content
    clock.now += 61
    ask(ours, "other", "hi")  # any use of the backend checks the bounds
    assert "kept" not in bounded and bounded.ended_sessions == 1
    again = [ask(g, "kept", "What is my order?") for g in (ours, reference)]
    assert again[0].content == again[1].content  # the history came back whole
    meta = again[0].response_metadata
    assert again[0].usage_metadata["input_token_details"]["cache_read"] == 0  # nothing was cached any more
    assert meta["prefill_tokens"] == again[0].usage_metadata["input_tokens"]
    assert again[1].usage_metadata["input_token_details"]["cache_read"] > 0


def test_closing_a_thread_the_bounds_ended_is_a_logged_noop(tiny_model, tiny_tokenizer, caplog) -> None:
    """An app's logout hook closes its thread whether or not the idle bound got there first."""
    config = AgentKVConfig.from_dict({"policy": "full", "sessions": {"idle_seconds": 60, "max_live": 2}})
    clock = FakeClock()
    backend = TransformersBackend(tiny_model, tiny_tokenizer, config, clock=clock)
    graph = graph_over(backend)
    ask(graph, "idle", "hello")
    clock.now += 61
    ask(graph, "other", "hi")
    for i in range(3):  # and one pushed out by max_live
        clock.now += 1
        ask(graph, f"t{i}", "hi")
    assert "idle" not in backend and "other" not in backend and backend.ended_sessions == 3
    with caplog.at_level(logging.INFO, logger="agentkv"):
        backend.close("idle")
        backend.close("other")
    assert "close('idle') ignored: the session already ended" in caplog.text
    backend.close("t2")
    backend.close("t2")  # closing twice is the same no-op
    with pytest.raises(UnknownSessionError, match="never-opened"):
        backend.close("never-opened")  # a thread id that was never open is still an error
    ask(graph, "idle", "back again")  # the thread comes back: a live session, closed for real
    backend.close("idle")
    assert "idle" not in backend


def test_idle_bound_spares_a_thread_in_use(tiny_model, tiny_tokenizer) -> None:
    config = AgentKVConfig.from_dict({"policy": "full", "sessions": {"idle_seconds": 60}})
    clock = FakeClock()
    backend = TransformersBackend(tiny_model, tiny_tokenizer, config, clock=clock)
    backend.session("a")
    backend.session("b")
    clock.now += 61
    session_b = backend.get("b")
    assert "a" not in backend and "b" in backend  # b was being opened
    held, done = threading.Event(), threading.Event()

    def busy() -> None:  # b is in a call on another thread
        with session_b.lock:
            held.set()
            done.wait()

    worker = threading.Thread(target=busy)
    worker.start()
    held.wait()
    try:
        clock.now += 61
        backend.session("c")
        assert "b" in backend
    finally:
        done.set()
        worker.join()
    clock.now += 61
    assert backend.end_idle_sessions() == ["b", "c"]


def _idle_graph() -> Any:
    """A one-node graph that answers nothing (what `with_kv_lifecycle` wraps here)."""
    builder = StateGraph(MessagesState)
    builder.add_node("agent", lambda state: {"messages": []})
    builder.add_edge(START, "agent")
    return builder.compile()


def test_session_bounds_are_backend_wide_never_ignored(tiny_model, tiny_tokenizer, caplog) -> None:
    backend = TransformersBackend(tiny_model, tiny_tokenizer, AgentKVConfig(policy="full"))
    with pytest.raises(ValueError, match="agentkv.sessions is backend-wide"):
        with_kv_lifecycle(_idle_graph(), backend=backend, config={"sessions": {"max_live": 2}})
    graph = graph_over(backend)
    with caplog.at_level(logging.WARNING, logger="agentkv.langgraph"):
        graph.invoke(
            {"messages": [HumanMessage("hi")]},
            {"configurable": {"thread_id": "t", "agentkv": {"sessions": {"max_live": 1}}}},
        )
    assert any("sessions cannot change per run" in r.getMessage() for r in caplog.records)


def test_prefix_cache_settings_are_backend_wide_but_a_session_may_opt_out(tiny_model, tiny_tokenizer) -> None:
    backend = TransformersBackend(tiny_model, tiny_tokenizer, AgentKVConfig(policy="full"))
    with pytest.raises(ValueError, match="agentkv.prefix_cache is backend-wide"):
        with_kv_lifecycle(_idle_graph(), backend=backend, config={"prefix_cache": {"max_tokens": 512}})
    opted_out = {"policy": "full", "prefix_cache": {"enabled": False}}
    with_kv_lifecycle(_idle_graph(), backend=backend, config=opted_out)  # honoured per session
