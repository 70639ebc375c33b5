"""One outcome decision (completed, failed, interrupted, replayed), shared by handler and middleware."""

from __future__ import annotations

import uuid
from types import SimpleNamespace
from typing import Any

import pytest
from langchain_core.messages import ToolMessage
from langgraph.errors import GraphInterrupt
from langgraph.types import Command

from agentkv import AgentKVConfig, ToolCallCompleted, ToolCallFailed, TransformersBackend, UserConfirmed
from agentkv_langchain.callbacks import KVLifecycleCallbackHandler
from agentkv_langchain.middleware import AgentKVMiddleware
from agentkv_langchain.outcomes import Outcome, after_run, decide, tool_event
from agentkv_langchain.replays import GraphTasks

OK = ToolMessage("sunny", tool_call_id="c1")
ERROR = ToolMessage("boom", tool_call_id="c1", status="error")


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({}, Outcome.COMPLETED),
        ({"output": {"messages": []}}, Outcome.COMPLETED),
        ({"output": {"__interrupt__": ()}}, Outcome.INTERRUPTED),
        ({"error": GraphInterrupt()}, Outcome.INTERRUPTED),
        ({"error": ValueError("x")}, Outcome.FAILED),
        ({"result": OK}, Outcome.COMPLETED),
        ({"result": ERROR}, Outcome.FAILED),
        # An interrupt seen inside the unit wins over what it returned or raised.
        ({"error": ValueError("x"), "interrupted": True}, Outcome.INTERRUPTED),
        ({"result": ERROR, "interrupted": True}, Outcome.INTERRUPTED),
        ({"output": {"messages": []}, "interrupted": True}, Outcome.INTERRUPTED),
    ],
)
def test_decide(kwargs: dict[str, Any], expected: Outcome) -> None:
    assert decide(**kwargs) is expected


def test_a_control_flow_exception_is_recognised_by_its_class_names() -> None:
    class NodeInterrupt(Exception):  # LangGraph is optional: matched by name along the MRO
        pass

    class Mine(NodeInterrupt):
        pass

    assert decide(error=Mine()) is Outcome.INTERRUPTED
    assert decide(error=RuntimeError()) is Outcome.FAILED


@pytest.mark.parametrize(
    ("task", "run", "expected"),
    [
        (Outcome.INTERRUPTED, Outcome.INTERRUPTED, Outcome.REPLAYED),
        (Outcome.INTERRUPTED, Outcome.COMPLETED, None),
        (Outcome.INTERRUPTED, Outcome.FAILED, None),
        (None, Outcome.INTERRUPTED, None),  # another task paused the run: this one is done
        (Outcome.REPLAYED, Outcome.INTERRUPTED, None),  # replayed without pausing again
        (Outcome.REPLAYED, Outcome.COMPLETED, None),
    ],
)
def test_after_run(task: Outcome | None, run: Outcome, expected: Outcome | None) -> None:
    assert after_run(task, run) is expected


@pytest.mark.parametrize(
    ("output", "error", "expected"),
    [
        (OK, None, ToolCallCompleted(tool_call_id="c1")),
        ("a bare string", None, ToolCallCompleted(tool_call_id="c1")),
        (ERROR, None, ToolCallFailed(tool_call_id="c1", error="boom")),
        (Command(update={"messages": [ERROR]}), None, ToolCallFailed(tool_call_id="c1", error="boom")),
        # Another call's error in the same update is not this call's outcome.
        (
            Command(update={"messages": [ToolMessage("x", tool_call_id="c2", status="error")]}),
            None,
            ToolCallCompleted(tool_call_id="c1"),
        ),
        (None, ValueError("bad"), ToolCallFailed(tool_call_id="c1", error="ValueError('bad')")),
        (None, GraphInterrupt(), None),
    ],
)
def test_tool_event(output: Any, error: BaseException | None, expected: Any) -> None:
    assert tool_event("c1", output, error) == expected


# -- the handler and the middleware decide alike ----------------------------------------------------


