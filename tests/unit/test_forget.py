"""The agent decides what to forget: parsing, guard rails, the side thread, the boundary, rehydration."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from agentkv import AgentKVConfig, ToolCallCompleted, TransformersBackend, TurnEnded
from agentkv.forget import (
    SIDE_THREAD_BRANCH,
    ForgetRequested,
    ToolOutputForgotten,
    cites,
    parse_forget_answer,
    side_thread_opening,
)
from agentkv.spans import SpanState, Tier
from agentkv.toolformats import FORMATS

TOL = 1e-4

RESULTS = [
    "search results: the weather in Paris is sunny skies, lorem ipsum dolor sit amet",
    "The secret code is 4417. lorem ipsum dolor sit amet consectetur",
    "search results: adipiscing elit tracking number ZX-99 lorem ipsum",
]


def tool_turn(history: list[dict[str, Any]], turn: int, result: str, answer: str) -> list[str]:
    """Append one user turn with one tool call and its result; return the call ids."""
    call_id = f"call-{turn}"
    user = f"turn {turn}: the user asked about the weather"
    history.append({"role": "user", "content": user, "id": f"u{turn}"})
    history.append(
        {
            "role": "assistant",
            "content": "",
            "id": f"a{turn}-call",
            "tool_calls": [{"id": call_id, "name": "search", "args": {"q": f"q{turn}"}}],
        }
    )
    history.append({"role": "tool", "content": result, "tool_call_id": call_id})
    history.append({"role": "assistant", "content": answer, "id": f"a{turn}"})
    return [call_id]


def replay(session: Any, turns: int, *, answers: list[str] | None = None) -> list[dict[str, Any]]:
    """Replay `turns` tool turns the way an agent framework does (events included)."""
    history: list[dict[str, Any]] = [{"role": "system", "content": "You are a helpful assistant."}]
    for t in range(1, turns + 1):
        answer = (answers or [])[t - 1] if answers and t <= len(answers) else "the tool returned sunny skies"
        tool_turn(history, t, RESULTS[(t - 1) % len(RESULTS)], answer)
        session.extend(history[:-1])
        session.apply(ToolCallCompleted(tool_call_id=f"call-{t}"))
        session.extend(history)
        session.apply(TurnEnded())
    return history


def backend_with(tiny_model: Any, tiny_tokenizer: Any, **forget: Any) -> TransformersBackend:
    return TransformersBackend(tiny_model, tiny_tokenizer, AgentKVConfig.from_dict({"forget": forget}))


def result_span(session: Any, call_id: str) -> Any:
    return next(s for s in session.spans if s.owner == call_id and s.kind.value == "tool_result")


# -- parsing ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "handles"),
    [
        ('"T1", "T3"]}}</tool_call>', ("T1", "T3")),
        ("]", ()),
        ('"t2"]', ("T2",)),
        ('"T1", "T1"]', ("T1",)),
        (' "T3" ]', ("T3",)),
        ("T1, t3]}}", ("T1", "T3")),  # bare handles, as the 135M model writes them
    ],
)
def test_well_formed_answers_name_offered_handles(text, handles):
    assert parse_forget_answer(text, ["T1", "T2", "T3"]) == (handles, None)


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ('"T1", "T2"', "no closing ]"),
        ('"T1, T2"]', "not a list of handles"),
        ("T1 and T2]", "not one of the offered handles"),
        ('"T9"]', "not one of the offered handles"),
        ('"T1", 3]', "not one of the offered handles"),
        ('"Paris"]', "not one of the offered handles"),
        ('"T1",, "T2"]', "not a list of handles"),
    ],
)
def test_malformed_answers_name_nothing(text, why):
    handles, error = parse_forget_answer(text, ["T1", "T2", "T3"])
    assert handles == ()
    assert error is not None and why in error


def test_the_side_thread_opening_is_a_forced_call_up_to_the_handle_list():
    assert side_thread_opening() == '<tool_call>{"name": "forget_tool_outputs", "arguments": {"handles": ['


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_the_side_thread_opens_its_call_in_the_sessions_tool_format(name):
    """The opening, the handles the model writes and the rest of the call parse as that format's call."""
    fmt = FORMATS[name]
    opening = side_thread_opening(fmt)
    whole = fmt.render_calls([("forget_tool_outputs", {"handles": ["T2", "T3"]}, "forget")])
    assert whole.startswith(opening) and whole[len(opening) :].startswith('"T2", "T3"]')
    (call,) = fmt.parse(whole).calls
    assert call.name == "forget_tool_outputs" and call.args == {"handles": ["T2", "T3"]}
    handles, error = parse_forget_answer(whole[len(opening) :], ["T1", "T2", "T3"])
    assert handles == ("T2", "T3") and error is None


