"""Injected failures in offload, restore, quantization, a policy and forwards are survived.

For every fault site (`agentkv.faults.FAULT_SITES`) the session must stay usable,
fall back (keep the span on the device, or recompute it from its token ids),
count the fault in `stats().faults`, and lose nothing the agent said: every
span keeps its tokens, its KV is held or recomputable, and logits after recovery
equal a plain full forward whenever nothing was evicted.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from agentkv import (
    AgentKVConfig,
    Custom,
    SpanState,
    Tier,
    ToolCallCompleted,
    TransformersBackend,
    UserConfirmed,
)
from agentkv.faults import FAULT_SITES, InjectedFault, inject_faults
from agentkv.spans import SpanKind
from agentkv.store.attended import QuantizedAttendedLayer
from agentkv.store.host import HostMemoryError

TOL = 1e-4
RULES = {
    "custom:arch": {"owner": "archive"},
    "custom:drop": {"owner": "evict"},
    "custom:commit": {"owner": "commit"},
}
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


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """Tiny-model matrices gain nothing from intra-op threads, and on a busy CI machine two
    spinning OpenMP threads per forward make these many small forwards ~30x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def make(model: Any, tokenizer: Any, **config: Any) -> TransformersBackend:
    return TransformersBackend(model, tokenizer, AgentKVConfig.from_dict({"rules": RULES, **config}))


def notes(n: int) -> list[dict[str, Any]]:
    """A plain chat (no tool calls, nothing released): budget pressure can only archive."""
    history: list[dict[str, Any]] = [{"role": "system", "content": "You are a helpful assistant."}]
    for i in range(n):
        history.append({"role": "user", "content": f"note {i}: the secret code is 44{i}7 lorem ipsum dolor"})
        history.append({"role": "assistant", "content": f"noted {i}"})
    return history


def assert_exact(session: Any, model: Any, probe: tuple[int, ...] = (5, 6, 7)) -> None:
    """Continuation logits over the managed cache equal a plain forward of every token."""
    managed = session.continuation_logits(list(probe))
    with torch.inference_mode():
        reference = model(input_ids=torch.tensor([session.token_ids() + list(probe)])).logits[
            0, -len(probe) :
        ]
    assert (managed - reference.float()).abs().max().item() <= TOL


def fault_records(session: Any) -> list[dict[str, Any]]:
    return [r.detail for r in session.log if r.kind == "fault"]


# -- the helper itself -----------------------------------------------------------------------------


