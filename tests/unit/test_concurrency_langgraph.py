"""Many LangGraph threads on one backend at once, through an async compiled graph.

The async half of issue 6 (the sync half is `test_concurrency.py`): a compiled
`StateGraph` with a checkpointer, wrapped by `with_kv_lifecycle`, whose agent node
awaits `ChatAgentKV.ainvoke`. 32 `thread_id`s (one agentkv session each) run three
turns each, all threads at once under `asyncio.gather`, with the model calls on an
8-thread executor. One turn runs a real tool (`ToolNode`), so the handler sends
`ToolCallCompleted` besides the `TurnEnded` of every run. Checks: the whole thing
ends (a generous `wait_for` only detects a deadlock), each thread's answers, tokens,
events and final logits equal the same thread run alone on a fresh backend (greedy
decoding; per-session budgets make a session independent of the others), and the
byte accounting is exact. A second run puts every session under one *global*
budget (sessions read each other's bytes while they run: the case that can deadlock).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Annotated, Any, TypedDict

import pytest
import torch
from langchain_core.messages import AIMessage, AnyMessage, HumanMessage, SystemMessage
from langchain_core.runnables import RunnableConfig
from langchain_core.tools import tool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages
from langgraph.prebuilt import ToolNode

from agentkv import AgentKVConfig, ToolCallCompleted, TransformersBackend, TurnEnded
from agentkv.backend.session import Session
from agentkv_langchain import ChatAgentKV
from agentkv_langgraph import with_kv_lifecycle
from tests.unit.store_accounting import assert_tier_bytes

THREADS = 32
WORKERS = 8
TURNS = 3
TIMEOUT_S = 240.0
TOL = 1e-4
PROBE = [5, 6, 7]
MAX_NEW_TOKENS = 3
CONFIG = {
    "budget": {"device_tokens": 110, "host_tokens": 200},
    "archive_tier": "host",
    "quantization": {"attended_bits": None},  # pressure archives at once: host-tier moves under threads
}


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """Many tiny forwards: intra-op threads only add contention (see test_concurrency.py)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class AgentState(TypedDict):
    messages: Annotated[list[AnyMessage], add_messages]


@dataclass
class Progress:
    """What a run got through: turns finished per thread, and model calls in flight at once."""

    turns_done: list[int] = field(default_factory=lambda: [0] * THREADS)
    model_calls: int = 0
    in_flight: int = 0
    peak_in_flight: int = 0


@tool
def weather(city: str) -> str:
    """Weather report for a city (its length depends on the city, so threads differ)."""
    n = int(city.split()[-1])
    return f"search results {n}: sunny skies " * (1 + n % 3)


def build_graph(backend: TransformersBackend, progress: Progress) -> Any:
    """plan -> (tools ->) agent: `plan` scripts a tool call when asked about the weather.

    The call is scripted because a tiny random model cannot choose a tool; the tool
    itself runs for real (`ToolNode`), so its callbacks reach the handler.
    """
    llm = ChatAgentKV(backend=backend, max_new_tokens=MAX_NEW_TOKENS)

    def plan(state: AgentState) -> dict[str, Any]:
        last = state["messages"][-1]
        if not (isinstance(last, HumanMessage) and "weather" in str(last.content)):
            return {}
        n = str(last.content).split()[-1].rstrip("?")
        call = {"name": "weather", "args": {"city": f"city {n}"}, "id": f"call_{n}", "type": "tool_call"}
        return {"messages": [AIMessage(content="", tool_calls=[call], id=f"plan-{n}")]}

    async def agent(state: AgentState, config: RunnableConfig) -> dict[str, Any]:
        # Counted on the event loop's thread: no lock needed.
        progress.in_flight += 1
        progress.peak_in_flight = max(progress.peak_in_flight, progress.in_flight)
        try:
            answer = await llm.ainvoke(state["messages"], config)
        finally:
            progress.in_flight -= 1
        progress.model_calls += 1
        return {"messages": [answer]}

    def after_plan(state: AgentState) -> str:
        last = state["messages"][-1]
        return "tools" if isinstance(last, AIMessage) and last.tool_calls else "agent"

    builder = StateGraph(AgentState)
    builder.add_node("plan", plan)
    builder.add_node("tools", ToolNode([weather]))
    builder.add_node("agent", agent)
    builder.add_edge(START, "plan")
    builder.add_conditional_edges("plan", after_plan, ["tools", "agent"])
    builder.add_edge("tools", "agent")
    builder.add_edge("agent", END)
    return with_kv_lifecycle(builder.compile(checkpointer=InMemorySaver()), backend=backend)


def turns(i: int) -> list[list[AnyMessage]]:
    """Thread i's user inputs, one list per graph run; the text depends on i so leakage would show."""
    return [
        [
            SystemMessage("You are a helpful assistant.", id=f"sys-{i}"),
            HumanMessage(f"session {i}: the secret code is {4000 + i} lorem ipsum", id=f"u{i}-0"),
        ],
        [HumanMessage(f"what is the weather in city {i}?", id=f"u{i}-1")],
        [HumanMessage(f"thanks; remind me of code {4000 + i}?", id=f"u{i}-2")],
    ]


