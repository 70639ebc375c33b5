"""One session, two runners: the engine backend shares the local backend's session table and core.

`EngineBackend` and `TransformersBackend` are one `SessionRegistry` (lookup errors,
forks with their own config, the `agentkv.sessions` bounds) and their sessions one
`SessionCore` (bind, pin, release, stats): a fix to either is made once. Checked on the
engine side against the simulated LMCache, and both against the one public protocol.
"""

from __future__ import annotations

from typing import Any

import pytest

from agentkv import AgentBackend, AgentSession, TransformersBackend, UnknownSessionError
from agentkv.spans import SpanKind
from tests.unit.test_engine_store import SimLMCache, make_backend

HISTORY: list[dict[str, Any]] = [
    {"role": "system", "content": "You are a rail assistant. " * 4},
    {"role": "user", "content": "Zurich to Vienna tonight?"},
]


@pytest.fixture
def sim() -> SimLMCache:
    return SimLMCache()


def test_both_backends_and_their_sessions_are_the_one_protocol(
    sim: SimLMCache, tiny_model: Any, tiny_tokenizer: Any
) -> None:
    engine = make_backend(sim, tiny_tokenizer)
    local = TransformersBackend(tiny_model, tiny_tokenizer)
    for backend in (engine, local):
        assert isinstance(backend, AgentBackend)
        assert isinstance(backend.session("t1"), AgentSession)
    assert not isinstance(object(), AgentBackend)
    assert not isinstance(engine, AgentSession)


def test_an_unknown_engine_session_is_the_shared_error_naming_the_known_ones(
    sim: SimLMCache, tiny_tokenizer: Any
) -> None:
    backend = make_backend(sim, tiny_tokenizer)
    backend.session("t1")
    with pytest.raises(UnknownSessionError, match="unknown session 'nope'; known sessions: t1"):
        backend.get("nope")
    with pytest.raises(UnknownSessionError):
        backend.close("nope")
    assert backend.apply("nope", _turn_ended()) is None and backend.noop_events == 1


def test_an_engine_branch_takes_its_own_config_or_its_parents(sim: SimLMCache, tiny_tokenizer: Any) -> None:
    backend = make_backend(sim, tiny_tokenizer)
    thread = backend.session("t1")
    thread.extend(HISTORY)
    own = backend.config.model_copy()
    assert thread.fork("a").config is thread.config
    branch = thread.fork("b", config=own)
    assert branch.config is own and branch.cache_salt == thread.cache_salt
    assert [s.session_id for s in backend.sessions()] == ["t1", "t1/a", "t1/b"]


def test_engine_sessions_end_under_the_shared_bounds_and_leave_nothing_on_lmcache(
    sim: SimLMCache, tiny_tokenizer: Any
) -> None:
    backend = make_backend(sim, tiny_tokenizer, sessions={"max_live": 1})
    first = backend.session("t1")
    first.extend(HISTORY)
    first.generate(4)
    written = first.store.prompt() + [9, 9]
    salt = first.cache_salt
    assert any(sim.held(written, salt))
    second = backend.session("t2")  # over max_live: the least recently used thread ends
    assert first.closed and not second.closed and backend.ended_sessions == 1
    assert "t1" not in backend and not any(sim.held(written, salt))
    assert sim.pins == {}


def test_an_engine_answer_bound_to_its_tool_call_message_is_matched_on_the_next_extend(
    sim: SimLMCache, tiny_tokenizer: Any
) -> None:
    backend = make_backend(sim, tiny_tokenizer)
    session = backend.session("t1")
    session.extend(HISTORY)
    session.generate(4)
    call = {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "name": "timetable", "args": {}}]}
    session.bind_message(call)
    answer = session.spans[-1]
    assert answer.kind is SpanKind.TOOL_CALL and session.messages[-1].tool_calls
    stats = session.stats()
    assert stats.generated_tokens == 2 and stats.logical_tokens == session.table.logical_length
    result = {"role": "tool", "content": "Nightjet 466 at 21:40.", "tool_call_id": "c1"}
    extended = session.extend([*HISTORY, call, result])
    assert extended.cropped_tokens == 0 and extended.first_changed_message is None
    assert session.spans[-2] is answer


def _turn_ended() -> Any:
    from agentkv import TurnEnded

    return TurnEnded()
