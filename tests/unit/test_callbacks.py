"""KVLifecycleCallbackHandler with real LangChain runs: tools, custom events, errors, threads, resumes."""

from __future__ import annotations

import logging
import threading
import uuid
from typing import Any, TypedDict

import pytest
from langchain_core.messages import AIMessage, HumanMessage
from langchain_core.outputs import ChatGeneration, LLMResult
from langchain_core.runnables import RunnableConfig, RunnableLambda
from langchain_core.tools import ToolException, tool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph
from langgraph.types import Command, interrupt

from agentkv import (
    AgentKVConfig,
    BranchPruned,
    BranchSelected,
    Custom,
    SpanState,
    ToolCallCompleted,
    ToolCallFailed,
    TransformersBackend,
    TurnEnded,
    UserConfirmed,
    UserRejected,
)
from agentkv_langchain import ChatAgentKV
from agentkv_langchain.callbacks import OWNER_KEY, KVLifecycleCallbackHandler, resume_decision
from agentkv_langchain.helpers import confirm, kv_event, pin, prune_branch, reject, select_branch, send_event

HISTORY = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": "call_1", "name": "weather", "args": {"city": "Paris"}}],
    },
    {"role": "tool", "content": "search results: sunny skies in Paris", "tool_call_id": "call_1"},
    {"role": "assistant", "content": "It is sunny.", "id": "answer-1"},
]


@pytest.fixture()
def backend(tiny_model, tiny_tokenizer) -> TransformersBackend:
    return TransformersBackend(tiny_model, tiny_tokenizer, AgentKVConfig())


@pytest.fixture()
def handler(backend) -> KVLifecycleCallbackHandler:
    return KVLifecycleCallbackHandler(backend)


def run_config(handler: KVLifecycleCallbackHandler, thread: str = "t", **metadata: Any) -> RunnableConfig:
    return {"callbacks": [handler], "metadata": {"thread_id": thread, **metadata}}


@tool
def weather(city: str) -> str:
    """Weather report for a city."""
    return f"sunny in {city}"


@tool
def broken(city: str) -> str:
    """Always raises."""
    msg = f"no data for {city}"
    raise ValueError(msg)


@tool
def flaky(city: str) -> str:
    """Raises a ToolException, which LangChain turns into an error ToolMessage."""
    msg = f"service down for {city}"
    raise ToolException(msg)


flaky.handle_tool_error = True


def call(name: str, call_id: str) -> dict[str, Any]:
    return {"name": name, "args": {"city": "Paris"}, "id": call_id, "type": "tool_call"}


def names(handler: KVLifecycleCallbackHandler) -> list[tuple[str, str]]:
    return [(sid, type(e).__name__) for sid, e in handler.events]


# -- tools and turns ---------------------------------------------------------------------------


def test_tool_end_commits_result_and_releases_call(backend, handler):
    session = backend.session("t")
    session.extend(HISTORY)

    def turn(_: Any) -> str:
        return weather.invoke(call("weather", "call_1")).content

    RunnableLambda(turn).invoke(None, run_config(handler))
    assert handler.events == [("t", ToolCallCompleted(tool_call_id="call_1")), ("t", TurnEnded())]
    result = next(s for s in session.spans if s.owner == "call_1")
    call_span = next(s for s in session.spans if s.kind.value == "tool_call")
    assert result.state is SpanState.COMMITTED
    assert call_span.state is SpanState.EVICTABLE
    assert handler.errors == 0


def test_tool_outcome_waits_for_the_next_model_call_of_the_session(backend, handler):
    """The result span exists only once the model has read the ToolMessage."""
    backend.session("t").extend(HISTORY[:3])
    root = uuid.uuid4()
    handler.on_chain_start({}, {}, run_id=root, metadata={"thread_id": "t"})
    tool_run = uuid.uuid4()
    handler.on_tool_start({}, "", run_id=tool_run, parent_run_id=root, tool_call_id="call_1")
    handler.on_tool_end("sunny", run_id=tool_run, parent_run_id=root)  # not a ToolMessage: id from the start
    assert handler.events == []
    backend.session("t").extend(HISTORY[:4])  # the model call encodes the result...
    llm_run = uuid.uuid4()
    handler.on_chat_model_start({}, [[]], run_id=llm_run, parent_run_id=root)
    handler.on_llm_end(LLMResult(generations=[[ChatGeneration(message=AIMessage("ok"))]]), run_id=llm_run)
    assert handler.events == [("t", ToolCallCompleted(tool_call_id="call_1"))]  # ...and then it is sent
    result = next(s for s in backend.get("t").spans if s.owner == "call_1")
    assert result.state is SpanState.COMMITTED


