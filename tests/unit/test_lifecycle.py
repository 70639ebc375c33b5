"""Events drive spans through the lifecycle; budgets demote whole spans; recall brings them back."""

from __future__ import annotations

import logging

import pytest
import torch

from agentkv import (
    AgentKVConfig,
    BranchPruned,
    Custom,
    SessionClosed,
    SpanState,
    Tier,
    ToolCallCompleted,
    ToolCallFailed,
    TransformersBackend,
    TurnEnded,
    UserConfirmed,
    UserRejected,
)
from agentkv.lifecycle import TRANSITIONS, Rules, check_transition
from agentkv.spans import SpanKind

TOOL_TURN = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": "call_1", "name": "weather", "args": {"city": "Paris"}}],
    },
    {"role": "tool", "content": "search results: sunny skies " * 6, "tool_call_id": "call_1"},
]
FAILED_CALL = [
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": "call_2", "name": "weather", "args": {"city": "Rome"}}],
    },
    {"role": "tool", "content": "error: timeout", "tool_call_id": "call_2"},
]


def make(tiny_model, tiny_tokenizer, **config) -> TransformersBackend:
    return TransformersBackend(tiny_model, tiny_tokenizer, AgentKVConfig.from_dict(config))


def by_kind(session, kind):
    return [s for s in session.spans if s.kind is kind]


def test_tool_call_completed_commits_result_and_releases_call(tiny_model, tiny_tokenizer):
    session = make(tiny_model, tiny_tokenizer).session("t")
    session.extend(TOOL_TURN)
    result = session.apply(ToolCallCompleted("call_1"))
    assert result.applied
    (tool_result,) = by_kind(session, SpanKind.TOOL_RESULT)
    (call,) = by_kind(session, SpanKind.TOOL_CALL)
    assert tool_result.state is SpanState.COMMITTED and tool_result.frozen
    assert call.state is SpanState.EVICTABLE
    again = session.apply(ToolCallCompleted("call_1"))
    assert not again.applied and again.reason == "duplicate event"
    assert session.stats().events_noop == 1
    session.check()


def test_failed_call_releases_the_call_and_commits_its_error(tiny_model, tiny_tokenizer):
    session = make(tiny_model, tiny_tokenizer).session("t")
    session.extend(TOOL_TURN + FAILED_CALL)
    session.apply(ToolCallFailed("call_2", error="timeout"))
    (error,) = [s for s in session.spans if s.owner == "call_2"]
    # The error text is what the agent observed (it may be asked about); the failed call is not.
    assert error.kind is SpanKind.TOOL_RESULT and error.state is SpanState.COMMITTED
    failed_call = by_kind(session, SpanKind.TOOL_CALL)[-1]
    assert failed_call.state is SpanState.EVICTABLE
    session.generate(max_new_tokens=4, message_id="plan-1")
    session.apply(UserRejected("plan-1"))
    assert session.spans[-1].state is SpanState.EVICTABLE
    session.check()


def test_confirmation_pins_with_a_lease(tiny_model, tiny_tokenizer):
    session = make(tiny_model, tiny_tokenizer).session("t")
    session.extend(TOOL_TURN)
    session.generate(max_new_tokens=4, message_id="plan-1")
    result = session.apply(UserConfirmed("plan-1"))
    (lease,) = result.leases
    plan = session.spans[-1]
    assert plan.pinned and plan.state is SpanState.COMMITTED
    # Budget pressure never demotes a pinned span; releasing the lease allows it again.
    assert session.release(lease)
    assert not plan.pinned
    assert not session.release(lease), "a lease is given back once"


