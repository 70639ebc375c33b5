"""Property tests: random agent sessions keep every invariant after every operation.

A hypothesis state machine drives one session on the tiny model through random
sequences of what an agent does — append, rewrite and truncate message lists
(system/user/assistant/tool, tool calls with ids), generate, lifecycle events
(built-in, custom, unknown owners, duplicates, out of order), pins and releases —
under random budgets, watermarks, archive tiers, host limits and commit ratios.
After every step it checks, independently of the code under test:

- `session.check()` passes (positions, states, leases, accounting, budget);
- the bytes each tier reports equal the bytes of the tensors it holds (walked here);
- budget pressure never demotes a pinned or ACTIVE span;
- device usage is under the high watermark whenever `stats().budget_satisfied`;
- the logical token sequence is exactly what the message list implies (nothing lost);
- an event applied twice changes nothing the second time;
- an evicted span keeps its tokens and can be recomputed;
- with nothing ever moved off the device, logits equal a plain full forward.

`AGENTKV_HYPOTHESIS_EXAMPLES` / `AGENTKV_HYPOTHESIS_STEPS` raise the example count and
length for long local runs; `AGENTKV_HYPOTHESIS_RANDOM=1` explores new examples each run.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import event as hypothesis_event
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from agentkv import (
    AgentKVConfig,
    BranchOpened,
    BranchPruned,
    BranchSelected,
    Custom,
    Event,
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
from agentkv.chat import normalize_messages
from agentkv.lifecycle import DEMOTED_STATES, Lease
from agentkv.spans import SpanKind
from tests.unit.held_kv import span_keys
from tests.unit.store_accounting import assert_tier_bytes, global_device_bytes

TOL = 1e-4
EXAMPLES = int(os.environ.get("AGENTKV_HYPOTHESIS_EXAMPLES", "150"))
STEPS = int(os.environ.get("AGENTKV_HYPOTHESIS_STEPS", "30"))
RANDOM = os.environ.get("AGENTKV_HYPOTHESIS_RANDOM") == "1"
"""Explore new examples each run (default: a fixed, reproducible set)."""
MAX_LOGICAL = 1300
"""Stop adding messages past this many tokens: the tiny model has 2048 positions."""

WORDS = [
    "the",
    "user",
    "asked",
    "weather",
    "Paris",
    "sunny",
    "code",
    "4417",
    "tracking",
    "ZX-99",
    "lorem",
    "ipsum",
    "dolor",
    "tool",
    "result",
    "number",
    "remember",
    "secret",
    "0123456789",
    "é",
    "🙂",
]
CUSTOM_RULES = {
    "custom:drop": {"owner": "evict"},
    "custom:arch": {"owner": "archive"},
    "custom:keep": {"owner": "pin"},
    "custom:unpin": {"owner": "unpin"},
    "custom:release": {"owner": "release"},
    "custom:commit": {"owner": "commit"},
}
CUSTOM_NAMES = [name.split(":", 1)[1] for name in CUSTOM_RULES] + ["never_configured"]
SPAN_KINDS = [kind.value for kind in SpanKind]
TOKEN_MODE = ("window", "streaming_llm", "h2o", "snapkv", "tova", "key_norm")

text = st.lists(st.sampled_from(WORDS), min_size=0, max_size=10).map(" ".join)


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """Tiny-model matrices gain nothing from intra-op threads, and on a busy CI machine two
    spinning OpenMP threads per forward make these many small forwards ~30x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@st.composite
