"""An event is validated once, where it enters a session, before anything changes."""

from __future__ import annotations

from typing import Any

import pytest

import agentkv.events
from agentkv import AgentKVConfig, ToolCallCompleted, TransformersBackend, TurnEnded

HISTORY = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the weather in Paris?"},
]


@pytest.fixture()
def backend(tiny_model, tiny_tokenizer) -> TransformersBackend:
    return TransformersBackend(tiny_model, tiny_tokenizer, AgentKVConfig())


@pytest.fixture()
def checks(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every event `validate_event` sees, wherever it is called from."""
    seen: list[Any] = []
    validate = agentkv.events.validate_event

    def counting(event: object) -> None:
        seen.append(event)
        validate(event)

    for module in ("agentkv.backend.registry", "agentkv.backend.session_core", "agentkv.backend.session"):
        monkeypatch.setattr(f"{module}.validate_event", counting)
    return seen


def test_backend_apply_validates_an_event_once(backend: TransformersBackend, checks: list[Any]) -> None:
    backend.session("t").extend(HISTORY)
    event = TurnEnded()
    backend.apply("t", event)
    backend.apply("nowhere", event)  # an unknown session: a no-op, still checked
    assert checks == [event, event]


def test_extend_validates_its_events_once(backend: TransformersBackend, checks: list[Any]) -> None:
    event = ToolCallCompleted(tool_call_id="c1")
    backend.session("t").extend(HISTORY, events=[event])
    assert checks == [event]


def test_a_malformed_event_leaves_extend_without_effect(backend: TransformersBackend) -> None:
    session = backend.session("t")
    session.extend(HISTORY[:1])
    before = (len(session.messages), session.logical_length)
    with pytest.raises(TypeError, match="expected an agentkv Event"):
        session.extend(HISTORY, events=["turn_ended"])  # type: ignore[list-item]
    assert (len(session.messages), session.logical_length) == before  # nothing was encoded


def test_a_live_session_refuses_a_malformed_event(backend: TransformersBackend) -> None:
    backend.session("t").extend(HISTORY)
    with pytest.raises(TypeError, match="ToolCallCompleted.tool_call_id: expected str"):
        backend.apply("t", ToolCallCompleted(tool_call_id=3))  # type: ignore[arg-type]
