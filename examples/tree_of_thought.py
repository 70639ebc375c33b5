"""Tree of thought with plain `Send`: k branches fork one KV prefix, the winner is adopted.

The graph is written as any LangGraph tree of thought is, with **no agentkv call in
its nodes**: `frame` asks the model to restate the problem, `Send` fans out k
`think` tasks, `judge` keeps the best thought (its messages join the conversation)
and `answer` writes the final answer from it. `with_kv_lifecycle` does the rest:

- each `think` task's model call runs on a fork of the thread's session (named by
  the task id) that shares the thread's KV as a read-only prefix and holds only its
  own suffix;
- the thread's next model call (`answer`) continues with the winner's messages, so
  the winner's session is **adopted** as the thread's (its KV is not re-encoded) and
  the losers get `BranchPruned` (their own KV is freed at once).

Measured by a callback (not in the nodes): device bytes with all k branches alive
(the prefix counted once, plus the prefix cache's unattended entries) against the
prefix copied into every branch, the bytes
each branch holds after the run, and prefill tokens with and without adoption.
Run `python examples/tree_of_thought.py`.
"""

from __future__ import annotations

import operator
import re
from typing import Annotated, Any

from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.messages import AIMessage, AnyMessage, HumanMessage, SystemMessage
from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages
from langgraph.types import Send
from typing_extensions import TypedDict

from agentkv import BranchOpened, TransformersBackend
from agentkv.session_ids import branch_session_id, is_branch_of
from agentkv_langchain import ChatAgentKV
from agentkv_langgraph import shared_backend, with_kv_lifecycle

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
    round: int


class Task(TypedDict):
    """What a `Send` hands one `think` task."""

    messages: list[AnyMessage]
    approach: str
    round: int


def score(thought: str, problem: str = PROBLEM) -> float:
    """A deterministic judge: how many of the problem's words the thought uses, per length.

    A real judge would ask the model or check the answer; this one keeps the example
    reproducible on any model and shows only the lifecycle.
    """
    words = set(re.findall(r"[a-z0-9]+", problem.lower()))
    used = set(re.findall(r"[a-z0-9]+", thought.lower()))
    return len(words & used) + 0.001 * min(len(thought), 400)


def build_graph(llm: ChatAgentKV, *, k: int) -> Any:
    """frame → k × think (plain `Send`) → judge (keeps the best thought) → answer."""

    def frame(state: State) -> dict[str, Any]:
        ask = HumanMessage(f"Problem: {PROBLEM} Restate the question in one sentence.")
        answer = llm.invoke([SystemMessage(SYSTEM), *state["messages"], ask])
        return {"messages": [ask, answer], "round": state.get("round", 0) + 1}

    def fan_out(state: State) -> list[Send]:
        return [
            Send("think", Task(messages=state["messages"], approach=approach, round=state["round"]))
            for approach in APPROACHES[:k]
        ]

    def think(task: Task) -> dict[str, Any]:
        idea = HumanMessage(f"Idea: {task['approach']} Then give the answer.")
        answer = llm.invoke([SystemMessage(SYSTEM), *task["messages"], idea])
        thought = {"messages": [idea, answer], "text": str(answer.content), "round": task["round"]}
        return {"thoughts": [thought]}

    def judge(state: State) -> dict[str, Any]:
        thoughts = [t for t in state["thoughts"] if t["round"] == state["round"]]
        best = max(thoughts, key=lambda t: (score(t["text"]), t["text"]))
        return {"messages": best["messages"]}  # the winner's thought joins the conversation

    def answer(state: State) -> dict[str, Any]:
        use = HumanMessage("Give the final answer in one sentence.")
        final = llm.invoke([SystemMessage(SYSTEM), *state["messages"], use])
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


class FanOutProbe(BaseCallbackHandler):
    """Reads the backend from callbacks, so the nodes stay free of agentkv calls.

    When `judge` starts, every branch is alive: that is when the fan-out's bytes are
    measured. Every model call's `prefill_tokens` is collected per node.
    """

    def __init__(self, backend: TransformersBackend, thread_id: str) -> None:
        super().__init__()
        self.backend = backend
        self.thread_id = thread_id
        self.fan_out: dict[str, Any] = {}
        self.prefill: list[tuple[str, int]] = []
        self._nodes: dict[Any, str] = {}

    def on_chain_start(self, serialized: Any, inputs: Any, *, run_id: Any, **kwargs: Any) -> None:
        node = (kwargs.get("metadata") or {}).get("langgraph_node")
        if node == "judge" and not self.fan_out:
            self.fan_out = measure(self.backend, self.thread_id)

    def on_chat_model_start(self, serialized: Any, messages: Any, *, run_id: Any, **kwargs: Any) -> None:
        self._nodes[run_id] = str((kwargs.get("metadata") or {}).get("langgraph_node"))

    def on_llm_end(self, response: Any, *, run_id: Any, **kwargs: Any) -> None:
        message = response.generations[0][0].message
        self.prefill.append((self._nodes.pop(run_id, "?"), int(message.response_metadata["prefill_tokens"])))