@pytest.fixture()
def backend(tiny_model, tiny_tokenizer) -> TransformersBackend:
    return TransformersBackend(tiny_model, tiny_tokenizer, AgentKVConfig())


def _middleware_events(backend: TransformersBackend, output: Any, error: BaseException | None) -> list[Any]:
    kv = AgentKVMiddleware(backend)
    request = SimpleNamespace(
        runtime=SimpleNamespace(config={"configurable": {"thread_id": "t"}}),
        tool_call={"id": "c1", "name": "weather", "args": {}},
    )

    def tool(_: Any) -> Any:
        if error is not None:
            raise error
        return output

    try:
        kv.wrap_tool_call(request, tool)  # type: ignore[arg-type]
    except Exception as e:  # the middleware re-raises what the tool raised
        assert e is error
    kv.handler.flush()
    return kv.handler.events


def _handler_events(backend: TransformersBackend, output: Any, error: BaseException | None) -> list[Any]:
    handler = KVLifecycleCallbackHandler(backend, raise_error=True)
    run = uuid.uuid4()
    handler.on_tool_start({}, "", run_id=run, metadata={"thread_id": "t"}, tool_call_id="c1")
    if error is not None:
        handler.on_tool_error(error, run_id=run)
    else:
        handler.on_tool_end(output, run_id=run)
    handler.flush()
    return handler.events


@pytest.mark.parametrize(
    ("output", "error", "expected"),
    [
        (OK, None, [("t", ToolCallCompleted(tool_call_id="c1"))]),
        (ERROR, None, [("t", ToolCallFailed(tool_call_id="c1", error="boom"))]),
        (Command(update={"messages": [OK]}), None, [("t", ToolCallCompleted(tool_call_id="c1"))]),
        (None, ValueError("bad"), [("t", ToolCallFailed(tool_call_id="c1", error="ValueError('bad')"))]),
        # A tool paused by `interrupt()` runs again on resume: no outcome yet, from either.
        (None, GraphInterrupt(), []),
    ],
    ids=["completed", "error-message", "command", "raised", "interrupted"],
)
def test_the_handler_and_the_middleware_send_the_same_outcome(
    backend: TransformersBackend, output: Any, error: BaseException | None, expected: list[Any]
) -> None:
    assert _handler_events(backend, output, error) == expected
    assert _middleware_events(backend, output, error) == expected


# -- graph tasks: an interrupted task is replayed ----------------------------------------------------


def test_a_decision_about_an_interrupted_answer_lands_on_the_replayed_one() -> None:
    tasks = GraphTasks()
    assert tasks.answered("s", "node:1", "first") == []
    tasks.paused("s", "node:1")
    assert tasks.finish("s", Outcome.INTERRUPTED) == []  # the task waits to be replayed
    assert len(tasks) == 1
    assert tasks.resumed("s", [UserConfirmed(owner="first")]) == []  # held for the re-run
    assert tasks.answered("s", "node:1", "second") == [UserConfirmed(owner="second")]
    assert tasks.finish("s", Outcome.COMPLETED) == []
    assert len(tasks) == 0


def test_a_decision_whose_answer_never_comes_back_goes_to_the_first_one() -> None:
    tasks = GraphTasks()
    tasks.answered("s", "node:1", "first")
    tasks.paused("s", "node:1")
    tasks.finish("s", Outcome.INTERRUPTED)
    assert tasks.resumed("s", [UserConfirmed(owner=None)]) == []  # "the latest answer": the paused one
    assert tasks.finish("s", Outcome.FAILED) == [UserConfirmed(owner="first")]
    assert len(tasks) == 0


def test_a_decision_about_no_interrupted_answer_is_applied_at_once() -> None:
    tasks = GraphTasks()
    tasks.answered("s", "plan:1", "plan")  # the plan → review layout: the plan's task never paused
    assert tasks.resumed("s", [UserConfirmed(owner="plan")]) == [UserConfirmed(owner="plan")]