async def drive(graph: Any, progress: Progress, i: int) -> dict[str, Any]:
    """Run thread i's turns one after the other; return what the thread ended with."""
    config: RunnableConfig = {"configurable": {"thread_id": f"t{i}"}}
    for user in turns(i):
        state = await graph.ainvoke({"messages": user}, config)
        progress.turns_done[i] += 1
    session = graph.agentkv.backend.get(f"t{i}")
    return {
        "answers": [m.content for m in state["messages"] if isinstance(m, AIMessage) and not m.tool_calls],
        "events": graph.agentkv.handler.events_for(f"t{i}"),
        "tokens": await asyncio.to_thread(session.token_ids),
        "logits": await asyncio.to_thread(session.continuation_logits, PROBE),
    }


async def drive_all(graph: Any, progress: Progress) -> list[dict[str, Any]]:
    """Every thread at once; the model calls share a WORKERS-thread executor."""
    loop = asyncio.get_running_loop()
    loop.set_default_executor(ThreadPoolExecutor(WORKERS))
    work = asyncio.gather(*(drive(graph, progress, i) for i in range(THREADS)))
    try:
        return list(await asyncio.wait_for(work, TIMEOUT_S))
    except TimeoutError:
        # asyncio.run would wait forever for the stuck workers: hand it an idle executor to close.
        loop.set_default_executor(ThreadPoolExecutor(1))
        msg = f"deadlock or stall after {TIMEOUT_S}s: turns done per thread {progress.turns_done}"
        raise AssertionError(msg) from None


@pytest.fixture(scope="module")
def solo(tiny_model, tiny_tokenizer) -> list[dict[str, Any]]:
    """Each thread run alone, on a fresh backend of its own."""

    async def one(i: int) -> dict[str, Any]:
        backend = TransformersBackend(tiny_model, tiny_tokenizer, AgentKVConfig.from_dict(CONFIG))
        progress = Progress()
        return await drive(build_graph(backend, progress), progress, i)

    return [asyncio.run(one(i)) for i in range(THREADS)]


def assert_exact_accounting(backend: TransformersBackend) -> list[Session]:
    sessions = [backend.get(f"t{i}") for i in range(THREADS)]
    assert sorted(s.session_id for s in backend.sessions()) == sorted(f"t{i}" for i in range(THREADS))
    total_device = 0
    for session in sessions:
        session.check()
        stats = session.stats()
        assert_tier_bytes(session)  # each tier's bytes are the tensors it holds
        assert stats.device_bytes == stats.attended_tokens * backend.runner.bytes_per_token
        total_device += stats.device_bytes + stats.quantized_bytes
    assert backend.device_bytes() == total_device
    return sessions


def assert_all_done(progress: Progress) -> None:
    assert progress.turns_done == [TURNS] * THREADS
    assert progress.model_calls == THREADS * TURNS
    # The threads really overlapped: several model calls were awaited at the same time.
    assert progress.peak_in_flight > 1


def expected_events(i: int) -> list[Any]:
    return [TurnEnded(), ToolCallCompleted(f"call_{i}"), TurnEnded(), TurnEnded()]


def test_async_graph_drives_threads_without_leakage(tiny_model, tiny_tokenizer, solo):
    backend = TransformersBackend(tiny_model, tiny_tokenizer, AgentKVConfig.from_dict(CONFIG))
    progress = Progress()
    graph = build_graph(backend, progress)
    results = asyncio.run(drive_all(graph, progress))
    assert_all_done(progress)

    for i, (got, want) in enumerate(zip(results, solo, strict=True)):
        assert len(got["answers"]) == TURNS
        assert got["answers"] == want["answers"], f"thread {i} answered differently"
        assert got["events"] == want["events"] == expected_events(i)
        assert got["tokens"] == want["tokens"], f"thread {i} holds other tokens"
        delta = (got["logits"] - want["logits"]).abs().max().item()
        assert delta <= TOL, f"thread {i}: logits differ from its solo run by {delta}"
    assert any(answer for got in results for answer in got["answers"]), "the model should have said something"
    # Every event went to the thread whose run caused it.
    assert len(graph.agentkv.handler.events) == THREADS * len(expected_events(0))
    assert graph.agentkv.handler.errors == 0
    sessions = assert_exact_accounting(backend)
    assert any(s.stats().host_bytes for s in sessions), "the budget should have archived something"


def test_async_graph_under_a_global_budget_does_not_deadlock(tiny_model, tiny_tokenizer):
    bpt = 2 * 3 * 2 * 16 * 4  # tiny model: 2 (k, v) x 3 layers x 2 kv heads x 16 head dim x fp32
    cap = THREADS * 60 * bpt
    config = {**CONFIG, "budget": {"global_device_bytes": cap, "host_tokens": 400}}
    backend = TransformersBackend(tiny_model, tiny_tokenizer, AgentKVConfig.from_dict(config))
    assert backend.runner.bytes_per_token == bpt
    progress = Progress()
    graph = build_graph(backend, progress)
    results = asyncio.run(drive_all(graph, progress))
    assert_all_done(progress)

    for i, got in enumerate(results):
        assert len(got["answers"]) == TURNS
        assert got["events"] == expected_events(i)
        text = tiny_tokenizer.decode(got["tokens"])
        assert f"session {i}:" in text and f"city {i}?" in text  # its own history, whole
        assert not any(f"session {j}:" in text for j in range(THREADS) if j != i)
    assert graph.agentkv.handler.errors == 0
    sessions = assert_exact_accounting(backend)
    assert sum(s.stats().host_bytes for s in sessions) > 0, "the global budget should have archived something"
    assert backend.device_bytes() <= cap or any(not s.stats().budget_satisfied for s in sessions)