@pytest.mark.parametrize(
    "archive",
    [{"archive_tier": "int4"}, {"archive_tier": "int8"}, {"quantization": {"host_bits": 4}}],
    ids=["int4", "int8", "host_bits4"],
)
def test_a_confirmed_span_archived_as_codes_comes_back_exact(tiny_model, tiny_tokenizer, archive):
    """The user confirms a result held as lossy codes: recomputed from its ids, not restored from them."""
    session = make(
        tiny_model, tiny_tokenizer, rules={"custom:archive": {"owner": "archive"}}, **archive
    ).session("t")
    session.extend(TOOL_TURN)
    session.apply(Custom(event="archive", owner="call_1"))
    (result,) = by_kind(session, SpanKind.TOOL_RESULT)
    assert result.state is SpanState.ARCHIVED and not session.store.archive_exact(result)
    session.apply(UserConfirmed(owner="call_1"))
    assert result.pinned and result.tier is Tier.DEVICE
    probe = [5, 6, 7]
    with torch.inference_mode():
        full = tiny_model(input_ids=torch.tensor([session.token_ids() + probe])).logits[0, -len(probe) :]
    torch.testing.assert_close(session.continuation_logits(probe), full.float(), rtol=1e-4, atol=1e-4)
    session.check()


def test_turn_end_commits_user_and_answer_and_releases_scaffolding(tiny_model, tiny_tokenizer):
    session = make(tiny_model, tiny_tokenizer).session("t")
    session.extend(TOOL_TURN)
    session.generate(max_new_tokens=4)
    session.apply(TurnEnded())
    user = by_kind(session, SpanKind.USER)[0]
    answer = session.spans[-1]
    assert user.state is SpanState.COMMITTED
    assert answer.state is SpanState.COMMITTED
    assert by_kind(session, SpanKind.TOOL_CALL)[0].state is SpanState.EVICTABLE
    assert by_kind(session, SpanKind.TOOL_RESULT)[0].state is SpanState.COMMITTED


def test_new_user_message_ends_the_previous_turn(tiny_model, tiny_tokenizer):
    session = make(tiny_model, tiny_tokenizer).session("t")
    session.extend(TOOL_TURN)
    answer = session.generate(max_new_tokens=4)
    session.extend([*TOOL_TURN, {"role": "assistant", "content": answer}, {"role": "user", "content": "ok"}])
    assert by_kind(session, SpanKind.USER)[0].state is SpanState.COMMITTED
    assert session.spans[-1].state is SpanState.ACTIVE


def test_unknown_targets_are_logged_noops(tiny_model, tiny_tokenizer, caplog):
    backend = make(tiny_model, tiny_tokenizer)
    session = backend.session("t")
    session.extend(TOOL_TURN)
    with caplog.at_level(logging.INFO, logger="agentkv"):
        assert not session.apply(ToolCallCompleted("nope")).applied
        assert not session.apply(UserConfirmed("nobody")).applied
        assert not session.apply(BranchPruned("b9")).applied
        assert backend.apply("no-such-session", TurnEnded()) is None
    assert session.stats().events_noop == 3
    assert backend.noop_events == 1
    assert "ignored" in caplog.text


def test_a_custom_event_no_rule_names_is_a_logged_noop(tiny_model, tiny_tokenizer, caplog):
    """A typo in a custom event's name changes nothing and says so, like an unknown owner."""
    session = make(tiny_model, tiny_tokenizer, rules={"custom:drop": {"owner": "evict"}}).session("t")
    session.extend(TOOL_TURN)
    before = [(s.span_id, s.state, s.tier) for s in session.spans]
    with caplog.at_level(logging.WARNING, logger="agentkv"):
        result = session.apply(Custom(event="dorp", owner="call_1"))
    assert not result.applied and not result.transitions
    assert "no rule for custom event 'dorp'" in result.reason and "did you mean 'drop'" in result.reason
    assert "dorp" in caplog.text and "ignored" in caplog.text
    stats = session.stats()
    assert stats.events_applied == 0 and stats.events_noop == 1
    assert [(s.span_id, s.state, s.tier) for s in session.spans] == before
    assert session.apply(Custom(event="drop", owner="call_1")).applied  # the named one still applies


def test_event_after_eviction_is_a_noop(tiny_model, tiny_tokenizer):
    session = make(tiny_model, tiny_tokenizer, rules={"custom:drop": {"owner": "evict"}}).session("t")
    session.extend(TOOL_TURN)
    assert session.apply(Custom(event="drop", owner="call_1")).applied
    result = session.apply(UserRejected("call_1"))
    assert not result.applied and "evicted" in result.reason
    (tool_result,) = by_kind(session, SpanKind.TOOL_RESULT)
    assert not tool_result.pinned
    assert tool_result.tier is Tier.DROPPED and tool_result.token_ids


