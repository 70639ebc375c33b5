"""Issue 10 items 2 and 3: plain `Send` branches fork, and settle by themselves.

A fan-out whose branches the thread never continues with is pruned when the run
ends (their sessions closed, their own KV freed); a branch the user selects
(`select_branch`) or a `branch_selector` names is kept for the next run, and
pruned there if the thread goes on without it; a tool run in a `Send` task (how
`create_agent` runs tools) is not a branch.
"""

from __future__ import annotations

import operator
from typing import Annotated, Any

from langchain_core.messages import AnyMessage, HumanMessage, SystemMessage
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages
from langgraph.types import Send
from typing_extensions import TypedDict

from agentkv import BranchOpened, BranchPruned, TransformersBackend
from agentkv_langchain import ChatAgentKV
from agentkv_langgraph import select_branch, with_kv_lifecycle

SYSTEM = SystemMessage("You are a helpful assistant.")
THREAD = "fan"


class State(TypedDict):
    messages: Annotated[list[AnyMessage], add_messages]
    thoughts: Annotated[list[str], operator.add]


def fan_graph(llm: ChatAgentKV, *, k: int = 3, select_first: bool = False) -> Any:
    """ask → k × think (Send) → judge (no model call; optionally `select_branch`) → END."""

    def ask(state: State) -> dict[str, Any]:
        answer = llm.invoke([SYSTEM, *state["messages"]])
        return {"messages": [answer]}

    def think(task: dict[str, Any]) -> dict[str, Any]:
        answer = llm.invoke([SYSTEM, *task["messages"], HumanMessage(f"Idea {task['i']}")])
        return {"thoughts": [f"{task['i']}:{answer.response_metadata['session_id']}"]}

    def judge(state: State) -> dict[str, Any]:
        if select_first:
            first = sorted(state["thoughts"])[0].split(":", 1)[1].split("/", 1)[1]
            select_branch(first)
        return {}

    builder = StateGraph(State)
    builder.add_node("ask", ask)
    builder.add_node("think", think)
    builder.add_node("judge", judge)
    builder.add_edge(START, "ask")
    builder.add_conditional_edges(
        "ask", lambda s: [Send("think", {"messages": s["messages"], "i": i}) for i in range(k)], ["think"]
    )
    builder.add_edge("think", "judge")
    builder.add_edge("judge", END)
    return builder.compile(checkpointer=InMemorySaver())


def opened(graph: Any) -> list[str]:
    return [e.branch for _, e in graph.agentkv.handler.events if isinstance(e, BranchOpened)]


def test_send_calls_fork_and_are_pruned_when_the_run_ends(tiny_backend: TransformersBackend):
    llm = ChatAgentKV(backend=tiny_backend, max_new_tokens=4)
    graph = with_kv_lifecycle(fan_graph(llm), backend=tiny_backend)
    out = graph.invoke({"messages": [HumanMessage("Plan a trip.")]}, {"configurable": {"thread_id": THREAD}})
    branches = opened(graph)
    assert len(branches) == 3
    # Each think call ran on the fork named by its Send task id.
    assert sorted(t.split(":", 1)[1] for t in out["thoughts"]) == sorted(f"{THREAD}/{b}" for b in branches)
    pruned = [
        e.branch for sid, e in graph.agentkv.handler.events if isinstance(e, BranchPruned) and sid == THREAD
    ]
    assert sorted(pruned) == sorted(branches)
    assert [s.session_id for s in tiny_backend.sessions()] == [THREAD]
    assert tiny_backend.device_bytes() == tiny_backend.get(THREAD).stats().device_bytes


def test_selected_branch_outlives_the_run_then_goes(tiny_backend: TransformersBackend):
    llm = ChatAgentKV(backend=tiny_backend, max_new_tokens=4)
    graph = with_kv_lifecycle(fan_graph(llm, select_first=True), backend=tiny_backend)
    config = {"configurable": {"thread_id": THREAD}}
    graph.invoke({"messages": [HumanMessage("Plan a trip.")]}, config)
    first = opened(graph)
    kept = [s.session_id for s in tiny_backend.sessions() if s.session_id != THREAD]
    assert len(kept) == 1 and kept[0].split("/", 1)[1] in first
    # The next run goes on without it: its first thread-level call prunes it.
    graph.invoke({"messages": [HumanMessage("Another trip.")]}, config)
    live = {s.session_id for s in tiny_backend.sessions()}
    assert kept[0] not in live
    assert graph.agentkv.handler.errors == 0


def test_branch_selector_keeps_its_pick(tiny_backend: TransformersBackend):
    llm = ChatAgentKV(backend=tiny_backend, max_new_tokens=4)
    asked: list[tuple[str, list[str]]] = []

    def pick_last(thread: str, branches: Any) -> str:
        asked.append((thread, list(branches)))
        return sorted(branches)[-1]

    graph = with_kv_lifecycle(fan_graph(llm), backend=tiny_backend, branch_selector=pick_last)
    graph.invoke({"messages": [HumanMessage("Plan a trip.")]}, {"configurable": {"thread_id": THREAD}})
    assert asked == [(THREAD, sorted(opened(graph)))]
    assert sorted(s.session_id for s in tiny_backend.sessions()) == [
        THREAD,
        f"{THREAD}/{sorted(opened(graph))[-1]}",
    ]
