"""Tree of thought with `Send`: k branches fork one KV prefix, the losers are pruned.

The graph frames a problem in the thread's session, then fans out k `Send` tasks;
each runs its model call in a **branch session** (`branch_config`), a fork that
shares the thread's KV as a read-only prefix and holds only its own tokens. A judge
scores the thoughts, prunes the losers (`prune_branch`: each one's session is
closed, its own KV freed at once, the shared prefix untouched) and selects the
winner (`select_branch`); the thread's session writes the final answer from it.

Measured in the judge, while all k branches are alive: `backend.device_bytes()`
(shared prefix counted once) against what copying the prefix into every branch
would hold. Run `python examples/tree_of_thought.py`.
"""

from __future__ import annotations

import operator
import re
from typing import Annotated, Any

from langchain_core.messages import AIMessage, AnyMessage, HumanMessage, SystemMessage
from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages
from langgraph.types import Send
from typing_extensions import TypedDict

from agentkv import TransformersBackend
from agentkv.session_ids import branch_session_id
from agentkv_langchain import ChatAgentKV
from agentkv_langgraph import (
    branch_config,
    current_branch,
    prune_branch,
    select_branch,
    shared_backend,
    with_kv_lifecycle,
)

SYSTEM = "You are a careful problem solver. Think step by step and keep each answer short."
PROBLEM = (
    "A farmer has 17 sheep and all but 9 run away. Then he buys twice as many sheep as he has left. "
    "How many sheep does the farmer have now?"
)
APPROACHES = (
    "Read the wording carefully: what does 'all but 9' mean?",
    "Write the numbers down and compute step by step.",
    "Check the answer by working backwards.",
    "Restate the problem in your own words first.",
    "Draw a small table of sheep before and after.",
)


class State(TypedDict):
    """The thread's conversation and the branches' thoughts."""

    messages: Annotated[list[AnyMessage], add_messages]
    thoughts: Annotated[list[dict[str, Any]], operator.add]
    winner: str | None
    memory: dict[str, Any]
    round: int


class Branch(TypedDict):
    """What a `Send` hands one branch task."""

    messages: list[AnyMessage]
    branch: str | None
    approach: str
    round: int


def score(thought: str, problem: str = PROBLEM) -> float:
    """A deterministic judge: how many of the problem's numbers and words the thought uses, per length.

    A real judge would ask the model or check the answer; this one keeps the example
    reproducible on any model and shows only the lifecycle.
    """
    words = set(re.findall(r"[a-z0-9]+", problem.lower()))
    used = set(re.findall(r"[a-z0-9]+", thought.lower()))
    return len(words & used) + 0.001 * min(len(thought), 400)


def build_graph(
    llm: ChatAgentKV, backend: TransformersBackend, *, k: int, thread_id: str, named: bool = True
) -> Any:
    """frame → k × think (Send, forked sessions) → judge (measure, prune, select) → answer."""

    def frame(state: State, config: RunnableConfig) -> dict[str, Any]:
        ask = HumanMessage(f"Problem: {PROBLEM} Restate the question in one sentence.")
        answer = llm.invoke([SystemMessage(SYSTEM), *state.get("messages", []), ask], config)
        return {"messages": [ask, answer], "round": state.get("round", 0) + 1}

    def fan_out(state: State) -> list[Send]:
        # Branch ids must be new in each fan-out: events are idempotent, so pruning a reused
        # id would be ignored as a duplicate (LangGraph's task ids are new at every step).
        names = [f"r{state['round']}-b{i}" if named else None for i in range(k)]
        return [
            Send(
                "think",
                Branch(messages=state["messages"], branch=name, approach=approach, round=state["round"]),
            )
            for name, approach in zip(names, APPROACHES[:k], strict=True)
        ]

    def think(task: Branch, config: RunnableConfig) -> dict[str, Any]:
        branch = task["branch"] or current_branch(config)  # unnamed: the Send task's id
        idea = HumanMessage(f"Idea: {task['approach']} Then give the answer.")
        answer = llm.invoke([SystemMessage(SYSTEM), *task["messages"], idea], branch_config(config, branch))
        thought = {
            "branch": branch,
            "text": str(answer.content),
            "message_id": answer.id,
            "round": task["round"],
        }
        return {"thoughts": [thought]}

    def judge(state: State, config: RunnableConfig) -> dict[str, Any]:
        thoughts = sorted(
            (t for t in state["thoughts"] if t["round"] == state["round"]), key=lambda t: t["branch"]
        )
        memory = measure(backend, thread_id, [t["branch"] for t in thoughts])
        best = max(thoughts, key=lambda t: (score(t["text"]), t["branch"]))
        for thought in thoughts:
            if thought["branch"] != best["branch"]:
                prune_branch(thought["branch"], config)
        memory["after_prune_bytes"] = backend.device_bytes()
        select_branch(best["branch"], config)
        memory["after_select_bytes"] = backend.device_bytes()
        return {"winner": best["branch"], "memory": memory}

    def answer(state: State, config: RunnableConfig) -> dict[str, Any]:
        best = next(t for t in state["thoughts"] if t["branch"] == state["winner"])
        use = HumanMessage(f"The best idea was: {best['text']} Give the final answer in one sentence.")
        final = llm.invoke([SystemMessage(SYSTEM), *state["messages"], use], config)
        return {"messages": [use, final]}

    builder = StateGraph(State)
    builder.add_node("frame", frame)
    builder.add_node("think", think)
    builder.add_node("judge", judge)
    builder.add_node("answer", answer)
    builder.add_edge(START, "frame")
    builder.add_conditional_edges("frame", fan_out, ["think"])
    builder.add_edge("think", "judge")
    builder.add_edge("judge", "answer")
    builder.add_edge("answer", END)
    return builder.compile(checkpointer=InMemorySaver())