def configs(draw: Any) -> dict[str, Any]:
    """Random budgets, watermarks, tiers, host limits, commit ratios and recall settings."""
    policy = draw(st.sampled_from(["lifecycle"] * 6 + ["full", *TOKEN_MODE]))
    high = draw(st.floats(0.5, 1.0))
    low = high * draw(st.floats(0.3, 1.0))
    budget: dict[str, Any] = {"high_watermark": high, "low_watermark": low}
    budget["device_tokens"] = draw(st.none() | st.integers(24, 400))
    budget["host_tokens"] = draw(st.none() | st.integers(8, 500))
    keep_ratio = draw(st.dictionaries(st.sampled_from(SPAN_KINDS), st.floats(0.1, 1.0), max_size=3))
    return {
        "policy": policy,
        "budget": budget,
        "archive_tier": draw(st.sampled_from(["host", "int8", "int4", "drop"])),
        "quantization": {
            "group_size": draw(st.sampled_from([8, 16, 32])),
            "residual_tokens": draw(st.integers(0, 4)),
            "attended_bits": draw(st.sampled_from([4, 4, 2, None])),
            "attended_residual_tokens": draw(st.integers(0, 16)),
            "attended_sink_tokens": draw(st.integers(0, 4)),
        },
        "commit": {"keep_ratio": keep_ratio, "min_keep_tokens": draw(st.integers(1, 8))},
        "recall": {
            "enabled": draw(st.booleans()),
            "max_spans": draw(st.integers(0, 4)),
            "rehydrate_evicted": draw(st.booleans()),
        },
        "rules": CUSTOM_RULES,
    }


# -- independent checks ---------------------------------------------------------------------------------


def assert_accounting(session: Any) -> None:
    """Reported bytes per tier equal the tensors held; per-token costs add up."""
    stats = session.stats()
    _, _, host = assert_tier_bytes(session)
    bpt = session.runner.bytes_per_token
    on_host = sum(s.held_tokens for s in session.spans if s.tier is Tier.HOST)
    assert host == on_host * bpt
    assert stats.attended_tokens == sum(s.held_tokens for s in session.spans if s.tier.attended)


def span_snapshot(session: Any) -> tuple[Any, ...]:
    """Everything an event may change (states, tiers, kept tokens, pins, bytes, counters)."""
    spans = tuple(
        (
            s.span_id,
            s.state,
            s.tier,
            tuple(s.kept or ()),
            s.kept is None,
            frozenset(s.leases),
            s.n_computed,
            tuple(s.token_ids),
            s.frozen,
        )
        for s in session.spans
    )
    stats = session.stats()
    counters = (
        stats.device_bytes,
        stats.quantized_bytes,
        stats.host_bytes,
        stats.prefill_tokens,
        stats.transitions,
        stats.faults,
        stats.compressed_tokens,
        stats.rehydrated_tokens,
        stats.restored_tokens,
        stats.events_applied,
    )
    return spans, counters, tuple(sorted(session.leases))


# -- the state machine ---------------------------------------------------------------------------------


