"""A selected tree-of-thought branch's conclusion is the agent's decision: it is kept like a confirmation.

Branches run in sessions of their own (`session.fork`, as LangGraph `Send` tasks do);
only the selected branch's conclusion enters the conversation, as the turn's answer.
`BranchSelected` on the conversation's session closes the branch sessions, and the
answer that ends that turn is the `decision` target of `turn_ended` (pinned by
default), not a plain `answer`: under budget pressure it stays attended while the
other answers may leave.
"""

from __future__ import annotations

from typing import Any

from agentkv import (
    AgentKVConfig,
    BranchOpened,
    BranchPruned,
    BranchSelected,
    SpanState,
    TransformersBackend,
    TurnEnded,
)
from agentkv.spans import SpanKind

SYSTEM = {"role": "system", "content": "You are a helpful assistant."}


def history(turns: int) -> list[dict[str, Any]]:
    """`turns` user questions, each answered; the second answer is the branch's conclusion."""
    messages: list[dict[str, Any]] = [SYSTEM]
    for t in range(1, turns + 1):
        messages.append(
            {"role": "user", "content": f"Question {t}: which plan for the parser?", "id": f"u{t}"}
        )
        messages.append(
            {"role": "assistant", "content": f"Answer {t}: keep plan {t} with code 44{t}7.", "id": f"a{t}"}
        )
    return messages


def run_turns(session: Any, turns: int, *, branch_turn: int | None) -> None:
    for t in range(1, turns + 1):
        messages = history(t)
        session.extend(messages[:-1])
        if t == branch_turn:
            for name in ("plan-a", "plan-b"):
                session.apply(BranchOpened(branch=name))
                child = session.fork(name)
                child.extend([*messages[:-1], {"role": "assistant", "content": f"Reasoning for {name}."}])
            session.apply(BranchPruned(branch="plan-a"))
            session.apply(BranchSelected(branch="plan-b"))
        session.extend(messages)
        session.apply(TurnEnded())


def answer_of(session: Any, turn: int) -> Any:
    (span,) = session.spans_owned_by(f"a{turn}")
    assert span.kind is SpanKind.ASSISTANT
    return span


def test_the_answer_of_the_turn_that_selected_a_branch_is_pinned_as_its_decision(tiny_model, tiny_tokenizer):
    backend = TransformersBackend(tiny_model, tiny_tokenizer, AgentKVConfig())
    session = backend.session("t")
    run_turns(session, 3, branch_turn=2)
    decision = answer_of(session, 2)
    assert decision.pinned and decision.state is SpanState.COMMITTED
    for turn in (1, 3):  # answers of turns without a selected branch are committed, not pinned
        other = answer_of(session, turn)
        assert other.state is SpanState.COMMITTED and not other.pinned


def test_under_pressure_the_decision_stays_attended_while_plain_answers_leave(tiny_model, tiny_tokenizer):
    free = TransformersBackend(tiny_model, tiny_tokenizer, AgentKVConfig()).session("free")
    run_turns(free, 4, branch_turn=2)
    budget = free.stats().attended_tokens // 2
    config = AgentKVConfig.from_dict(
        {"budget": {"device_tokens": budget}, "quantization": {"attended_bits": None}}
    )
    session = TransformersBackend(tiny_model, tiny_tokenizer, config).session("t")
    run_turns(session, 4, branch_turn=2)
    assert answer_of(session, 2).tier.attended
    assert any(not answer_of(session, t).tier.attended for t in (1, 3))


def test_a_rule_override_makes_the_decision_a_plain_answer(tiny_model, tiny_tokenizer):
    config = AgentKVConfig.from_dict({"rules": {"turn_ended": {"decision": "commit"}}})
    session = TransformersBackend(tiny_model, tiny_tokenizer, config).session("t")
    run_turns(session, 2, branch_turn=2)
    decision = answer_of(session, 2)
    assert decision.state is SpanState.COMMITTED and not decision.pinned