def test_inject_faults_touches_one_session_and_always_undoes(tiny_model, tiny_tokenizer):
    backend = make(tiny_model, tiny_tokenizer)
    a, b = backend.session("a"), backend.session("b")
    a.extend(TOOL_TURN)
    b.extend(TOOL_TURN)
    layers = a.store.physical.cache.layers
    with pytest.raises(RuntimeError, match="body failed"), inject_faults(a, "forward", times=None):
        assert "update" in vars(layers[len(layers) // 2])
        b.extend([*TOOL_TURN, {"role": "user", "content": "ok"}])  # the other session is untouched
        raise RuntimeError("body failed")
    for site in FAULT_SITES:
        with inject_faults(a, site):
            pass
    assert not any("update" in vars(layer) for layer in layers)
    assert "archive" not in vars(a.store) and "restore" not in vars(a.store)
    assert "score" not in vars(a.policy)
    a.extend([*TOOL_TURN, {"role": "user", "content": "ok"}])
    assert_exact(a, tiny_model)
    assert a.stats().faults == b.stats().faults == 0


def test_inject_faults_rejects_bad_arguments(tiny_model, tiny_tokenizer):
    session = make(tiny_model, tiny_tokenizer).session("t")
    with (
        pytest.raises(ValueError, match="unknown site 'disk'.*allowed: offload"),
        inject_faults(session, "disk"),
    ):
        pass
    with pytest.raises(ValueError, match="times must be"), inject_faults(session, "offload", times=-1):
        pass
    full = make(tiny_model, tiny_tokenizer, policy="full").session("f")
    with pytest.raises(ValueError, match="no policy"), inject_faults(full, "policy"):
        pass


# -- offload, host limit, quantization: the span stays on the device -------------------------------


@pytest.mark.parametrize(
    ("site", "tier"),
    [("offload", "host"), ("host_limit", "host"), ("quantize", "int8"), ("quantize", "int4")],
)
def test_failed_archive_keeps_spans_on_the_device(tiny_model, tiny_tokenizer, site, tier, caplog):
    # Without the attended tier: pressure archives at once, so every move meets the injected fault.
    backend = make(
        tiny_model,
        tiny_tokenizer,
        archive_tier=tier,
        budget={"device_tokens": 128},
        quantization={"attended_bits": None},
    )
    session = backend.session("t")
    history = notes(5)
    with (
        caplog.at_level(logging.WARNING, logger="agentkv"),
        inject_faults(session, site, times=None) as fault,
    ):
        for end in range(3, len(history) + 1, 2):
            session.extend(history[:end])
            session.check()
    stats = session.stats()
    assert fault.injected > 0 and stats.faults == fault.injected
    records = fault_records(session)
    assert len(records) == fault.injected and all(r["where"] == "archive" for r in records)
    # A failed archive keeps the span where it was (a later plan may drop it); nothing reached
    # the failing tier, and what left the device was dropped by a plan (recomputable from its
    # token ids, still recallable), never half-archived.
    assert stats.host_bytes == stats.quantized_bytes == 0
    left = [s for s in session.spans if not s.tier.attended]
    assert all(s.state is SpanState.EVICTED and s.span_id in session.recallable for s in left)
    if site == "host_limit":
        assert all("HostMemoryError" in r["error"] for r in records)
    assert "kept safe" in caplog.text
    if not left:
        assert not stats.budget_satisfied and stats.budget_unmet > 0
        assert_exact(session, tiny_model)  # nothing was evicted: the cache is still exact
    # Once the tier works again, the next operation meets the budget.
    session.extend([*history, {"role": "user", "content": "and now?"}])
    assert session.stats().budget_satisfied
    # Archived now (or archived, then evicted from the quantized tier under the same pressure): recallable.
    demoted = [s for s in session.spans if s.state in (SpanState.ARCHIVED, SpanState.EVICTED)]
    assert any(s.span_id in session.recallable for s in demoted)
    session.check()


def test_real_host_limit_is_a_recorded_fault(tiny_model, tiny_tokenizer):
    """The store's own limit (not an injected one) refuses an offload with HostMemoryError."""
    session = make(tiny_model, tiny_tokenizer).session("t")
    session.extend(TOOL_TURN)
    session.store.host_limit_bytes = 1
    result = session.apply(Custom(event="arch", owner="call_1"))
    (tool,) = session.spans_owned_by("call_1")
    assert not result.transitions and tool.tier is Tier.DEVICE and tool.state is SpanState.ACTIVE
    assert session.stats().faults == 1 and "HostMemoryError" in fault_records(session)[0]["error"]
    with pytest.raises(HostMemoryError, match="limit_bytes=1"):
        session.store.archive(tool, "host")
    session.check()
    assert_exact(session, tiny_model)


# -- restore: recomputed from the token ids --------------------------------------------------------


@pytest.mark.parametrize("tier", ["host", "int8", "int4"])
@pytest.mark.parametrize("bring_back", ["move", "pin", "confirm", "recall"])
def test_failed_restore_recomputes_the_span(tiny_model, tiny_tokenizer, bring_back, tier):
    session = make(tiny_model, tiny_tokenizer, archive_tier=tier).session("t")
    session.extend(TOOL_TURN)
    session.apply(Custom(event="arch", owner="call_1"))
    (tool,) = session.spans_owned_by("call_1")
    assert tool.state is SpanState.ARCHIVED and tool.tier is (Tier.HOST if tier == "host" else Tier.QUANTIZED)
    session.manager.recallable.add(tool.span_id)
    with inject_faults(session, "restore") as fault:
        if bring_back == "move":
            assert session.apply(Custom(event="commit", owner="call_1")).transitions
        elif bring_back == "pin":
            assert session.pin("call_1").span_ids == (tool.span_id,)
        elif bring_back == "confirm":
            assert session.apply(UserConfirmed("call_1")).applied
        else:
            session.extend([*TOOL_TURN, {"role": "user", "content": "search results: sunny skies?"}])
    # A confirmation recomputes a span archived as codes from its ids: no restore to fail.
    restores = int(bring_back != "confirm" or tier == "host")
    assert fault.injected == restores
    assert tool.state is SpanState.COMMITTED and tool.tier is Tier.DEVICE
    stats = session.stats()
    assert stats.faults == restores and stats.rehydrated_tokens == tool.length
    assert stats.host_bytes == stats.quantized_bytes == 0
    assert [r["where"] for r in fault_records(session)] == ["restore"] * restores
    session.check()
    assert_exact(session, tiny_model)  # the recompute is exact: everything before it is intact


def test_restore_and_recompute_both_failing_leaves_an_evicted_span(tiny_model, tiny_tokenizer):
    session = make(tiny_model, tiny_tokenizer).session("t")
    session.extend(TOOL_TURN)
    session.apply(Custom(event="arch", owner="call_1"))
    (tool,) = session.spans_owned_by("call_1")
    with inject_faults(session, "restore"), inject_faults(session, "forward"):
        assert not session.apply(Custom(event="commit", owner="call_1")).transitions
    # The archived copy is gone and the recompute failed: the span says so, and keeps its tokens.
    assert tool.state is SpanState.EVICTED and tool.tier is Tier.DROPPED and tool.token_ids
    assert session.stats().faults == 2
    session.check()
    # A confirmation brings it back later (recomputed from its token ids).
    assert session.apply(UserConfirmed("call_1")).applied
    assert tool.state is SpanState.COMMITTED and tool.tier is Tier.DEVICE
    session.check()
    assert_exact(session, tiny_model)


def test_failed_rehydrate_keeps_the_span_evicted_until_it_works(tiny_model, tiny_tokenizer):
    session = make(tiny_model, tiny_tokenizer).session("t")
    session.extend(TOOL_TURN)
    session.apply(Custom(event="drop", owner="call_1"))
    (tool,) = session.spans_owned_by("call_1")
    with inject_faults(session, "forward"):
        assert session.manager.move(tool, SpanState.COMMITTED, reason="test") is None
    assert tool.state is SpanState.EVICTED and tool.tier is Tier.DROPPED
    assert [r["where"] for r in fault_records(session)] == ["rehydrate"]
    session.check()
    assert session.manager.move(tool, SpanState.COMMITTED, reason="retry") is not None
    session.check()
    assert_exact(session, tiny_model)


# -- policy: the whole span is kept ----------------------------------------------------------------


def test_failing_policy_at_commit_keeps_the_whole_span(tiny_model, tiny_tokenizer):
    backend = make(
        tiny_model, tiny_tokenizer, commit={"keep_ratio": {"tool_result": 0.5}, "min_keep_tokens": 2}
    )
    session = backend.session("t")
    session.extend(TOOL_TURN)
    with inject_faults(session, "policy", times=None) as fault:
        assert session.apply(ToolCallCompleted("call_1")).applied
    (tool,) = session.spans_owned_by("call_1")
    assert tool.state is SpanState.COMMITTED and tool.frozen and tool.kept is None
    assert fault.injected == 1 and session.stats().faults == 1
    assert session.stats().compressed_tokens == 0
    session.check()
    assert_exact(session, tiny_model)


def test_failing_token_mode_policy_drops_nothing(tiny_model, tiny_tokenizer):
    session = make(tiny_model, tiny_tokenizer, policy="snapkv", budget={"device_tokens": 48}).session("t")
    with inject_faults(session, "policy", times=None) as fault:
        session.extend(TOOL_TURN)
    stats = session.stats()
    assert fault.injected >= 1 and stats.faults == fault.injected
    assert stats.attended_tokens == stats.logical_tokens and not stats.budget_satisfied
    session.check()
    assert_exact(session, tiny_model)
    session.extend([*TOOL_TURN, {"role": "user", "content": "ok"}])
    assert session.stats().attended_tokens <= 48
    session.check()


# -- forwards: the operation fails cleanly, the session stays usable -------------------------------


def test_failed_prefill_leaves_nothing_half_written(tiny_model, tiny_tokenizer):
    session = make(tiny_model, tiny_tokenizer).session("t")
    session.extend(TOOL_TURN[:2])
    before = session.stats().attended_tokens
    with inject_faults(session, "forward"), pytest.raises(InjectedFault, match="half way"):
        session.extend(TOOL_TURN)
    assert session.stats().attended_tokens == before
    session.check()
    result = session.extend(TOOL_TURN)  # the retry encodes what was pending, once
    assert result.prefilled_tokens == len(session.token_ids()) - before
    assert session.stats().prefill_tokens == len(session.token_ids())
    assert_exact(session, tiny_model)


@pytest.mark.parametrize("skip", [0, 1])
def test_failed_decode_step_keeps_spans_and_messages_aligned(tiny_model, tiny_tokenizer, skip):
    """skip=0: the prompt prefill fails (no answer starts); skip=1: a decode step fails mid-answer."""
    backend = make(tiny_model, tiny_tokenizer)
    session = backend.session("t")
    session.extend(TOOL_TURN)
    spans_before = len(session.spans)
    with inject_faults(session, "forward", skip=skip), pytest.raises(InjectedFault):
        session.generate(max_new_tokens=4)
    session.check()
    assert len(session.spans) == spans_before + skip
    clean = backend.session("clean")
    clean.extend(TOOL_TURN)
    expected = clean.generate(max_new_tokens=4)
    if skip:  # the partial answer was kept as an assistant message: the agent can drop it
        session.extend(TOOL_TURN)
    assert session.generate(max_new_tokens=4) == expected
    session.check()


# -- a sweep: every site, every tier, a whole conversation -----------------------------------------


SWEEP = [
    ("offload", "host", 8),
    ("host_limit", "host", 8),
    ("restore", "host", 4),
    ("policy", "host", 8),
    ("forward", "host", 8),
    ("forward", "drop", 8),  # recall recomputes dropped spans: the rehydrate forwards fail
]
"""Each site with the archive tiers (and key bits) that reach it in this conversation.

With the default 8-bit keys this conversation restores no archived span while the faults
fire (turns 2-4); the restore site runs with keys at 4 bits, where it does.

The quantize site is not here: with the planner's default rung costs this conversation's
pressure drops spans instead of archiving them to an int8/int4 device tier (an archive
there keeps 16-30% of the bytes for a value the costs rate near a drop's), so no
quantization runs; `test_failed_archive_keeps_spans_on_the_device` reaches it.
"""


@pytest.mark.parametrize(("site", "tier", "key_bits"), SWEEP, ids=[f"{s}-{t}-k{k}" for s, t, k in SWEEP])
def test_conversation_survives_faults_at_every_site(tiny_model, tiny_tokenizer, site, tier, key_bits):
    """Seven agent turns under budget pressure, recall and re-pinned old spans; faults fire on turns
    2-4, then stop."""
    backend = make(
        tiny_model,
        tiny_tokenizer,
        archive_tier=tier,
        budget={"device_tokens": 140, "host_tokens": 120},
        commit={"keep_ratio": {"tool_result": 0.6}, "min_keep_tokens": 4},
        quantization={"attended_key_bits": key_bits},
    )
    session = backend.session("t")
    history: list[dict[str, Any]] = [{"role": "system", "content": "You are a helpful assistant."}]
    injected = surfaced = 0
    for turn in range(7):
        call = f"call_{turn}"
        history += [
            {"role": "user", "content": f"note {turn}: code 44{turn}7; what is the weather?"},
            {"role": "assistant", "content": "", "tool_calls": [{"id": call, "name": "weather", "args": {}}]},
            {
                "role": "tool",
                "content": f"search results {turn}: sunny skies lorem ipsum",
                "tool_call_id": call,
            },
        ]
        if turn == 6:
            history.append({"role": "user", "content": "which note had code 4417?"})
        faulty = 2 <= turn <= 4
        with inject_faults(session, site, times=None if faulty else 0) as fault:
            try:
                # An old span is needed again, whatever recall chose: the oldest archived one is
                # pinned (restored) and let go; the oldest evicted one is recomputed.
                demoted = [s for s in session.spans if s.state in (SpanState.ARCHIVED, SpanState.EVICTED)]
                if demoted and demoted[0].state is SpanState.ARCHIVED:
                    session.release(session.pin(span_ids=[demoted[0].span_id], reason="needed again"))
                elif demoted:
                    session.manager.move(demoted[0], SpanState.COMMITTED, reason="needed again")
                    session.manager.after_operation()
                session.extend(history)
                session.apply(ToolCallCompleted(call))
                answer = session.generate(max_new_tokens=3, message_id=f"a{turn}")
                history.append({"role": "assistant", "content": answer, "id": f"a{turn}"})
            except InjectedFault:
                assert site == "forward", "only a failed forward may surface, as a clear error"
                surfaced += 1
        injected += fault.injected
        session.check()
        assert all(s.token_ids for s in session.spans)
    # After the faults stop, the agent simply carries on: one more turn, nothing lost.
    session.extend([*history, {"role": "user", "content": "thanks"}])
    session.generate(max_new_tokens=2)
    session.check()
    # Every fault was either survived (recorded in stats) or surfaced as the operation's error.
    recorded = session.stats().faults
    assert injected > 0 and recorded + surfaced == injected
    print(f"fault sweep {site}/{tier}: injected {injected}, survived {recorded}, surfaced {surfaced}")
    for span in session.spans:
        if span.state is SpanState.EVICTED:
            assert session.manager.move(span, SpanState.COMMITTED, reason="test") is not None
            assert span.tier is Tier.DEVICE
    assert not any(s.state is SpanState.EVICTED for s in session.spans)
    session.manager.after_operation()  # what a public operation does after moving spans
    system = next(s for s in session.spans if s.kind is SpanKind.SYSTEM)
    assert system.pinned and system.tier.attended
    session.check()


def test_failed_quantization_in_attention_falls_back_and_is_completed_later(
    tiny_model, tiny_tokenizer, caplog
):
    """Half the layers quantized, then a failure: recorded, the cache stays consistent, the budget
    archives instead, and a later demotion quantizes the slots the other layers still hold exact."""
    backend = make(tiny_model, tiny_tokenizer, archive_tier="drop", budget={"device_tokens": 120})
    session = backend.session("t")
    history = notes(5)
    with caplog.at_level(logging.WARNING, logger="agentkv"), inject_faults(session, "attended") as fault:
        for end in range(3, len(history) + 1, 2):
            session.extend(history[:end])
            session.check()
    assert fault.injected == 1 and session.stats().faults == 1
    records = fault_records(session)
    assert len(records) == 1 and records[0]["where"] == "quantization in attention"
    assert "kept safe" in caplog.text
    layers = session.store.physical.cache.managed_layers
    assert isinstance(layers[0], QuantizedAttendedLayer)
    # Once the tier works again, later demotions bring every layer to the same quantized slots.
    session.extend([*history, {"role": "user", "content": "and now?"}])
    session.check()
    quantized = [layer.quant_index for layer in session.store.physical.cache.managed_layers]
    assert quantized[0].numel() > 0
    assert all(torch.equal(q, quantized[0]) for q in quantized[1:])
    assert session.stats().budget_satisfied
    assert all(span.token_ids for span in session.spans)  # nothing the agent said is lost