class SessionMachine(RuleBasedStateMachine):
    """One session, driven like an agent framework would (and like a buggy one might)."""

    model: Any = None
    tokenizer: Any = None

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[dict[str, Any]] = []
        self.generated: dict[int, list[int]] = {}
        self.call_ids: list[str] = []
        self.owners: list[str] = []
        self.leases: list[Lease] = []
        self.counter = 0
        self.exact = True
        self.budget_moves: list[tuple[int, SpanState, bool, str]] = []
        self.steps = 0
        self.branches = 0
        self.fork_names: list[str] = []

    # -- setup ----------------------------------------------------------------------------------

    @initialize(config=configs(), system=text)
    def start(self, config: dict[str, Any], system: str) -> None:
        hypothesis_event("rule: start")
        self.config = AgentKVConfig.from_dict(config)
        self.backend = TransformersBackend(self.model, self.tokenizer, self.config)
        self.session = self.backend.session("prop")
        self.span_mode = self.config.policy.name in ("lifecycle", "full")
        mover = self.session.manager.mover
        original_move = mover.move

        def recording_move(span: Any, target: SpanState, *, reason: str, **options: Any) -> Any:
            self.budget_moves.append((span.span_id, span.state, span.pinned, reason))
            return original_move(span, target, reason=reason, **options)

        mover.move = recording_move  # type: ignore[method-assign]
        self.messages.append({"role": "system", "content": f"You are a helpful assistant. {system}"})
        self._extend()

    def _next(self, prefix: str) -> str:
        self.counter += 1
        return f"{prefix}{self.counter}"

    def _extend(self) -> None:
        self.session.extend(self.messages)

    @property
    def room(self) -> bool:
        return self.session.logical_length < MAX_LOGICAL

    # -- messages ---------------------------------------------------------------------------------

    @precondition(lambda self: self.room)
    @rule(content=text)
    def user_says(self, content: str) -> None:
        hypothesis_event("rule: user_says")
        owner = self._next("u")
        self.owners.append(owner)
        self.messages.append({"role": "user", "content": content, "id": owner})
        self._extend()

    @precondition(lambda self: self.room)
    @rule(content=text, calls=st.integers(0, 2), results=st.integers(0, 2), data=st.data())
    def assistant_turn(self, content: str, calls: int, results: int, data: st.DataObject) -> None:
        """An assistant message (maybe with tool calls) and some tool results, in one extend."""
        hypothesis_event("rule: assistant_turn")
        owner = self._next("a")
        self.owners.append(owner)
        message: dict[str, Any] = {"role": "assistant", "content": content, "id": owner}
        ids = [self._next("call_") for _ in range(calls)]
        if ids:
            message["tool_calls"] = [{"id": i, "name": "search", "args": {"q": content[:8]}} for i in ids]
            self.call_ids.extend(ids)
        self.messages.append(message)
        for call_id in ids[:results]:
            self.messages.append({"role": "tool", "content": data.draw(text), "tool_call_id": call_id})
        self._extend()

    @precondition(lambda self: self.room and bool(self.call_ids))
    @rule(data=st.data(), content=text)
    def late_tool_result(self, data: st.DataObject, content: str) -> None:
        """A tool result that arrives later (or twice, or for a call the model never made)."""
        hypothesis_event("rule: late_tool_result")
        call_id = data.draw(st.sampled_from([*self.call_ids, "call_unknown"]))
        self.messages.append({"role": "tool", "content": content, "tool_call_id": call_id})
        self._extend()

    @precondition(lambda self: len(self.messages) > 1)
    @rule(data=st.data(), content=text)
    def rewrite(self, data: st.DataObject, content: str) -> None:
        """Summarisation / context editing: one earlier message's content changes."""
        hypothesis_event("rule: rewrite")
        index = data.draw(st.integers(1, len(self.messages) - 1))
        self.messages[index] = {**self.messages[index], "content": content}
        self.generated = {i: ids for i, ids in self.generated.items() if i < index}
        self._extend()

    @precondition(lambda self: len(self.messages) > 1)
    @rule(data=st.data())
    def truncate(self, data: st.DataObject) -> None:
        """A rewind: the history is cut back (possibly to nothing)."""
        hypothesis_event("rule: truncate")
        keep = data.draw(st.integers(0, len(self.messages) - 1))
        del self.messages[keep:]
        self.generated = {i: ids for i, ids in self.generated.items() if i < keep}
        if keep == 0:
            self.exact = True  # a fresh start: nothing left that was ever moved
        self._extend()

    @precondition(lambda self: self.room and bool(self.messages))
    @rule(tokens=st.integers(1, 4), named=st.booleans())
    def generate(self, tokens: int, named: bool) -> None:
        hypothesis_event("rule: generate")
        owner = self._next("g") if named else None
        answer = self.session.generate(max_new_tokens=tokens, message_id=owner)
        span = self.session.spans[-1]
        assert span.generated and span.owner == owner
        self.generated[len(self.messages)] = list(span.token_ids)
        message: dict[str, Any] = {"role": "assistant", "content": answer}
        if owner:
            self.owners.append(owner)
            message["id"] = owner
        self.messages.append(message)

    @precondition(lambda self: self.room and bool(self.messages) and self.branches < 2)
    @rule(content=text, outcome=st.sampled_from(["prune", "select", "keep"]), tokens=st.integers(1, 2))
    def branch(self, content: str, outcome: str, tokens: int) -> None:
        """Tree of thought: a branch session shares the prefix, answers, and is pruned or selected."""
        hypothesis_event("rule: branch")
        self.branches += 1
        name = f"fork{self.branches}"  # a branch id names one branch for the session's life
        self.fork_names.append(name)
        child = self.session.fork(name)
        assert child.token_ids() == self.session.token_ids()
        child.check()
        assert_accounting(child)
        child.extend([*self.messages, {"role": "assistant", "content": f"branch {name}: {content}"}])
        child.generate(max_new_tokens=tokens)
        child.check()
        assert_accounting(child)
        if outcome == "keep":
            return
        event = BranchPruned(name) if outcome == "prune" else BranchSelected(name)
        assert self.session.apply(event).applied
        assert (f"prop/{name}" in self.backend) == (outcome == "select")
        assert child.closed == (outcome == "prune")

    # -- events and pins --------------------------------------------------------------------------------

    def _owner(self, data: st.DataObject) -> str:
        return data.draw(st.sampled_from([*self.owners, *self.call_ids, "nobody", "call_unknown"]))

    def _event(self, data: st.DataObject) -> Event:
        kind = data.draw(
            st.sampled_from(
                [
                    "turn",
                    "turn_n",
                    "done",
                    "failed",
                    "confirm",
                    "reject",
                    "open",
                    "prune",
                    "select",
                    "closed",
                    "custom",
                ]
            )
        )
        turn = self.session.turn
        if kind == "turn":
            return TurnEnded()
        if kind == "turn_n":
            return TurnEnded(turn=data.draw(st.integers(0, turn + 1)))
        if kind in ("done", "failed"):
            call = data.draw(st.sampled_from([*self.call_ids, "call_unknown"]))
            return ToolCallCompleted(call) if kind == "done" else ToolCallFailed(call, error="boom")
        if kind in ("confirm", "reject"):
            owner = data.draw(st.none() | st.just(self._owner(data)))
            return UserConfirmed(owner) if kind == "confirm" else UserRejected(owner)
        if kind in ("open", "prune", "select"):
            branch = data.draw(st.sampled_from(["b1", "b2", *self.fork_names]))
            return {"open": BranchOpened, "prune": BranchPruned, "select": BranchSelected}[kind](
                branch=branch
            )
        if kind == "closed":
            return SessionClosed()
        return Custom(event=data.draw(st.sampled_from(CUSTOM_NAMES)), owner=self._owner(data))

    @rule(data=st.data())
    def event_twice(self, data: st.DataObject) -> None:
        """Apply an event, then the same again: the second application changes nothing."""
        hypothesis_event("rule: event_twice")
        event = self._event(data)
        self.session.apply(event)
        self._observe()
        before = span_snapshot(self.session)
        again = self.session.apply(event)
        assert span_snapshot(self.session) == before, f"{event} changed the session on its second application"
        assert not again.transitions

    @rule(data=st.data(), by_owner=st.booleans())
    def pin(self, data: st.DataObject, by_owner: bool) -> None:
        hypothesis_event("rule: pin")
        if by_owner:
            lease = self.session.pin(self._owner(data), reason="test")
        else:
            ids = [s.span_id for s in self.session.spans]
            chosen = data.draw(st.lists(st.sampled_from(ids), max_size=3)) if ids else []
            lease = self.session.pin(span_ids=[*chosen, 10_000], reason="test")
        for span_id in lease.span_ids:
            assert self.session.span(span_id).pinned
        self.leases.append(lease)

    @precondition(lambda self: bool(self.leases))
    @rule(data=st.data(), foreign=st.booleans())
    def release(self, data: st.DataObject, foreign: bool) -> None:
        hypothesis_event("rule: release")
        lease = data.draw(st.sampled_from(self.leases))
        if foreign:
            # A receipt that is not this session's frees nothing.
            fake = Lease(lease.lease_id + 1_000_000, "elsewhere", lease.span_ids)
            assert not self.session.release(fake)
            return
        first = self.session.release(lease)
        assert not self.session.release(lease), "a lease is given back once"
        self.leases.remove(lease)
        if first:
            assert all(lease.lease_id not in s.leases for s in self.session.spans)

    @precondition(lambda self: any(s.state is SpanState.EVICTED for s in self.session.spans))
    @rule()
    def rehydrate_evicted(self) -> None:
        """Every evicted span keeps its tokens and can be recomputed."""
        hypothesis_event("rule: rehydrate_evicted")
        expected = self._expected_ids()
        for span in [s for s in self.session.spans if s.state is SpanState.EVICTED]:
            assert span.token_ids, f"evicted span {span.span_id} lost its tokens"
            assert span.tier is Tier.DROPPED
            moved = self.session.manager.move(span, SpanState.COMMITTED, reason="test rehydrate")
            assert moved is not None and span.tier is Tier.DEVICE and span.state is SpanState.COMMITTED
        self.session.manager.after_operation()
        assert self.session.token_ids() == expected

    @precondition(lambda self: self.exact and bool(self.session.spans))
    @rule(probe=st.lists(st.integers(3, 500), min_size=1, max_size=3))
    def logits_equal_full_forward(self, probe: list[int]) -> None:
        """While nothing ever left the device, the managed cache is exact."""
        hypothesis_event("rule: logits_equal_full_forward")
        managed = self.session.continuation_logits(probe)
        with torch.inference_mode():
            reference = (
                self.model(input_ids=torch.tensor([self.session.token_ids() + probe])).logits[0].float()
            )
        delta = (managed - reference[-len(probe) :]).abs().max().item()
        assert delta <= TOL, delta

    # -- invariants ------------------------------------------------------------------------------------

    def _expected_ids(self) -> list[int]:
        normalized = normalize_messages(self.messages)
        per_message = self.backend.chat_format.message_ids(normalized, 0) if normalized else []
        ids: list[int] = []
        for index, message_ids in enumerate(per_message):
            ids.extend(self.generated.get(index, message_ids))
        return ids

    def _observe(self) -> None:
        session = self.session
        for span in session.spans:
            # Held at int4/int2 in attention (`attended_quantized`): close, not exact.
            if span.tier is not Tier.DEVICE or span.kept is not None:
                self.exact = False

    @invariant()
    def invariants_hold(self) -> None:
        if not hasattr(self, "session"):
            return
        session = self.session
        self.steps += 1
        session.check()
        assert_accounting(session)
        for other in self.backend.sessions():  # branch sessions keep their invariants too
            other.check()
            assert_accounting(other)
        assert self.backend.device_bytes() == global_device_bytes(self.backend)
        # Budget pressure never demotes a pinned or ACTIVE span.
        for span_id, before, pinned, reason in self.budget_moves:
            if reason in ("budget", "host budget"):
                assert before is not SpanState.ACTIVE and not pinned, (span_id, before, pinned, reason)
            if self.config.policy.name == "full":
                assert reason != "budget", "policy 'full' never demotes for the device budget"
        self.budget_moves.clear()
        for span in session.spans:
            assert not (span.pinned and span.state in DEMOTED_STATES)
        stats = session.stats()
        limit = stats.budget_device_bytes
        if stats.budget_satisfied and limit is not None and self.config.policy.name != "full":
            usage = stats.device_bytes + stats.quantized_bytes
            assert usage <= limit * self.config.budget.high_watermark
        # Nothing the agent said is lost: the logical sequence is exactly what the messages imply.
        assert [m.fingerprint() for m in session.messages] == [
            m.fingerprint() for m in normalize_messages(self.messages)
        ]
        assert session.token_ids() == self._expected_ids()
        assert stats.logical_tokens == len(session.token_ids())
        assert sum(stats.tokens_by_state.values()) == stats.logical_tokens
        self._observe()