def test_an_answer_cites_a_result_by_a_number_or_a_run_of_words():
    result = "The secret code is 4417. The parcel left Lyon on Monday."
    assert cites("Your code is 4417.", result)
    assert cites("I see the parcel left Lyon on Monday.", result)
    assert not cites("The weather is sunny.", result)
    assert not cites("", result)


# -- guard rails and the boundary -----------------------------------------------------------------


def test_requests_pass_the_guard_rails_and_apply_only_at_the_next_boundary(tiny_model, tiny_tokenizer):
    backend = backend_with(tiny_model, tiny_tokenizer)
    session = backend.session("guards")
    # Turn 2's answer quotes the code from turn 2's result: the last answer cites T2.
    history = replay(session, 3, answers=["sunny skies", "the code is 4417", "noted"])
    lease = session.pin("call-1")  # T1 pinned
    # Turn 4 is in progress: its tool result is the current turn's.
    tool_turn(history, 4, RESULTS[2], "noted again")
    session.extend(history[:-1])
    session.apply(ToolCallCompleted(tool_call_id="call-4"))
    history[-1]["content"] = "the code is 4417"  # so the answer about to be given cites T2
    session.extend(history)

    result = session.apply(ForgetRequested(handles=("T1", "T2", "T3", "T4"), request_id="r1"))
    assert result.applied
    decision = session.forget.stats.decisions[-1]
    refused = dict(decision.refused)
    assert decision.chosen == ("T3",)
    assert refused == {"T1": "pinned", "T2": "cited by the last answer", "T4": "belongs to the current turn"}
    # Nothing moves before the boundary.
    assert result_span(session, "call-3").state is SpanState.COMMITTED
    session.apply(TurnEnded())
    assert result_span(session, "call-3").state is SpanState.COMMITTED

    history.append({"role": "user", "content": "next question", "id": "u5"})
    session.extend(history)
    forgotten = result_span(session, "call-3")
    assert forgotten.state is SpanState.EVICTED and forgotten.tier is Tier.DROPPED
    assert forgotten.token_ids  # the tokens stay: recomputable
    for kept in ("call-1", "call-2", "call-4"):
        assert result_span(session, kept).state is not SpanState.EVICTED
    assert session.forget.stats.released_spans == 1
    assert session.forget.stats.released_tokens == forgotten.length
    session.release(lease)
    session.check()


def test_a_malformed_request_releases_nothing(tiny_model, tiny_tokenizer, caplog):
    backend = backend_with(tiny_model, tiny_tokenizer)
    session = backend.session("malformed")
    history = replay(session, 2)
    before = [(s.span_id, s.state, s.tier) for s in session.spans]
    with caplog.at_level("INFO", logger="agentkv.forget"):
        result = session.apply(ForgetRequested(handles=("T1", "T7")))
    assert not result.applied and "T7" in result.reason
    assert "malformed" in caplog.text
    history.append({"role": "user", "content": "next", "id": "u3"})
    session.extend(history)
    assert [(s.span_id, s.state, s.tier) for s in session.spans][: len(before)] == before
    assert session.forget.stats.released_spans == 0 and session.forget.stats.malformed == 1