def test_raised_tool_error_is_a_failure_whose_output_is_kept(backend, handler):
    session = backend.session("t")
    session.extend(HISTORY)

    def turn(_: Any) -> str:
        with pytest.raises(ValueError, match="no data"):
            broken.invoke(call("broken", "call_1"))
        return "done"

    RunnableLambda(turn).invoke(None, run_config(handler))
    (sid, event), ended = handler.events
    assert sid == "t" and isinstance(event, ToolCallFailed) and event.tool_call_id == "call_1"
    assert "no data" in event.error
    assert ended == ("t", TurnEnded())
    result = next(s for s in session.spans if s.owner == "call_1")
    assert result.state is SpanState.COMMITTED  # the error text is an observation; the call is released


def test_error_tool_message_is_a_failure(backend, handler):
    def turn(_: Any) -> str:
        message = flaky.invoke(call("flaky", "call_9"))
        assert message.status == "error"
        return str(message.content)

    RunnableLambda(turn).invoke(None, run_config(handler))
    assert isinstance(handler.events[0][1], ToolCallFailed)
    assert handler.events[0][1].tool_call_id == "call_9"


def test_tool_without_call_id_sends_nothing(handler):
    RunnableLambda(lambda _: weather.invoke({"city": "Paris"})).invoke(None, run_config(handler))
    assert names(handler) == [("t", "TurnEnded")]


def test_only_the_top_level_run_ends_the_turn(handler):
    inner = RunnableLambda(lambda x: x + 1)
    outer = RunnableLambda(lambda x: inner.invoke(inner.invoke(x)))
    assert outer.invoke(1, run_config(handler)) == 3
    assert names(handler) == [("t", "TurnEnded")]


def test_an_lcel_chain_given_its_thread_in_configurable_ends_that_threads_turn(backend, handler):
    """The chain's root callback runs before its config is current: a step names the thread."""
    chain = RunnableLambda(lambda _: [HumanMessage("Hi")]) | ChatAgentKV(backend=backend, max_new_tokens=2)
    chain.invoke(None, {"callbacks": [handler], "configurable": {"thread_id": "lcel"}})
    assert names(handler) == [("lcel", "TurnEnded")]
    stats = backend.get("lcel").stats()
    assert stats.events_applied == 1 and stats.tokens_by_state["active"] == 0
    assert [s.session_id for s in backend.sessions()] == ["lcel"]


def test_children_inherit_the_thread_of_their_parent(handler):
    """End events carry no metadata: the context comes from the start, through parent_run_id."""
    root, child = uuid.uuid4(), uuid.uuid4()
    handler.on_chain_start({}, {}, run_id=root, metadata={"thread_id": "t7", "agentkv_branch": "b1"})
    handler.on_tool_start({}, "", run_id=child, parent_run_id=root, metadata={}, tool_call_id="c1")
    handler.on_tool_end("x", run_id=child, parent_run_id=root)
    handler.on_chain_end({}, run_id=root)
    assert handler.events == [
        ("t7", handler.events[0][1]),  # BranchOpened on the parent session
        ("t7/b1", ToolCallCompleted(tool_call_id="c1")),
        ("t7/b1", TurnEnded()),
    ]
    assert handler._runs == {}  # nothing kept after the run


# -- custom events -------------------------------------------------------------------------------


def test_helpers_dispatch_the_matching_events(backend, handler):
    backend.session("t").extend(HISTORY)

    def node(_: Any) -> None:
        confirm("answer-1")
        reject()
        pin("answer-1")
        pin("answer-1")  # a re-run node pins again: one lease
        kv_event("plan_approved", owner="answer-1", payload={"why": "ok"})
        send_event(ToolCallFailed(tool_call_id="call_1", error="late"))

    RunnableLambda(node).invoke(None, run_config(handler))
    events = [e for _, e in handler.events]
    assert events[:2] == [UserConfirmed(owner="answer-1"), UserRejected(owner=None)]
    assert events[2] == Custom(event="pin", owner="answer-1")
    assert events[3] == Custom(event="plan_approved", owner="answer-1")
    assert events[3].payload == {"why": "ok"}
    assert events[4] == ToolCallFailed(tool_call_id="call_1", error="late")
    assert events[5] == TurnEnded()
    assert len(handler.leases) == 1
    answer = next(s for s in backend.get("t").spans if s.owner == "answer-1")
    assert answer.pinned
    assert handler.release("t", "answer-1")
    assert handler.release("t", "answer-1") is False


def test_branch_events_go_to_the_parent_session(backend, handler):
    parent = backend.session("t")
    parent.extend(HISTORY)
    for b in ("b1", "b2", "b3"):
        backend.fork("t", b).extend([*HISTORY, {"role": "user", "content": f"idea {b}"}])

    def judge(_: Any) -> None:
        prune_branch("b1")
        select_branch("b2")

    RunnableLambda(judge).invoke(None, run_config(handler, agentkv_branch="b3"))
    assert ("t", BranchPruned(branch="b1")) in handler.events
    assert ("t", BranchSelected(branch="b2")) in handler.events
    assert sorted(s.session_id for s in backend.sessions()) == ["t", "t/b2"]