def test_confirmation_after_eviction_brings_the_span_back(tiny_model, tiny_tokenizer):
    session = make(tiny_model, tiny_tokenizer, rules={"custom:drop": {"owner": "evict"}}).session("t")
    session.extend(TOOL_TURN)
    assert session.apply(Custom(event="drop", owner="call_1")).applied
    result = session.apply(UserConfirmed("call_1"))
    assert result.applied and result.leases
    (tool_result,) = by_kind(session, SpanKind.TOOL_RESULT)
    assert tool_result.pinned and tool_result.state is SpanState.COMMITTED
    assert tool_result.tier is Tier.DEVICE
    session.check()


def test_illegal_transition_names_state_event_and_allowed():
    with pytest.raises(ValueError, match=r"evicted.*archived.*allowed from evicted: committed"):
        check_transition(SpanState.EVICTED, SpanState.ARCHIVED, "budget")
    for state, allowed in TRANSITIONS.items():
        for target in SpanState:
            if target is state or target in allowed:
                check_transition(state, target, "x")


def test_rules_reject_unknown_names():
    with pytest.raises(ValueError, match="unknown event"):
        Rules({"tool_done": {"result": "commit"}})
    with pytest.raises(ValueError, match="unknown target"):
        Rules({"tool_call_completed": {"output": "commit"}})
    with pytest.raises(ValueError, match="unknown action"):
        Rules({"tool_call_completed": {"result": "shred"}})


def test_budget_archives_lowest_committed_spans_and_recall_restores(tiny_model, tiny_tokenizer):
    backend = make(
        tiny_model,
        tiny_tokenizer,
        budget={"device_tokens": 160, "low_watermark": 0.7},
        quantization={"attended_bits": None},  # archive at once (the attended tier is tested below)
    )
    session = backend.session("t")
    history = [{"role": "system", "content": "You are a helpful assistant."}]
    for i in range(6):
        history.append({"role": "user", "content": f"note {i}: the secret code is 44{i}7 lorem ipsum dolor"})
        history.append({"role": "assistant", "content": f"noted {i}"})
        session.extend(history)
        session.check()
    stats = session.stats()
    limit = 160 * backend.runner.bytes_per_token
    assert stats.device_bytes <= limit
    assert stats.host_bytes > 0
    assert stats.tokens_by_state["archived"] > 0
    system = by_kind(session, SpanKind.SYSTEM)[0]
    assert system.tier is Tier.DEVICE and system.pinned
    archived = [s for s in session.spans if s.state is SpanState.ARCHIVED]
    # A question naming an archived fact recalls it.
    target = next(s for s in archived if s.kind is SpanKind.USER)
    fact = (
        backend.tokenizer.decode(target.token_ids, skip_special_tokens=True).split("code is ")[1].split()[0]
    )
    history.append({"role": "user", "content": f"which note had code {fact}?"})
    session.extend(history)
    assert target.state is SpanState.COMMITTED and target.tier is Tier.DEVICE
    assert session.stats().restored_tokens >= target.length
    session.check()


def test_unmeetable_budget_is_reported_not_crashed(tiny_model, tiny_tokenizer, caplog):
    backend = make(tiny_model, tiny_tokenizer, budget={"device_tokens": 8})
    session = backend.session("t")
    with caplog.at_level(logging.WARNING, logger="agentkv"):
        session.extend(TOOL_TURN)
    stats = session.stats()
    assert not stats.budget_satisfied and stats.budget_unmet >= 1
    assert "cannot be met" in caplog.text
    session.check()


def test_rehydrated_span_equals_original_when_prefix_is_intact(tiny_model, tiny_tokenizer):
    backend = make(tiny_model, tiny_tokenizer, rules={"custom:drop": {"owner": "evict"}})
    session = backend.session("t")
    session.extend([*TOOL_TURN, {"role": "user", "content": "thanks"}])
    probe = [7, 8, 9]
    exact = session.continuation_logits(probe)
    tool = by_kind(session, SpanKind.TOOL_RESULT)[0]
    session.apply(Custom(event="drop", owner="call_1"))
    assert tool.tier is Tier.DROPPED
    assert session.apply(UserConfirmed("call_1")).applied  # a confirmation brings an evicted span back
    assert tool.state is SpanState.COMMITTED and tool.tier is Tier.DEVICE
    assert (session.continuation_logits(probe) - exact).abs().max().item() <= 1e-4  # recomputed exactly
    session.check()