def measure(backend: TransformersBackend, thread_id: str, branches: list[str]) -> dict[str, Any]:
    """Device KV bytes with every branch alive: shared (measured) vs the prefix copied per branch.

    `stats().device_bytes` of a branch counts the prefix it reads from its parent
    (`shared_device_bytes`) plus its own suffix; `backend.device_bytes()` counts each
    physical tensor once.
    """
    parent = backend.get(thread_id).stats()
    own: dict[str, int] = {}
    copied = parent.device_bytes
    for branch in branches:
        stats = backend.get(branch_session_id(thread_id, branch)).stats()
        own[branch] = stats.device_bytes - stats.shared_device_bytes
        copied += stats.device_bytes
    return {
        "alive_bytes": backend.device_bytes(),
        "prefix_bytes": parent.device_bytes,
        "branch_own_bytes": own,
        "copied_prefix_bytes": copied,
    }


def main(
    backend: TransformersBackend | None = None,
    turns: int = 1,
    *,
    k: int = 3,
    max_new_tokens: int = 32,
    thread_id: str = "tree-of-thought",
    named: bool = True,
) -> dict[str, Any]:
    """Run the tree of thought `turns` times on one thread; return what happened.

    Args:
        backend: The model's backend; None = the default model.
        turns: How many problems to solve on the thread (each one fans out again).
        k: Branches per problem (at most `len(APPROACHES)`).
        max_new_tokens: Length limit of each answer.
        thread_id: The LangGraph thread (the parent session).
        named: Name branches r<round>-b<i>; False = use the `Send` tasks' ids.

    Returns:
        `branches`, `winner`, `thoughts`, `memory` (bytes while alive, after pruning,
        after selecting, and the copy-the-prefix figure), `sessions` (live session ids
        after the run), `events`, `stats` of the thread's session.
    """
    backend = backend or shared_backend()
    llm = ChatAgentKV(backend=backend, max_new_tokens=max_new_tokens)
    k = max(1, min(k, len(APPROACHES)))
    graph = with_kv_lifecycle(
        build_graph(llm, backend, k=k, thread_id=thread_id, named=named), backend=backend
    )
    run_config: RunnableConfig = {"configurable": {"thread_id": thread_id}}
    out: dict[str, Any] = {}
    runs = []
    for _ in range(max(1, turns)):
        out = graph.invoke({"winner": None, "memory": {}}, run_config)
        runs.append({"winner": out["winner"], "memory": out["memory"]})
    final = out["messages"][-1]
    return {
        "branches": sorted(t["branch"] for t in out["thoughts"][-k:]),
        "winner": out["winner"],
        "thoughts": out["thoughts"][-k:],
        "memory": out["memory"],
        "runs": runs,
        "answer": final.content if isinstance(final, AIMessage) else None,
        "sessions": sorted(s.session_id for s in backend.sessions()),
        "events": [
            (sid, type(e).__name__, getattr(e, "branch", None)) for sid, e in graph.agentkv.handler.events
        ],
        "stats": backend.get(thread_id).stats().to_dict(),
        "device_bytes": backend.device_bytes(),
        "handler_errors": graph.agentkv.handler.errors,
    }


if __name__ == "__main__":
    result = main(k=4)
    memory = result["memory"]
    print(f"branches: {result['branches']}; winner: {result['winner']}")
    for thought in result["thoughts"]:
        print(f"  {thought['branch']}: score {score(thought['text']):.3f}  {thought['text'][:90]!r}")
    print(f"shared prefix (the thread's KV): {memory['prefix_bytes']:,} bytes")
    print(f"branches' own suffixes: { {b: f'{n:,}' for b, n in memory['branch_own_bytes'].items()} }")
    print(f"device KV with all branches alive, prefix shared:  {memory['alive_bytes']:,} bytes")
    print(f"the same with the prefix copied into every branch: {memory['copied_prefix_bytes']:,} bytes")
    print(
        f"after pruning the losers: {memory['after_prune_bytes']:,}; "
        f"after selecting: {memory['after_select_bytes']:,}"
    )
    print(f"live sessions at the end: {result['sessions']}")
    print("final answer:", (result["answer"] or "")[:200])