def test_helpers_outside_a_run_say_so():
    with pytest.raises(RuntimeError, match="inside a LangChain/LangGraph run"):
        confirm()


def test_foreign_custom_events_are_ignored(handler):
    from langchain_core.callbacks import dispatch_custom_event

    RunnableLambda(lambda _: dispatch_custom_event("someone.else", {"x": 1})).invoke(
        None, run_config(handler)
    )
    assert names(handler) == [("t", "TurnEnded")]


# -- errors ----------------------------------------------------------------------------------------


class Exploding(TransformersBackend):
    def apply(self, session_id: str, event: Any) -> Any:
        msg = "backend exploded"
        raise RuntimeError(msg)


def test_handler_never_raises_by_default(tiny_model, tiny_tokenizer, caplog):
    handler = KVLifecycleCallbackHandler(Exploding(tiny_model, tiny_tokenizer))
    assert handler.raise_error is False
    with caplog.at_level(logging.WARNING, logger="agentkv.callbacks"):
        out = RunnableLambda(lambda _: weather.invoke(call("weather", "c1")).content).invoke(
            None, run_config(handler)
        )
    assert out == "sunny in Paris"
    assert handler.errors == 2  # the tool outcome and the turn end
    assert any("backend exploded" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("source", ["argument", "config"])
def test_raise_error_lets_errors_through(tiny_model, tiny_tokenizer, source):
    if source == "argument":
        handler = KVLifecycleCallbackHandler(Exploding(tiny_model, tiny_tokenizer), raise_error=True)
    else:
        config = AgentKVConfig.from_dict({"callbacks": {"raise_error": True}})
        handler = KVLifecycleCallbackHandler(Exploding(tiny_model, tiny_tokenizer, config))
    assert handler.raise_error is True
    with pytest.raises(RuntimeError, match="backend exploded"):
        RunnableLambda(lambda _: 1).invoke(None, run_config(handler))
    assert handler.errors == 1


def test_bad_custom_event_data_is_counted_not_raised(handler):
    from langchain_core.callbacks import dispatch_custom_event

    RunnableLambda(lambda _: dispatch_custom_event("agentkv.prune_branch", {"branch": ""})).invoke(
        None, run_config(handler)
    )
    assert handler.errors == 1
    assert names(handler) == [("t", "TurnEnded")]


# -- threads -----------------------------------------------------------------------------------------


def test_parallel_runs_from_worker_threads(handler):
    n_threads, per_thread = 8, 50
    barrier = threading.Barrier(n_threads)

    def worker(w: int) -> None:
        barrier.wait()
        for i in range(per_thread):
            root, child = uuid.uuid4(), uuid.uuid4()
            handler.on_chain_start(
                {}, {}, run_id=root, metadata={"thread_id": f"t{w}", "agentkv_branch": "b"}
            )
            handler.on_tool_start({}, "", run_id=child, parent_run_id=root, tool_call_id=f"c{w}-{i}")
            handler.on_tool_end("x", run_id=child, parent_run_id=root)
            handler.on_chain_end({}, run_id=root)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert handler.errors == 0
    completed = [(sid, e.tool_call_id) for sid, e in handler.events if isinstance(e, ToolCallCompleted)]
    assert len(completed) == n_threads * per_thread
    assert all(sid == f"t{cid.split('-')[0][1:]}/b" for sid, cid in completed)
    assert sum(isinstance(e, TurnEnded) for _, e in handler.events) == n_threads * per_thread
    assert handler._runs == {} and handler._pending == {}


# -- interrupts and human decisions ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (True, "confirm"),
        (False, "reject"),
        ("approve", "confirm"),
        (" Yes ", "confirm"),
        ("accept", "confirm"),
        ("edit", "confirm"),
        ("respond", "confirm"),
        ("reject", "reject"),
        ("no", "reject"),
        ({"type": "approve"}, "confirm"),
        ({"type": "accept"}, "confirm"),
        ({"type": "edit", "edited_action": {"name": "x", "args": {}}}, "confirm"),
        ({"type": "respond", "message": "use 3"}, "confirm"),
        ({"type": "reject", "message": "no"}, "reject"),
        ({"approved": False}, "reject"),
        ({"decision": "approved"}, "confirm"),
        ("maybe later", None),
        (None, None),
        (42, None),
    ],
)
def test_resume_decision(value, expected):
    assert resume_decision(value) == expected


class PlanState(TypedDict):
    plan: str
    verdict: Any