def test_random_sessions_keep_invariants(tiny_model, tiny_tokenizer):
    SessionMachine.model = tiny_model
    SessionMachine.tokenizer = tiny_tokenizer
    run_state_machine_as_test(
        SessionMachine,
        settings=settings(
            max_examples=EXAMPLES,
            stateful_step_count=STEPS,
            deadline=None,
            derandomize=not RANDOM,
            database=None,
            suppress_health_check=list(HealthCheck),
        ),
    )


# -- regressions found by the machine above -----------------------------------------------------------------

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


def make(model: Any, tokenizer: Any, **config: Any) -> TransformersBackend:
    return TransformersBackend(model, tokenizer, AgentKVConfig.from_dict({"rules": CUSTOM_RULES, **config}))


@pytest.mark.parametrize("demote", ["arch", "release"])
def test_pinning_a_demoted_span_brings_it_back(tiny_model, tiny_tokenizer, demote):
    """A pin is a promise never to demote; pinning an archived or released span restores it first."""
    session = make(tiny_model, tiny_tokenizer).session("t")
    session.extend(TOOL_TURN)
    session.apply(Custom(event=demote, owner="call_1"))
    tool = session.spans_owned_by("call_1")[0]
    assert tool.state in DEMOTED_STATES
    lease = session.pin("call_1")
    assert lease.span_ids == (tool.span_id,)
    assert tool.pinned and tool.state is SpanState.COMMITTED and tool.tier is Tier.DEVICE
    session.check()


