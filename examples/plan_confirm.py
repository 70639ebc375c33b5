"""Plan, then ask the user: a confirmed plan is pinned in the KV cache, a rejected one released.

The graph writes a plan, pauses with LangGraph's `interrupt()` for the user's
verdict, and resumes with `Command(resume=...)`. The lifecycle handler reads the
resume value (`agentkv_langchain.callbacks.resume_decision`: "approve", "reject",
True/False, HITL-style `{"type": ...}` dicts) and sends `UserConfirmed` or
`UserRejected` for the span the interrupt names (`agentkv_owner`: the plan's
message id). Default rules: a confirmed plan is pinned (never demoted, even under
a tight budget), a rejected one is released (first to go).

LangGraph re-runs an interrupted node from the top when it resumes. The review
node only calls `interrupt()`, and events are idempotent, so the re-run adds no
span and no transition. Run `python examples/plan_confirm.py`.
"""

from __future__ import annotations

from typing import Annotated, Any

from langchain_core.messages import AIMessage, AnyMessage, HumanMessage, SystemMessage
from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages
from langgraph.types import Command, interrupt
from typing_extensions import TypedDict

from agentkv import TransformersBackend
from agentkv_langchain import ChatAgentKV
from agentkv_langgraph import OWNER_KEY, resume_decision, shared_backend, with_kv_lifecycle

SYSTEM = "You are a careful assistant. First propose a short numbered plan; carry it out only once approved."
TASK = "Plan a three-day trip to Lisbon for two people on a small budget."
VERDICTS: tuple[Any, ...] = ({"type": "reject", "message": "Too expensive, use public transport."}, "approve")
"""The scripted user: reject the first plan with feedback, approve the second."""


class State(TypedDict):
    """The conversation, the plan under review and the verdict on it."""

    messages: Annotated[list[AnyMessage], add_messages]
    plan_id: str | None
    approved: bool | None


def build_graph(llm: ChatAgentKV, reviews: list[str] | None = None) -> Any:
    """plan → review (interrupt) → execute, or back to plan with the user's feedback."""

    def plan(state: State, config: RunnableConfig) -> dict[str, Any]:
        answer = llm.invoke([SystemMessage(SYSTEM), *state["messages"]], config)
        return {"messages": [answer], "plan_id": answer.id, "approved": None}

    def review(state: State) -> dict[str, Any]:
        if reviews is not None:
            reviews.append(str(state["plan_id"]))  # counts runs of this node (a resume re-runs it)
        plan_message = state["messages"][-1]
        verdict = interrupt(
            {"question": "Approve this plan?", "plan": plan_message.content, OWNER_KEY: state["plan_id"]}
        )
        if resume_decision(verdict) == "confirm":
            return {"approved": True}
        feedback = verdict.get("message", "") if isinstance(verdict, dict) else ""
        note = f"I reject this plan. {feedback} Please propose a different plan.".replace("  ", " ")
        return {"approved": False, "messages": [HumanMessage(note)]}

    def execute(state: State, config: RunnableConfig) -> dict[str, Any]:
        go = HumanMessage("Approved. Carry out the plan: give the day-by-day schedule.")
        answer = llm.invoke([SystemMessage(SYSTEM), *state["messages"], go], config)
        return {"messages": [go, answer]}

    builder = StateGraph(State)
    builder.add_node("plan", plan)
    builder.add_node("review", review)
    builder.add_node("execute", execute)
    builder.add_edge(START, "plan")
    builder.add_edge("plan", "review")
    builder.add_conditional_edges(
        "review", lambda s: "execute" if s["approved"] else "plan", ["execute", "plan"]
    )
    builder.add_edge("execute", END)
    return builder.compile(checkpointer=InMemorySaver())


def main(
    backend: TransformersBackend | None = None,
    turns: int = len(VERDICTS),
    *,
    device_tokens: int | None = None,
    max_new_tokens: int = 48,
    thread_id: str = "plan-confirm",
) -> dict[str, Any]:
    """Run: ask for a plan, answer the interrupts with the scripted verdicts; return what happened.

    Args:
        backend: The model's backend; None = the default model.
        turns: How many verdicts to give (the last one given is an approval).
        device_tokens: A per-session device KV budget in tokens (None = no budget).
        max_new_tokens: Length limit of each answer.
        thread_id: The LangGraph thread (one agentkv session).

    Returns:
        `plans` (message ids, in order), `verdicts`, `reviews` (ids of the plans the review
        node ran for: a resume re-runs it), `states` (plan id → state, tier, pinned), `events`,
        `spans`, `log` (the session's event records) and `stats`.
    """
    backend = backend or shared_backend()
    llm = ChatAgentKV(backend=backend, max_new_tokens=max_new_tokens)
    config = backend.config
    if device_tokens is not None:
        config = config.with_overrides({"budget": {"device_tokens": device_tokens}})
    reviews: list[str] = []
    graph = with_kv_lifecycle(build_graph(llm, reviews), backend=backend, config=config)
    run_config: RunnableConfig = {"configurable": {"thread_id": thread_id}}
    verdicts = [*VERDICTS[: max(0, turns - 1)], "approve"] if turns > 0 else []
    graph.invoke({"messages": [HumanMessage(TASK)]}, run_config)
    plans = [str(graph.get_state(run_config).values["plan_id"])]
    for verdict in verdicts:
        graph.invoke(Command(resume=verdict), run_config)
        state = graph.get_state(run_config)
        if state.next:  # paused again, at a new plan
            plans.append(str(state.values["plan_id"]))
    session = backend.get(thread_id)
    snapshot = session.snapshot()
    states = {}
    for plan_id in plans:
        span = next(s for s in session.spans if s.owner == plan_id)
        states[plan_id] = {"state": span.state.value, "tier": span.tier.value, "pinned": span.pinned}
    final = graph.get_state(run_config).values["messages"][-1]
    return {
        "plans": plans,
        "verdicts": verdicts,
        "reviews": reviews,
        "states": states,
        "answer": final.content if isinstance(final, AIMessage) else None,
        "events": [
            (sid, type(e).__name__, getattr(e, "owner", None)) for sid, e in graph.agentkv.handler.events
        ],
        "spans": [
            {k: s[k] for k in ("span_id", "kind", "owner", "state", "tier", "tokens")}
            for s in snapshot["spans"]
        ],
        "log": [{"kind": r.kind, **r.detail} for r in session.log],
        "stats": snapshot["stats"],
        "handler_errors": graph.agentkv.handler.errors,
    }


if __name__ == "__main__":
    result = main()
    for plan_id, verdict in zip(result["plans"], result["verdicts"], strict=False):
        state = result["states"][plan_id]
        print(f"plan {plan_id[-12:]}: verdict {verdict!r} -> {state['state']}, pinned={state['pinned']}")
    print(
        f"review node ran {len(result['reviews'])} times for {len(result['plans'])} plans "
        "(a resume re-runs it)"
    )
    print("events:", [(name, str(owner)[-12:] if owner else None) for _, name, owner in result["events"]])
    print("final answer:", (result["answer"] or "")[:200])