def measure(backend: TransformersBackend, thread_id: str) -> dict[str, Any]:
    """Device KV bytes with every branch alive: shared (measured) vs the prefix copied per branch.

    `stats().device_bytes` of a branch counts the prefix it reads from its parent
    (`shared_device_bytes`) plus its own suffix; `backend.device_bytes()` counts each
    physical tensor once, the backend's prefix cache included: its entries no session
    attends (`cached_prefix_bytes`, e.g. the system prompt kept for the next thread;
    the thread's fork holds its own copy) stay on the device until pressure evicts them.
    """
    parent = backend.get(thread_id).stats()
    own: dict[str, int] = {}
    copied = parent.device_bytes
    for session in backend.sessions():
        if is_branch_of(session.session_id, thread_id):
            stats = session.stats()
            own[str(session.branch)] = stats.device_bytes - stats.shared_device_bytes
            copied += stats.device_bytes
    cache = backend.prefix_cache
    return {
        "alive_bytes": backend.device_bytes(),
        "prefix_bytes": parent.device_bytes,
        "cached_prefix_bytes": 0 if cache is None else cache.stats().unreferenced_bytes,
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
    adopt: bool = True,
) -> dict[str, Any]:
    """Run the tree of thought `turns` times on one thread; return what happened.

    Args:
        backend: The model's backend; None = the default model.
        turns: How many problems to solve on the thread (each one fans out again).
        k: Branches per problem (at most `len(APPROACHES)`).
        max_new_tokens: Length limit of each answer.
        thread_id: The LangGraph thread (the parent session).
        adopt: Adopt the winner's session (False: prune every branch and let the
            thread re-encode the winner's messages, for comparison).

    Returns:
        `branches` (ids of the last fan-out), `adopted`, `memory` (bytes with all
        branches alive, the copy-the-prefix figure, bytes each branch holds after the
        run), `prefill` (per model call `(node, tokens)`), `answer_prefill` (the final
        call's), `sessions`, `events`, `stats` of the thread's session, `handler_errors`.
    """
    backend = backend or shared_backend()
    llm = ChatAgentKV(backend=backend, max_new_tokens=max_new_tokens)
    k = max(1, min(k, len(APPROACHES)))
    graph = with_kv_lifecycle(build_graph(llm, k=k), backend=backend, adopt_branches=adopt)
    handler = graph.agentkv.handler
    out: dict[str, Any] = {}
    runs = []
    for _ in range(max(1, turns)):
        probe = FanOutProbe(backend, thread_id)
        run_config: RunnableConfig = {"configurable": {"thread_id": thread_id}, "callbacks": [probe]}
        opened_before = len(handler.events)
        out = graph.invoke({"messages": [], "thoughts": []}, run_config)
        branches = sorted(e.branch for _, e in handler.events[opened_before:] if isinstance(e, BranchOpened))
        left = {b: _bytes_of(backend, branch_session_id(thread_id, b)) for b in branches}
        runs.append(
            {
                "branches": branches,
                "memory": {**probe.fan_out, "branch_bytes_after_run": left},
                "prefill": probe.prefill,
                "answer_prefill": probe.prefill[-1][1],
            }
        )
    final = out["messages"][-1]
    last = runs[-1]
    return {
        **last,
        "runs": runs,
        "adopted": list(handler.adopted),
        "answer": final.content if isinstance(final, AIMessage) else None,
        "sessions": sorted(s.session_id for s in backend.sessions()),
        "events": [(sid, type(e).__name__, getattr(e, "branch", None)) for sid, e in handler.events],
        "stats": backend.get(thread_id).stats().to_dict(),
        "device_bytes": backend.device_bytes(),
        "handler_errors": handler.errors,
    }


def _bytes_of(backend: TransformersBackend, session_id: str) -> int:
    """Device bytes a session still holds of its own (0 once closed)."""
    if session_id not in backend:
        return 0
    stats = backend.get(session_id).stats()
    return stats.device_bytes - stats.shared_device_bytes


if __name__ == "__main__":
    shared = shared_backend()
    adopted = main(shared, k=4, thread_id="tot-adopt")
    plain = main(shared, k=4, thread_id="tot-no-adopt", adopt=False)
    memory = adopted["memory"]
    print(f"branches: {adopted['branches']}; adopted: {adopted['adopted']}")
    print(f"shared prefix (the thread's KV): {memory['prefix_bytes']:,} bytes")
    print(f"branches' own suffixes: { {b[:8]: f'{n:,}' for b, n in memory['branch_own_bytes'].items()} }")
    print(f"prefix cache entries no session attends: {memory['cached_prefix_bytes']:,} bytes")
    print(f"device KV with all branches alive, prefix shared:  {memory['alive_bytes']:,} bytes")
    print(f"the same with the prefix copied into every branch: {memory['copied_prefix_bytes']:,} bytes")
    print(f"branch bytes after the run: {sorted(memory['branch_bytes_after_run'].values())}")
    for name, result in (("with adoption", adopted), ("without adoption", plain)):
        total = sum(n for _, n in result["prefill"])
        print(f"{name}: final answer prefilled {result['answer_prefill']} tokens; run total {total}")
    print("final answer:", (adopted["answer"] or "")[:200])