def test_commit_compression_keeps_ratio_and_freezes(tiny_model, tiny_tokenizer):
    backend = make(
        tiny_model, tiny_tokenizer, commit={"keep_ratio": {"tool_result": 0.5}, "min_keep_tokens": 4}
    )
    session = backend.session("t")
    session.extend(TOOL_TURN)
    session.generate(max_new_tokens=3)
    session.apply(ToolCallCompleted("call_1"))
    (tool_result,) = by_kind(session, SpanKind.TOOL_RESULT)
    assert tool_result.frozen and tool_result.kept is not None
    assert len(tool_result.kept) == max(4, round(0.5 * tool_result.length))
    assert session.stats().compressed_tokens == tool_result.length - len(tool_result.kept)
    session.check()


def test_session_closed_releases_everything_but_pins(tiny_model, tiny_tokenizer):
    session = make(tiny_model, tiny_tokenizer).session("t")
    session.extend(TOOL_TURN)
    session.apply(SessionClosed())
    for span in session.spans:
        assert span.state is SpanState.EVICTED or span.pinned
        assert span.token_ids
    session.check()


@pytest.mark.parametrize("policy", ["window", "streaming_llm", "h2o", "snapkv", "tova", "key_norm", "intent"])
def test_token_mode_baselines_respect_the_budget(tiny_model, tiny_tokenizer, policy):
    backend = make(tiny_model, tiny_tokenizer, policy=policy, budget={"device_tokens": 64})
    session = backend.session("t")
    session.extend(TOOL_TURN)
    session.generate(max_new_tokens=4)
    stats = session.stats()
    assert stats.attended_tokens <= 64
    assert stats.logical_tokens > 64
    assert sum(s.length for s in session.spans) == stats.logical_tokens
    session.check()


@pytest.mark.parametrize(
    "policy", ["lifecycle", "full", "window", "streaming_llm", "h2o", "snapkv", "key_norm"]
)
def test_unlimited_budget_leaves_logits_identical(tiny_model, tiny_tokenizer, policy):
    backend = make(tiny_model, tiny_tokenizer, policy=policy)
    session = backend.session("t")
    session.extend(TOOL_TURN)
    ids = session.token_ids()
    with torch.inference_mode():
        reference = tiny_model(input_ids=torch.tensor([ids])).logits[0, -1].float()
    assert (session.last_logits - reference).abs().max().item() <= 1e-4


PLANNED = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Plan the move of the archive to the new building."},
]
TRANSIENT = {"role": "user", "content": "Answer with a one-line plan."}
PLAN = {
    "role": "assistant",
    "content": "Pack on Monday, move on Tuesday, unpack on Wednesday.",
    "id": "plan-1",
}


@pytest.mark.parametrize(
    ("event", "state", "pinned"),
    [
        (UserConfirmed(owner="plan-1"), SpanState.COMMITTED, True),
        (UserRejected(owner="plan-1"), SpanState.EVICTABLE, False),
    ],
)
def test_a_decided_message_keeps_its_decision_when_a_rewrite_encodes_it_again(
    tiny_model, tiny_tokenizer, event, state, pinned
):
    """A transient instruction left out of the next call: the plan after it is encoded again."""
    session = TransformersBackend(tiny_model, tiny_tokenizer, AgentKVConfig()).session("t")
    session.extend([*PLANNED, TRANSIENT, PLAN])
    result = session.apply(event)
    before = {span.span_id for span in session.spans_owned_by("plan-1")}
    again = session.extend([*PLANNED, PLAN, {"role": "user", "content": "Go ahead."}])
    assert again.cropped_tokens > 0
    (plan,) = session.spans_owned_by("plan-1")
    assert plan.span_id not in before  # encoded again, not kept
    assert (plan.state, plan.pinned) == (state, pinned)
    session.check()
    for lease in result.leases:  # the pin's receipt still gives it back
        assert session.release(lease)
        assert not plan.pinned