def test_tail_computed_after_commit_compression_is_kept(tiny_model, tiny_tokenizer):
    """A generated answer's pending tail (last token, end of turn) joins the offsets its commit kept."""
    backend = make(
        tiny_model, tiny_tokenizer, commit={"keep_ratio": {"assistant": 0.3}, "min_keep_tokens": 1}
    )
    session = backend.session("t")
    session.extend(TOOL_TURN)
    answer = session.generate(max_new_tokens=12)
    session.apply(TurnEnded())
    span = session.spans[-1]
    assert span.kept is not None and span.n_computed < span.length
    session.extend([*TOOL_TURN, {"role": "assistant", "content": answer}, {"role": "user", "content": "ok"}])
    assert span.n_computed == span.length and span.kept[-1] == span.length - 1
    session.check()


def test_restored_pending_tail_attends_only_to_its_past(tiny_model, tiny_tokenizer):
    """An answer evicted before its tail was encoded, recomputed after later messages: the tail's KV
    must equal a plain forward of the conversation up to it (no peeking at later messages)."""
    session = make(tiny_model, tiny_tokenizer).session("t")
    session.extend(TOOL_TURN)
    answer = session.generate(max_new_tokens=6, message_id="ans")
    session.apply(Custom(event="drop", owner="ans"))
    session.extend(
        [*TOOL_TURN, {"role": "assistant", "content": answer}, {"role": "user", "content": "ok thanks"}]
    )
    (span,) = session.spans_owned_by("ans")
    assert span.state is SpanState.EVICTED and span.n_computed < span.length
    assert session.manager.move(span, SpanState.COMMITTED, reason="test") is not None
    session.continuation_logits([5])  # encodes the pending tail
    session.check()
    with torch.inference_mode():
        out = tiny_model(input_ids=torch.tensor([session.token_ids()[: span.end]]), use_cache=True)
    offsets = list(range(span.length))  # every token of it attended, the tail included
    for layer, held in enumerate(span_keys(session, span, offsets)):
        reference = out.past_key_values.layers[layer].keys[..., span.start : span.end, :]
        assert (held - reference).abs().max().item() <= TOL