def review_graph() -> Any:
    def review(state: PlanState) -> dict[str, Any]:
        return {"verdict": interrupt({"plan": state["plan"], OWNER_KEY: "plan-1"})}

    builder = StateGraph(PlanState)
    builder.add_node("review", review)
    builder.add_edge(START, "review")
    builder.add_edge("review", END)
    return builder.compile(checkpointer=InMemorySaver())


@pytest.mark.parametrize(
    ("verdict", "event"), [("approve", UserConfirmed), ({"type": "reject"}, UserRejected)]
)
def test_interrupt_then_resume_sends_the_decision(handler, verdict, event):
    graph = review_graph()
    config: RunnableConfig = {"configurable": {"thread_id": "g"}, "callbacks": [handler]}
    graph.invoke({"plan": "1. go", "verdict": None}, config)
    assert handler.events == []  # paused: the turn is not over
    graph.invoke(Command(resume=verdict), config)
    assert handler.events == [("g", event(owner="plan-1")), ("g", TurnEnded())]
    assert handler._interrupts == {"g": {}}


def test_hitl_decisions_name_the_message_that_made_the_calls(handler):
    """A HumanInTheLoopMiddleware request lists name + args; decisions map back to the AIMessage."""
    root, llm_run = uuid.uuid4(), uuid.uuid4()
    handler.on_chain_start({}, {}, run_id=root, metadata={"thread_id": "h"})
    message = AIMessage(
        "",
        id="ai-7",
        tool_calls=[
            {"name": "delete", "args": {"path": "/a"}, "id": "c1"},
            {"name": "delete", "args": {"path": "/b"}, "id": "c2"},
        ],
    )
    handler.on_chat_model_start({}, [[]], run_id=llm_run, parent_run_id=root)
    handler.on_llm_end(LLMResult(generations=[[ChatGeneration(message=message)]]), run_id=llm_run)
    request = {
        "action_requests": [
            {"name": "delete", "args": {"path": "/b"}},
            {"name": "delete", "args": {"path": "/a"}},
        ],
        "review_configs": [],
    }
    interrupt_event = type(
        "E", (), {"run_id": root, "interrupts": (type("I", (), {"id": "i1", "value": request}),)}
    )
    handler.on_interrupt(interrupt_event)
    handler.on_chain_end({"__interrupt__": []}, run_id=root)
    assert handler.events == []

    resumed = uuid.uuid4()
    decisions = {"decisions": [{"type": "reject"}, {"type": "reject", "message": "no"}]}
    handler.on_chain_start({}, Command(resume=decisions), run_id=resumed, metadata={"thread_id": "h"})
    handler.on_resume(type("R", (), {"run_id": resumed})())
    assert handler.events == [("h", UserRejected(owner="ai-7"))]
    handler.on_chain_end({}, run_id=resumed)

    # per-call mode: one approval request per call, answered by interrupt id
    again = uuid.uuid4()
    handler.on_chain_start({}, {}, run_id=again, metadata={"thread_id": "h"})
    value = {"type": "tool_approval", "tool_call_id": "c2", "name": "delete", "args": {"path": "/b"}}
    handler.on_interrupt(
        type("E", (), {"run_id": again, "interrupts": (type("I", (), {"id": "i2", "value": value}),)})
    )
    handler.on_chain_end({}, run_id=again)
    last = uuid.uuid4()
    handler.on_chain_start(
        {}, Command(resume={"i2": {"type": "approve"}}), run_id=last, metadata={"thread_id": "h"}
    )
    handler.on_resume(type("R", (), {"run_id": last})())
    assert handler.events[-1] == ("h", UserConfirmed(owner="ai-7"))
    assert handler.errors == 0


# -- a long-lived handler ----------------------------------------------------------------------


def test_a_long_lived_handler_keeps_the_last_events_and_no_closed_session(backend):
    """Runs on many threads: the log holds the last `event_log` events; closed threads leave no record."""
    config = AgentKVConfig.from_dict({"callbacks": {"event_log": 5}})
    handler = KVLifecycleCallbackHandler(backend, config=config)
    for n in range(4):
        thread = f"t{n}"
        backend.session(thread).extend(HISTORY)
        RunnableLambda(lambda _: weather.invoke(call("weather", "call_1")).content).invoke(
            None, run_config(handler, thread)
        )
        assert thread in handler.book.sessions  # its latest calls and failures, while the session lives
        backend.close(thread)
    assert len(handler.events) == 5
    assert handler.events[-2:] == [("t3", ToolCallCompleted(tool_call_id="call_1")), ("t3", TurnEnded())]
    RunnableLambda(lambda _: "no tool").invoke(None, run_config(handler, "t3"))
    assert set(handler.book.sessions) == set() and set(handler.book.threads) == set()