def test_a_repeated_request_is_a_no_op(tiny_model, tiny_tokenizer):
    session = backend_with(tiny_model, tiny_tokenizer).session("dup")
    replay(session, 2)
    event = ForgetRequested(handles=("T1",), request_id="call-x")
    assert session.apply(event).applied
    assert not session.apply(event).applied
    assert len(session.forget.pending) == 1


def test_a_forgotten_result_is_recomputed_when_a_later_question_needs_it(tiny_model, tiny_tokenizer):
    backend = backend_with(tiny_model, tiny_tokenizer)
    forgetting = backend.session("forgets")
    plain = backend.session("keeps")
    history = replay(forgetting, 3)
    replay(plain, 3)
    forgetting.apply(ForgetRequested(handles=("T2",)))
    question = {"role": "user", "content": "The secret code is what? the secret code 4417", "id": "q"}
    # The boundary releases T2; the same user message's recall then brings it back from its tokens.
    forgetting.extend([*history, question])
    plain.extend([*history, question])
    span = result_span(forgetting, "call-2")
    assert forgetting.forget.stats.released_spans == 1
    assert span.state is SpanState.COMMITTED and span.tier is Tier.DEVICE
    assert forgetting.stats().rehydrated_tokens >= span.length
    # Recomputed exactly: the answer's logits equal those of a session that never forgot.
    ids = forgetting.format.generation_prompt_ids(forgetting.messages)
    assert torch.allclose(forgetting.continuation_logits(ids), plain.continuation_logits(ids), atol=TOL)
    forgetting.check()


def test_the_event_applied_at_the_boundary_is_idempotent(tiny_model, tiny_tokenizer):
    session = backend_with(tiny_model, tiny_tokenizer).session("idem")
    replay(session, 2)
    event = ToolOutputForgotten(owner="call-1", at_turn=session.turn)
    assert session.apply(event).applied
    assert not session.apply(event).applied
    assert result_span(session, "call-1").state is SpanState.EVICTED


# -- the side thread ------------------------------------------------------------------------------


def test_the_side_thread_never_changes_the_main_thread_before_the_boundary(tiny_model, tiny_tokenizer):
    backend = TransformersBackend(tiny_model, tiny_tokenizer)
    on = backend.session("on", config=AgentKVConfig.from_dict({"forget": {"enabled": True}}))
    off = backend.session("off")
    replay(on, 3)
    replay(off, 3)
    stats = on.forget.stats
    assert stats.runs == 3  # every turn end (every_turns: 1) with a candidate
    assert stats.prefill_tokens > 0 and stats.decode_tokens > 0
    assert not any(SIDE_THREAD_BRANCH in s.session_id for s in backend.sessions())  # forks closed
    assert off.forget.stats.runs == 0
    # Same spans, states, tiers, and the same next-token logits as without the side thread (span
    # ids may differ: a fork continues its parent's numbering, so the parent skips the fork's ids).
    assert [(s.kind, s.start, s.state, s.tier, s.token_ids) for s in on.spans] == [
        (s.kind, s.start, s.state, s.tier, s.token_ids) for s in off.spans
    ]
    probe = on.format.encode("<|im_start|>user\nwhat was the code?<|im_end|>\n")
    assert torch.allclose(on.continuation_logits(probe), off.continuation_logits(probe), atol=TOL)
    assert on.stats().attended_tokens == off.stats().attended_tokens
    for decision in stats.decisions:
        # Decided at the end of turn t: the results of turns 1..t are offered (T<k> is turn k's).
        assert decision.offered == tuple(f"T{k}" for k in range(1, decision.turn + 1))
        if decision.malformed is not None:
            assert decision.chosen == ()
    on.check()


def test_the_side_thread_is_off_by_default_and_runs_every_k_turns(tiny_model, tiny_tokenizer):
    default = backend_with(tiny_model, tiny_tokenizer).session("default")
    replay(default, 3)
    assert default.forget.stats.runs == 0
    every_two = backend_with(tiny_model, tiny_tokenizer, enabled=True, every_turns=2).session("k2")
    replay(every_two, 5)
    assert [d.turn for d in every_two.forget.stats.decisions] == [2, 4]


