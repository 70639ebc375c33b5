"""Displaced spans come back at the next turn when the demotion order values them above what is attended.

A long span recalled for one question displaces short committed spans (a user's note, a
confirmed option). Once the question is answered, the note is worth more per token than
the log, so at the next user turn it is brought back (its tokens join that turn's prefill)
and the budget demotes the log instead. `agentkv.lifecycle.restoration`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from agentkv import AgentKVConfig, SpanState, Tier, TransformersBackend
from agentkv.lifecycle.marks import RecallMarks
from agentkv.lifecycle.restoration import attended_competitors, plan_restoration
from agentkv.spans import Span
from tests.unit.test_demotion_order import LOG, NOTE, user_span
from tests.unit.test_demotion_order import history as demotion_history
from tests.unit.test_demotion_order import span as committed_span

NEXT = "Greet visitors politely; show them upstairs."
"""Shares no word with the note or the log: recall finds nothing relevant, restoration decides alone."""


def bytes_of(tokens: int) -> int:
    return 10 * tokens


def span(span_id: int, start: int, tokens: int, score: float, *, dropped: bool = False) -> Span:
    s = committed_span(span_id, start, tokens, score)
    if dropped:
        s.state, s.tier = SpanState.EVICTED, Tier.DROPPED
    return s


# -- the plan -------------------------------------------------------------------------------------


def test_a_dropped_note_displaces_a_log_worth_less_per_token():
    note = span(1, 0, 10, 1.0, dropped=True)  # 0.1 per token once back
    log = span(2, 10, 200, 1.0)  # 0.005 per token
    assert plan_restoration([note], [log], 0, bytes_of, RecallMarks()) == [note]


def test_nothing_is_displaced_for_a_span_worth_less_but_free_room_takes_it():
    long_low = span(1, 0, 200, 0.5, dropped=True)  # 0.0025 per token
    short_high = span(2, 200, 10, 1.0)
    assert plan_restoration([long_low], [short_high], 0, bytes_of, RecallMarks()) == []
    assert plan_restoration([long_low], [short_high], bytes_of(199), bytes_of, RecallMarks()) == []
    assert plan_restoration([long_low], [short_high], bytes_of(200), bytes_of, RecallMarks()) == [long_low]


def test_equal_value_displaces_nothing():
    back = span(1, 0, 10, 1.0, dropped=True)
    held = span(2, 10, 10, 1.0)
    assert plan_restoration([back], [held], 0, bytes_of, RecallMarks()) == []


def test_what_the_turn_needs_is_never_offered_up():
    note = span(1, 0, 10, 1.0, dropped=True)
    log = span(2, 10, 200, 1.0)
    needed = RecallMarks(needed={log.span_id})
    assert plan_restoration([note], [log], 0, bytes_of, needed) == []
    recalled = RecallMarks(recalled={log.span_id})
    assert attended_competitors([note, log], recalled) == []
    log.leases.add(1)
    assert attended_competitors([note, log], RecallMarks()) == []


def test_a_candidate_too_big_is_skipped_and_a_smaller_one_behind_it_comes_back():
    big = span(1, 0, 100, 2.0, dropped=True)  # 0.02 per token, needs 1000 bytes
    small = span(2, 100, 10, 0.1, dropped=True)  # 0.01 per token, needs 100 bytes
    low = span(3, 110, 50, 0.05)  # 0.001 per token, frees 500 bytes
    assert plan_restoration([big, small], [low], 0, bytes_of, RecallMarks()) == [small]


def test_a_displaced_span_pays_for_one_restoration_only():
    first = span(1, 0, 10, 1.0, dropped=True)  # needs 100
    second = span(2, 10, 15, 1.0, dropped=True)  # needs 150, worth a little less per token
    lone = span(3, 25, 20, 0.01)  # frees 200
    assert plan_restoration([second, first], [lone], 0, bytes_of, RecallMarks()) == [first]
    assert plan_restoration([second, first], [lone], bytes_of(5), bytes_of, RecallMarks()) == [first, second]


# -- in a session ---------------------------------------------------------------------------------


def history() -> list[dict[str, Any]]:
    return [
        *demotion_history(),
        {"role": "user", "content": "thanks"},  # ends the log's turn: the log is committed
        {"role": "assistant", "content": "welcome"},
    ]


def displaced_then_next_turn(model: Any, tokenizer: Any, *, restore: bool) -> tuple[Any, Span, Span]:
    """The note dropped as a recall for the log would leave it, then a turn that needs neither.

    The limit is set so the note cannot come back without the log leaving, and the log
    leaving makes room for it.
    """
    data = {
        "archive_tier": "drop",
        "quantization": {"attended_bits": None},
        "budget": {"device_tokens": 100_000},
        "recall": {"restore_displaced": restore},
    }
    session = TransformersBackend(model, tokenizer, AgentKVConfig.from_dict(data)).session("t")
    session.extend(history())
    note, log = user_span(session, NOTE), user_span(session, LOG)
    assert note.scored and log.scored
    assert note.score / note.length > log.score / log.length
    assert session.manager.move(note, SpanState.ARCHIVED, reason="test: displaced by a recall") is not None
    session.manager.recallable.add(note.span_id)
    assert note.tier is Tier.DROPPED
    turn = [*history(), {"role": "user", "content": NEXT}]
    sizing = TransformersBackend(model, tokenizer, AgentKVConfig()).session("sizing")
    sizing.extend(turn)
    total = sizing.logical_length
    keeper = session.manager.placer
    low = keeper.limits.low
    limit = int((total - log.length // 2) * session.runner.bytes_per_token / low)
    keeper.limits = dataclasses.replace(keeper.limits, device_bytes=limit)
    session.extend(turn)
    session.check()
    return session, note, log


def test_the_displaced_note_comes_back_and_the_log_leaves(tiny_model, tiny_tokenizer):
    session, note, log = displaced_then_next_turn(tiny_model, tiny_tokenizer, restore=True)
    assert note.state is SpanState.COMMITTED and note.tier is Tier.DEVICE
    assert note.n_computed == note.length, "its tokens were computed in the new turn's prefill"
    assert log.tier is Tier.DROPPED and log.span_id in session.manager.recallable
    stats = session.stats()
    assert stats.restored_spans == 1
    assert stats.budget_satisfied


def test_without_restoration_the_note_stays_dropped(tiny_model, tiny_tokenizer):
    session, note, _ = displaced_then_next_turn(tiny_model, tiny_tokenizer, restore=False)
    assert note.tier is Tier.DROPPED
    assert session.stats().restored_spans == 0


def test_the_restored_note_keeps_its_commit_score_and_holds_the_full_caches_kv(tiny_model, tiny_tokenizer):
    """Everything before the note is attended at full precision, so its recomputed KV is exact.

    Its commit score is the one it got when the conversation first encoded it: a
    recompute does not re-score it (`Span.scored`).
    """
    free = TransformersBackend(tiny_model, tiny_tokenizer, AgentKVConfig()).session("free")
    free.extend(history())
    reference_note = user_span(free, NOTE)
    session, note, _ = displaced_then_next_turn(tiny_model, tiny_tokenizer, restore=True)
    assert note.score == reference_note.score
    physical, reference = session.store.physical, free.store.physical
    got = physical.slots_of(note.span_id)
    want = reference.slots_of(reference_note.span_id)
    assert got.numel() == note.length
    for layer in range(physical.num_layers):
        torch.testing.assert_close(
            physical.layer_keys_at(layer, got), reference.layer_keys_at(layer, want), rtol=1e-5, atol=1e-5
        )
