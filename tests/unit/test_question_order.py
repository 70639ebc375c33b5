"""Under pressure the budget demotes what the new user message needs least, before the commit score.

Commit scores are fixed at commit, long before anyone knows the question; recall ranks every
attended span against each new user message, and the budget check after its prefill archives
(or quantizes) the least relevant spans first, so it does not push out the one the question is
about to make room for the others.
"""

from __future__ import annotations

from typing import Any

from agentkv import AgentKVConfig, SpanState, Tier, TransformersBackend
from agentkv.spans import Span, SpanKind

LOCKER = "note for later: the spare key for locker KX7-4471 is kept in the blue drawer by the door"
PARKING = "note for later: visitors park in bay twelve behind the loading dock near the gate"
QUESTION = "Which drawer holds the spare key for locker KX7-4471?"


def history() -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": LOCKER},
        {"role": "assistant", "content": "noted"},
        {"role": "user", "content": PARKING},
        {"role": "assistant", "content": "noted"},
    ]


def note(session: Any, text: str) -> Span:
    decode = session.backend.tokenizer.decode
    return next(s for s in session.spans if s.kind is SpanKind.USER and text in decode(s.token_ids))


def asked_under_pressure(model: Any, tokenizer: Any, **config: Any) -> tuple[Any, Span, Span]:
    free = TransformersBackend(model, tokenizer, AgentKVConfig()).session("free")
    free.extend([*history(), {"role": "user", "content": QUESTION}])
    # Room for the question and one of the two notes, not both.
    budget = free.logical_length - note(free, PARKING).length // 2
    data = {"archive_tier": "drop", "budget": {"device_tokens": budget}, **config}
    session = TransformersBackend(model, tokenizer, AgentKVConfig.from_dict(data)).session("t")
    session.extend(history())
    locker, parking = note(session, LOCKER), note(session, PARKING)
    # The commit scores favour the note the question does not need.
    locker.score, parking.score = 0.0, 1.0
    session.extend([*history(), {"role": "user", "content": QUESTION}])
    session.check()
    return session, locker, parking


def test_the_note_the_question_needs_stays_the_other_is_archived(tiny_model, tiny_tokenizer):
    session, locker, parking = asked_under_pressure(
        tiny_model, tiny_tokenizer, quantization={"attended_bits": None}
    )
    assert locker.state is SpanState.COMMITTED and locker.tier is Tier.DEVICE
    assert parking.tier is Tier.DROPPED
    assert session.stats().budget_satisfied