def test_generate_reserves_positions_for_the_end_of_turn(tiny_model, tiny_tokenizer):
    """generate() refuses an answer whose end-of-turn ids would not fit (they would break the next extend)."""
    session = make(tiny_model, tiny_tokenizer).session("t")
    session.extend(TOOL_TURN)
    prompt = len(session.format.generation_prompt_ids(session.messages))
    room = session.runner.max_positions - session.logical_length - prompt
    with pytest.raises(ValueError, match="positions"):
        session.generate(max_new_tokens=room)
    session.check()


# -- soak smoke ----------------------------------------------------------------------------------------------


def test_soak_smoke(tiny_model, tiny_tokenizer, tmp_path):
    from agentkv_bench.soak import run_soak

    # A tenth of the window: even at int4 in attention the history does not fit, so spans are
    # also archived and recalled (the whole demotion order runs).
    summary = run_soak(tiny_model, tiny_tokenizer, turns=30, budget_fraction=0.1, out_dir=tmp_path)
    assert summary["turns"] == 30
    assert (tmp_path / "soak.json").exists() and (tmp_path / "soak.png").exists()
    assert summary["max_device_bytes"] <= summary["high_watermark_bytes"] or summary["budget_unmet_turns"] > 0
    assert summary["faults"] == 0
    assert summary["logical_tokens_kept"] is True and summary["check_error"] is None
    assert summary["compactions"] >= 1 and summary["restored_tokens"] > 0
    assert summary["quantized_tokens_max"] > 0  # the default demotion order quantizes in attention first