def test_without_an_explicit_turn_end_the_side_thread_runs_at_the_boundary(tiny_model, tiny_tokenizer):
    session = backend_with(tiny_model, tiny_tokenizer, enabled=True).session("implicit")
    history: list[dict[str, Any]] = [{"role": "system", "content": "You are a helpful assistant."}]
    for t in (1, 2):
        tool_turn(history, t, RESULTS[t - 1], "sunny skies")
        session.extend(history)  # no events at all
    history.append({"role": "user", "content": "and now?", "id": "u3"})
    session.extend(history)
    # Each boundary ends the previous turn (committing it) and runs the side thread about it.
    decisions = session.forget.stats.decisions
    assert [(d.turn, d.offered) for d in decisions] == [(1, ("T1",)), (2, ("T1", "T2"))]
    session.check()


def test_the_watermark_trigger_runs_under_budget_pressure_only(tiny_model, tiny_tokenizer):
    config = {"enabled": True, "every_turns": None, "on_high_watermark": True}
    relaxed = backend_with(tiny_model, tiny_tokenizer, **config).session("relaxed")
    replay(relaxed, 3)
    assert relaxed.forget.stats.runs == 0
    tight = TransformersBackend(
        tiny_model,
        tiny_tokenizer,
        AgentKVConfig.from_dict({"budget": {"device_tokens": 120}, "forget": config}),
    )
    session = tight.session("tight")
    replay(session, 4)
    assert session.forget.stats.runs >= 1
    assert all(d.trigger == "watermark" for d in session.forget.stats.decisions)
    session.check()


# -- config ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("forget", "message"),
    [
        ({"every_turns": 0}, "agentkv.forget.every_turns: must be >= 1, got 0"),
        ({"enabled": True, "every_turns": None}, "agentkv.forget.every_turns: an enabled side thread needs"),
        ({"prompt": "which results?"}, "agentkv.forget.prompt: must contain {handles}"),
        ({"prompt": "{handles} {other}"}, "agentkv.forget.prompt: only the placeholder {handles}"),
        ({"max_candidates": 0}, "agentkv.forget.max_candidates: must be >= 1, got 0"),
        ({"every_turn": 2}, "agentkv.forget.every_turn: unknown key (did you mean 'every_turns'?)"),
        ({"enabled": "yes"}, "agentkv.forget.enabled: must be true or false"),
    ],
)
def test_forget_config_errors_name_the_path(forget, message):
    with pytest.raises(ValueError, match=None) as excinfo:
        AgentKVConfig.from_dict({"forget": forget})
    assert message in str(excinfo.value)


def test_forget_config_errors_name_the_yaml_line():
    text = "agentkv:\n  forget:\n    enabled: true\n    every_turns: -1\n"
    with pytest.raises(ValueError, match=r"agentkv\.forget\.every_turns: must be >= 1, got -1 \(line 4\)"):
        AgentKVConfig.from_yaml_text(text)


def test_the_side_thread_asks_in_the_backends_tool_format(tiny_model, tiny_tokenizer, monkeypatch):
    """A backend set to another tool-call protocol prefills the side thread's call in it, not in Hermes."""
    from agentkv.forget import controller

    asked: list[str] = []
    until = controller._until_list_end

    def spy(fork: Any, max_new_tokens: int, offered: Any, opening: str) -> str:
        asked.append(opening)
        return until(fork, max_new_tokens, offered, opening)

    monkeypatch.setattr(controller, "_until_list_end", spy)
    config = AgentKVConfig.from_dict({"forget": {"enabled": True}, "chat": {"tool_format": "pythonic"}})
    session = TransformersBackend(tiny_model, tiny_tokenizer, config).session("py")
    replay(session, 2)
    assert asked == ["[forget_tool_outputs(handles=["] * 2
    session.check()
