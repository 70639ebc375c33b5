"""Budget pressure demotes the least value per byte first, after what the new message needs.

Two committed spans of equal commit score, one short (a user's note) and one long (a pasted
log): archiving the long one frees the room at a fraction of the loss. The old order (score,
then the oldest) archived the short note first, then the log as well. What the new message
needs is kept last whatever its size (`RecallMarks.needed`; tests/unit/test_question_order.py).
"""

from __future__ import annotations

import math
from typing import Any

from agentkv import AgentKVConfig, SpanState, Tier, TransformersBackend
from agentkv.spans import Span, SpanKind

NOTE = "note for later: the spare key for locker KX7-4471 is kept in the blue drawer by the door"
LOG = "service log: " + "; ".join(
    f"unit {n} checked at {8 + n % 9}:{(7 * n) % 60:02d}, pressure nominal, filter cleaned" for n in range(12)
)
QUESTION = "Please greet the visitors politely and show them to the meeting room on the second floor."


def history() -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": NOTE},
        {"role": "assistant", "content": "noted"},
        {"role": "user", "content": LOG},
        {"role": "assistant", "content": "logged"},
    ]


def user_span(session: Any, text: str) -> Span:
    decode = session.backend.tokenizer.decode
    return next(s for s in session.spans if s.kind is SpanKind.USER and text[:40] in decode(s.token_ids))


def test_the_long_span_is_archived_and_the_short_one_stays(tiny_model, tiny_tokenizer):
    free = TransformersBackend(tiny_model, tiny_tokenizer, AgentKVConfig()).session("free")
    free.extend(history())
    assert user_span(free, LOG).length > 4 * user_span(free, NOTE).length
    watermarks = AgentKVConfig().budget
    # The history fits under the high watermark, so both spans are committed at full precision
    # when the question brings the pressure; archiving the log alone brings usage under the low one.
    budget = math.ceil(free.logical_length / watermarks.high_watermark) + 4
    assert free.logical_length - user_span(free, LOG).length + 64 < watermarks.low_watermark * budget
    # Recall off: no span is needed by the question, so only the order of the rest is tested.
    data = {
        "archive_tier": "drop",
        "budget": {"device_tokens": budget},
        "quantization": {"attended_bits": None},
        "recall": {"enabled": False},
    }
    session = TransformersBackend(tiny_model, tiny_tokenizer, AgentKVConfig.from_dict(data)).session("t")
    session.extend(history())
    note, log = user_span(session, NOTE), user_span(session, LOG)
    assert note.tier is Tier.DEVICE and log.tier is Tier.DEVICE
    note.score = 1.0  # a user message's kind prior; the log is scored when its turn commits
    session.extend([*history(), {"role": "user", "content": QUESTION}])
    session.check()
    assert note.score <= log.score  # the old order (score first) would archive the note first
    assert log.tier is Tier.DROPPED
    assert note.state is SpanState.COMMITTED and note.tier is Tier.DEVICE
    assert session.stats().budget_satisfied


def span(span_id: int, start: int, tokens: int, score: float) -> Span:
    s = Span(span_id, SpanKind.USER, list(range(tokens)), start, state=SpanState.COMMITTED, score=score)
    s.n_computed = tokens
    return s


def test_spans_committed_before_their_prefill_are_scored_after_it(tiny_model, tiny_tokenizer):
    """A history sent in one call commits its earlier turns before their KV exists; they still get a value.

    Commit-time scoring reads the span's keys and attention, so it waits for the forward that
    computes them; before, such spans were frozen with score 0 and went first under any pressure.
    """
    session = TransformersBackend(tiny_model, tiny_tokenizer, AgentKVConfig()).session("batch")
    session.extend([*history(), {"role": "user", "content": QUESTION}])
    committed = [s for s in session.spans if s.state is SpanState.COMMITTED and s.kind is SpanKind.USER]
    assert {s.span_id for s in committed} == {
        user_span(session, NOTE).span_id,
        user_span(session, LOG).span_id,
    }
    assert all(s.frozen and s.score >= 1.0 for s in committed)  # at least the user kind prior