def test_scoring_a_continuation_enforces_the_budget(tiny_model, tiny_tokenizer):
    """continuation_logits encodes a generated answer's pending tail first; that growth is budgeted
    like any other, so `check()` never sees a stale `budget_satisfied`."""
    budget = {"device_tokens": 24, "high_watermark": 0.875, "low_watermark": 0.875}
    session = make(tiny_model, tiny_tokenizer, budget=budget).session("t")
    session.extend([{"role": "system", "content": "You are a helpful assistant. "}])
    session.generate(max_new_tokens=1)
    session.continuation_logits([3])
    session.check()


def test_a_rule_naming_a_move_the_state_forbids_is_skipped(tiny_model, tiny_tokenizer):
    """Archiving a span that was already released is a stale hint: skipped, not a ValueError."""
    session = make(tiny_model, tiny_tokenizer).session("t")
    session.extend(TOOL_TURN)
    session.apply(Custom(event="release", owner="call_1"))
    (tool,) = session.spans_owned_by("call_1")
    assert tool.state is SpanState.EVICTABLE
    result = session.apply(Custom(event="arch", owner="call_1"))
    assert result.applied and not result.transitions and tool.state is SpanState.EVICTABLE
    session.check()


def test_a_branch_never_reuses_span_ids_of_a_rewritten_history(tiny_model, tiny_tokenizer):
    """A pin on a message the agent later rewound stays with that (gone) span, not a branch's new one."""
    session = make(tiny_model, tiny_tokenizer).session("t")
    session.extend([*TOOL_TURN[:1], {"role": "assistant", "content": "plan", "id": "a1"}])
    session.pin("a1")
    session.extend(TOOL_TURN[:1])
    child = session.fork("b1")
    child.extend([*TOOL_TURN[:1], {"role": "assistant", "content": "branch answer"}])
    assert not child.spans[-1].pinned
    child.check()


def test_a_rewritten_tool_call_forgets_its_old_call_ids(tiny_model, tiny_tokenizer):
    """The middleware rewrote a call (new id, same text): completing the new call releases the span;
    the old id is not left pending on it forever."""
    session = make(tiny_model, tiny_tokenizer).session("t")
    session.extend(TOOL_TURN[:3])
    rewritten = {
        **TOOL_TURN[2],
        "tool_calls": [{"id": "call_9", "name": "weather", "args": {"city": "Paris"}}],
    }
    result = session.extend([*TOOL_TURN[:2], rewritten])
    assert result.first_changed_message == 2 and result.prefilled_tokens == 0
    done = session.apply(ToolCallCompleted("call_9"))
    assert [t.after for t in done.transitions] == [SpanState.EVICTABLE]
    assert not session.apply(ToolCallCompleted("call_1")).applied
    session.check()


def test_scoring_sees_the_cache_a_decode_would_see(tiny_model, tiny_tokenizer):
    """The budget is enforced after scoring (as after an answer), not between pending tail and probe."""
    budget = {"device_tokens": 120, "high_watermark": 0.6218, "low_watermark": 0.39}
    session = make(tiny_model, tiny_tokenizer, budget=budget, recall={"enabled": False}).session("t")
    history = [{"role": "system", "content": "You are a helpful assistant. " + "the " * 8 + "é é"}]
    for content in ("the the the the the ZX-99 ZX-99 é 🙂 🙂", "the the the remember secret"):
        history.append({"role": "user", "content": content})
        session.extend(history)
    session.generate(max_new_tokens=1)
    assert all(s.tier is Tier.DEVICE for s in session.spans)
    managed = session.continuation_logits([3])
    with torch.inference_mode():
        reference = tiny_model(input_ids=torch.tensor([[*session.token_ids(), 3]])).logits[0, -1:]
    assert (managed - reference.float()).abs().max().item() <= TOL
    assert any(s.state is SpanState.ARCHIVED for s in session.spans), "then the budget was enforced"
    session.check()
