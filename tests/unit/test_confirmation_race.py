"""A confirmation wins the race against the pressure of the message that gives it.

Three tree-of-thought options arrive as consecutive assistant messages; the user's
"Go with option B." is encoded under a budget that cannot hold all three. The
confirmation either arrives with that message (`extend(..., events=...)`: applied
before the budget plans the message's pressure) or just after it (option B was
already demoted or dropped): either way option B ends pinned, attended and at full
precision, and the rejected options are the ones that leave.
"""

from __future__ import annotations

from typing import Any

import pytest

from agentkv import AgentKVConfig, SpanState, Tier, TransformersBackend, UserConfirmed
from agentkv.spans import Span

OPTIONS = {
    "opt-a": "Option A: rewrite the parser in lorem ipsum dolor sit amet, consectetur adipiscing elit 0123.",
    "opt-b": "Option B: keep the parser and cache the weather in Paris; the secret code is 4417 for it.",
    "opt-c": "Option C: search results first, then the tool returns sunny skies and tracking number ZX-99.",
}


def conversation(upto: int, *, choose: bool) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Give me three options for the parser.", "id": "u1"},
    ]
    for owner, text in list(OPTIONS.items())[:upto]:
        messages.append({"role": "assistant", "content": text, "id": owner})
    if choose:
        messages.append({"role": "user", "content": "Go with option B.", "id": "u2"})
    return messages


def option(session: Any, owner: str) -> Span:
    (span,) = session.spans_owned_by(owner)
    return span


def budget_tokens(model: Any, tokenizer: Any) -> int:
    """Room for the system prompt, both user messages and one option, not for three."""
    free = TransformersBackend(model, tokenizer, AgentKVConfig()).session("free")
    free.extend(conversation(3, choose=True))
    option_tokens = max(option(free, owner).length for owner in OPTIONS)
    others = free.stats().attended_tokens - sum(option(free, owner).length for owner in OPTIONS)
    return others + option_tokens + option_tokens // 2


def options_arrive(session: Any) -> None:
    for upto in (1, 2, 3):
        session.extend(conversation(upto, choose=False))


QUANTIZATION = {
    "exact": {"attended_bits": None},
    "int4": {"attended_bits": 4, "attended_key_bits": 4},
    "keys8": {"attended_bits": 4, "attended_key_bits": 8},
}
"""No attended quantized tier; int4 keys and values; 8-bit keys (the default)."""


@pytest.mark.parametrize("archive_tier", ["drop", "host"])
@pytest.mark.parametrize("tier", list(QUANTIZATION))
@pytest.mark.parametrize("with_message", [True, False])
def test_the_chosen_option_stays_pinned_and_attended(
    tiny_model, tiny_tokenizer, archive_tier, tier, with_message
):
    config = AgentKVConfig.from_dict(
        {
            "budget": {"device_tokens": budget_tokens(tiny_model, tiny_tokenizer)},
            "archive_tier": archive_tier,
            "quantization": QUANTIZATION[tier],
        }
    )
    session = TransformersBackend(tiny_model, tiny_tokenizer, config).session("t")
    options_arrive(session)
    confirm = UserConfirmed(owner="opt-b")
    if with_message:
        result = session.extend(conversation(3, choose=True), events=[confirm])
        (applied,) = result.applied
    else:
        session.extend(conversation(3, choose=True))
        applied = session.apply(confirm)
    assert applied.applied and applied.leases
    chosen = option(session, "opt-b")
    assert chosen.pinned and chosen.state is SpanState.COMMITTED
    store = session.store
    if tier == "keys8":  # recomputed, then held with its keys at 8 bits if the message's pressure needs it
        read_at_8_bits = store.fine_key_tokens(chosen) == store.attended_quantized_tokens(chosen)
        assert chosen.tier is Tier.DEVICE or read_at_8_bits
    else:
        assert chosen.tier is Tier.DEVICE
    session.generate(max_new_tokens=3)  # the answer is decoded over the chosen option
    session.check()
    chosen = option(session, "opt-b")
    assert chosen.state is SpanState.COMMITTED and chosen.tier.attended  # the planner may hold it at int4
    assert chosen.n_computed == chosen.length, "the chosen option's KV is computed, not pending"
    if tier == "exact":
        assert session.store.attended_quantized_tokens(chosen) == 0, "held at full precision"
    rejected = [option(session, owner) for owner in ("opt-a", "opt-c")]
    assert any(s.tier is not Tier.DEVICE for s in rejected), (
        "the pressure fell on the options the user did not choose"
    )
    assert session.stats().budget_satisfied


def test_the_race_is_lost_without_the_confirmation(tiny_model, tiny_tokenizer):
    """The budget above does demote option B when nothing confirms it (the test is not vacuous)."""
    config = AgentKVConfig.from_dict(
        {
            "budget": {"device_tokens": budget_tokens(tiny_model, tiny_tokenizer)},
            "archive_tier": "drop",
            "quantization": {"attended_bits": None},
        }
    )
    session = TransformersBackend(tiny_model, tiny_tokenizer, config).session("t")
    options_arrive(session)
    session.extend(conversation(3, choose=True))
    demoted = [o for o in OPTIONS if option(session, o).tier is not Tier.DEVICE]
    assert len(demoted) >= 2
