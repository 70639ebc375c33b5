"""A span recomputed from its token ids keeps the commit score it got when first encoded.

Rehydration unfreezes a dropped span; scoring it again over the recompute's attention
(its own tokens over a partial cache) would leave only the kind prior, and every span
recalled once would be among the first demoted again (`Span.scored`).
"""

from __future__ import annotations

import torch

from agentkv import AgentKVConfig, SpanState, Tier, TransformersBackend
from tests.unit.held_kv import span_keys
from tests.unit.test_demotion_order import NOTE, history, user_span

QUESTION = "Where is the spare key for locker KX7-4471 kept?"
"""Names the note's words: recall brings the dropped note back."""


def test_a_recalled_span_keeps_its_commit_score_and_holds_the_full_caches_kv(tiny_model, tiny_tokenizer):
    """Everything before the note is attended at full precision, so its recomputed KV is exact."""
    free = TransformersBackend(tiny_model, tiny_tokenizer, AgentKVConfig()).session("free")
    free.extend(history())
    reference_note = user_span(free, NOTE)
    config = AgentKVConfig.from_dict({"archive_tier": "drop", "quantization": {"attended_bits": None}})
    session = TransformersBackend(tiny_model, tiny_tokenizer, config).session("t")
    session.extend(history())
    note = user_span(session, NOTE)
    assert note.scored and note.score == reference_note.score
    assert session.manager.move(note, SpanState.ARCHIVED, reason="test: dropped under pressure") is not None
    session.manager.recallable.add(note.span_id)
    assert note.tier is Tier.DROPPED
    session.extend([*history(), {"role": "user", "content": QUESTION}])
    session.check()
    assert note.tier is Tier.DEVICE and session.stats().rehydrated_tokens >= note.length
    assert note.score == reference_note.score
    got, want = span_keys(session, note), span_keys(free, reference_note)
    assert all(held.shape[-2] == note.length for held in got)
    for held, reference in zip(got, want, strict=True):
        torch.testing.assert_close(held, reference, rtol=1e-5, atol=1e-5)
