"""The lifecycle on a simulated span table and store: no model, no tensors.

As SGLang tests its radix cache in a simulated mode, these tests drive the real
`LifecycleManager` (events, rules, mover, budget, leases, recall, invariants)
over a `SpanTable` and a fake store that implements `KVStoreProtocol` with
byte counts only. What they show holds for any store, the engine-backed one
included.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import pytest

from agentkv import AgentKVConfig, BranchPruned, ToolCallCompleted, TurnEnded, UserConfirmed
from agentkv.chat import ChatMessage
from agentkv.lifecycle import BudgetLimits, LifecycleManager, SpanTable
from agentkv.lifecycle.rungs import DEFAULT_FIDELITY, Rung
from agentkv.spans import Span, SpanKind, SpanState, Tier
from agentkv.store.protocol import (
    ARCHIVE_TIERS,
    KVStoreProtocol,
    MoveResult,
    SpanCosts,
    TierBytes,
    WholeSpanStore,
)

BYTES_PER_TOKEN = 10


class FakeStore(WholeSpanStore):
    """Where KV "lives", as byte counts per span; records every verb it is asked to do (whole spans only)."""

    def __init__(self) -> None:
        self.archived: dict[int, str] = {}
        """span id → archive tier name of the spans it holds off the device."""
        self.held: dict[int, int] = {}
        """span id → tokens it holds for that span (device or archive)."""
        self.calls: list[tuple[str, int]] = []
        self.states: list[tuple[int, SpanState, SpanState]] = []
        self.fail_archive = False

    def archive(self, span: Span, tier: str) -> Tier:
        if tier not in ARCHIVE_TIERS:
            raise ValueError(tier)
        if self.fail_archive:
            msg = "archive refused"
            raise RuntimeError(msg)
        self.calls.append(("archive", span.span_id))
        if tier == "drop":
            return self.drop(span)
        self.archived[span.span_id] = tier
        return Tier.HOST if tier == "host" else Tier.QUANTIZED

    def restore_many(self, spans: Sequence[Span]) -> MoveResult:
        for span in spans:
            self.calls.append(("restore", span.span_id))
            self.archived.pop(span.span_id, None)
        return MoveResult(tiers={s.span_id: Tier.DEVICE for s in spans})

    def archive_exact(self, span: Span) -> bool:
        return self.archived.get(span.span_id) == "host"

    def drop(self, span: Span) -> Tier:
        self.calls.append(("drop", span.span_id))
        self.archived.pop(span.span_id, None)
        span.kept = None
        return Tier.DROPPED

    def forget(self, span: Span) -> None:
        self.archived.pop(span.span_id, None)

    def compress(self, span: Span, keep_offsets: list[int]) -> MoveResult:
        dropped = span.held_tokens - len(keep_offsets)
        span.kept = sorted(keep_offsets)
        return MoveResult(tiers={span.span_id: span.tier}, dropped={span.span_id: dropped})

    def adopt_recomputed(self, span: Span) -> Tier:
        self.calls.append(("recompute", span.span_id))
        span.kept = None
        return Tier.DEVICE

    def note_state(self, span: Span, before: SpanState, after: SpanState) -> None:
        self.states.append((span.span_id, before, after))

    def bytes_by_tier(self) -> TierBytes:
        raise NotImplementedError  # replaced per test by the table-backed figures below

    def host_bytes(self) -> int:
        return self.bytes_by_tier().host

    def span_bytes(self, span: Span) -> int:
        return span.held_tokens * BYTES_PER_TOKEN

    @contextmanager
    def deferred_removal(self) -> Iterator[None]:
        yield

    def check(self, spans: Sequence[Span]) -> list[str]:
        problems = []
        for span in spans:
            archived = span.span_id in self.archived
            if archived != (span.tier in (Tier.HOST, Tier.QUANTIZED)):
                problems.append(f"span {span.span_id} tier {span.tier.value} but store archived={archived}")
        return problems


class FakePort:
    """The session side: a table, the fake store, and words as tokens."""

    def __init__(self, config: AgentKVConfig) -> None:
        self.session_id = "sim"
        self.config = config
        self.table = SpanTable("sim")
        self.store = FakeStore()
        self.store.bytes_by_tier = self._bytes_by_tier  # type: ignore[method-assign]
        self.vocabulary: dict[str, int] = {}
        self.recomputed: list[int] = []

    def _bytes_by_tier(self) -> TierBytes:
        per_tier = {tier: 0 for tier in Tier}
        for span in self.table.spans:
            per_tier[span.tier] += span.held_tokens * BYTES_PER_TOKEN
        device = per_tier[Tier.DEVICE] + per_tier[Tier.ATTENDED_QUANTIZED]
        return TierBytes(device, per_tier[Tier.QUANTIZED], per_tier[Tier.HOST])

    @property
    def bytes_per_token(self) -> int:
        return BYTES_PER_TOKEN

    def recompute(self, span: Span) -> None:
        self.recomputed.append(span.span_id)

    def rung_fidelity(self) -> Mapping[Rung, float]:
        return DEFAULT_FIDELITY

    def encode_text(self, text: str) -> list[int]:
        return [self.vocabulary.setdefault(word, len(self.vocabulary)) for word in text.split()]

    def token_text(self, token: int) -> str:
        # Each simulated token is one word; like byte-level BPE, it carries its leading space.
        return " " + next(word for word, i in self.vocabulary.items() if i == token)

    recomputes_offsets = False

    def recompute_offsets(self, parts: Sequence[tuple[Span, Sequence[int]]]) -> None:
        raise NotImplementedError

    def window_attention(self, token_ids: Sequence[int]) -> None:
        return None

    def background_logprobs(self) -> Any:
        return None

    def token_embeddings(self) -> Any:
        return None

    def global_device_bytes(self) -> int:
        return self._bytes_by_tier().device

    def relieve_global(self, free_bytes: int) -> int:
        return 0

    def child_branches(self) -> list[tuple[str, str | None]]:
        return []

    def close_child(self, session_id: str) -> None:
        raise AssertionError("no branches in these tests")

    # -- what the session's encoder would do ------------------------------------------------------

    def add(self, manager: LifecycleManager, kind: SpanKind, text: str, **fields: Any) -> Span:
        """Append a span whose KV is computed (a prefill), as `Session.extend` does."""
        if kind is SpanKind.USER:
            manager.on_new_user_turn()
            self.table.turn += 1
        span = self.table.new_span(kind, self.encode_text(text), branch=fields.pop("branch", None), **fields)
        span.n_computed = span.length
        manager.on_span_created(span)
        return span


def simulated(**config: Any) -> tuple[FakePort, LifecycleManager]:
    agentkv_config = AgentKVConfig.from_dict(config)
    port = FakePort(agentkv_config)
    manager = LifecycleManager(port, BudgetLimits.resolve(agentkv_config.budget, BYTES_PER_TOKEN))
    return port, manager


def test_the_fake_store_satisfies_the_protocol() -> None:
    assert isinstance(FakeStore(), KVStoreProtocol)


def test_tool_call_events_commit_the_result_and_release_the_call() -> None:
    port, manager = simulated()
    port.add(manager, SpanKind.SYSTEM, "you are helpful")
    port.add(manager, SpanKind.USER, "what is the weather")
    call = port.add(manager, SpanKind.TOOL_CALL, "weather ( )")
    manager.register_tool_call("c1", call)
    result = port.add(manager, SpanKind.TOOL_RESULT, "sunny 21 degrees", owner="c1")
    applied = manager.apply(ToolCallCompleted("c1"))
    assert applied.applied
    assert result.state is SpanState.COMMITTED and call.state is SpanState.EVICTABLE
    # The store heard of each state change (an engine pins a committed prefix on it).
    assert (result.span_id, SpanState.ACTIVE, SpanState.COMMITTED) in port.store.states
    assert manager.apply(ToolCallCompleted("c1")).applied is False  # idempotent
    manager.check()


def test_budget_pressure_demotes_the_grace_queue_first_then_archives_oldest() -> None:
    port, manager = simulated(budget={"device_tokens": 12, "low_watermark": 0.5}, archive_tier="host")
    system = port.add(manager, SpanKind.SYSTEM, "sys")
    first = port.add(manager, SpanKind.USER, "one two three")
    answer = port.add(manager, SpanKind.ASSISTANT, "four five six")
    manager.apply(TurnEnded())
    call = port.add(manager, SpanKind.TOOL_CALL, "call ( )")
    manager.register_tool_call("c", call)
    manager.apply(ToolCallCompleted("c"))  # the call is released: evictable
    assert call.state is SpanState.EVICTABLE
    port.add(manager, SpanKind.USER, "seven eight nine ten")
    manager.after_operation()
    # 14 tokens > 12: the evictable call goes first; then the oldest committed spans are archived.
    assert call.state is SpanState.EVICTED and call.tier is Tier.DROPPED
    assert first.state is SpanState.ARCHIVED and first.tier is Tier.HOST
    assert answer.state is SpanState.ARCHIVED
    assert system.pinned and system.tier is Tier.DEVICE  # pinned: never demoted
    assert manager.budget_satisfied
    assert port.store.bytes_by_tier().device <= 12 * BYTES_PER_TOKEN
    manager.check()


def test_a_lease_keeps_a_span_on_the_device_until_given_back() -> None:
    port, manager = simulated(budget={"device_tokens": 6})
    fact = port.add(manager, SpanKind.USER, "the code is 4417")
    manager.apply(UserConfirmed(owner=None))  # no assistant span yet: nothing to pin
    lease = manager.pin(span_ids=[fact.span_id], reason="keep", commit=True)
    port.add(manager, SpanKind.USER, "more text arrives here now")
    manager.after_operation()
    assert fact.state is SpanState.COMMITTED and fact.tier is Tier.DEVICE
    assert not manager.budget_satisfied  # only pinned and active spans are left
    assert manager.release(lease) and not manager.release(lease)  # a receipt works once
    manager.after_operation()
    assert fact.state is SpanState.ARCHIVED
    manager.check()


def test_host_tokens_is_a_host_budget_in_tokens() -> None:
    """`host_tokens` becomes bytes in the one place budgets do (it used to be ignored by the store)."""
    port, manager = simulated(budget={"device_tokens": 4, "host_tokens": 6, "low_watermark": 1.0})
    spans = []
    for i in range(4):
        spans.append(port.add(manager, SpanKind.USER, f"fact{i} a b"))
        manager.apply(TurnEnded())
        manager.after_operation()
    assert manager.budget.limits.host_bytes == 6 * BYTES_PER_TOKEN
    host = port.store.bytes_by_tier().host
    assert 0 < host <= 6 * BYTES_PER_TOKEN
    assert spans[0].state is SpanState.EVICTED  # the oldest archive made room
    manager.check()


def test_an_archive_the_host_cannot_keep_is_dropped_not_copied_there_first() -> None:
    """The host is the device plan's second resource: a span it would evict on arrival never goes there."""
    port, manager = simulated(
        budget={"device_tokens": 4, "host_tokens": 5, "low_watermark": 1.0}, archive_tier="host"
    )
    large = port.add(manager, SpanKind.USER, "the vendor list has six entries")
    manager.apply(TurnEnded())
    small = port.add(manager, SpanKind.USER, "code 4417")
    manager.apply(TurnEnded())
    port.add(manager, SpanKind.USER, "thanks")
    manager.after_operation()
    assert large.state is SpanState.EVICTED  # 6 tokens: more than the host's 5
    assert small.tier in (Tier.DEVICE, Tier.HOST)  # 2 tokens: kept, on the device or the host
    assert ("archive", large.span_id) not in port.store.calls
    assert ("drop", large.span_id) in port.store.calls
    assert port.store.bytes_by_tier().host <= 5 * BYTES_PER_TOKEN
    assert large.token_ids and large.span_id in manager.marks.recallable  # recall recomputes it
    manager.check()


def test_recall_brings_back_the_archived_span_the_question_names() -> None:
    port, manager = simulated(budget={"device_tokens": 8}, archive_tier="host")
    fact = port.add(manager, SpanKind.TOOL_RESULT, "the door code is 4417", owner="t")
    manager.apply(TurnEnded())
    other = port.add(manager, SpanKind.USER, "weather was sunny all week")
    manager.apply(TurnEnded())
    manager.after_operation()
    assert fact.state is SpanState.ARCHIVED
    recalled = manager.recall(ChatMessage("user", "which door code"))
    assert recalled == [fact.span_id] and fact.tier is Tier.DEVICE
    assert ("restore", fact.span_id) in port.store.calls
    manager.after_operation()  # the session enforces the budget after the prefill that follows
    assert fact.state is SpanState.COMMITTED  # recalled for this turn: the other span goes first
    assert other.state is SpanState.ARCHIVED
    manager.check()


def test_an_evicted_span_is_recomputed_from_its_tokens() -> None:
    port, manager = simulated()
    span = port.add(manager, SpanKind.USER, "an old message")
    manager.apply(TurnEnded())
    assert manager.move(span, SpanState.EVICTED, reason="test") is not None
    assert span.tier is Tier.DROPPED and span.token_ids
    assert manager.move(span, SpanState.COMMITTED, reason="needed") is not None
    assert port.recomputed == [span.span_id] and span.tier is Tier.DEVICE
    assert port.table.counters.rehydrated_tokens == span.length
    manager.check()


def test_a_failed_archive_keeps_the_span_and_records_a_fault() -> None:
    port, manager = simulated(budget={"device_tokens": 4})
    span = port.add(manager, SpanKind.USER, "keep me safe please, all of it")
    port.store.fail_archive = True
    manager.apply(TurnEnded())  # commits, then the budget check tries to archive
    assert span.state is SpanState.COMMITTED and span.tier is Tier.DEVICE
    assert port.table.counters.faults >= 1
    assert any(r.kind == "fault" for r in port.table.log)
    manager.check()


def test_a_pruned_branch_is_evicted_at_once() -> None:
    port, manager = simulated()
    port.add(manager, SpanKind.USER, "shared prefix")
    mine = port.add(manager, SpanKind.ASSISTANT, "idea b", branch="b")
    result = manager.apply(BranchPruned("b"))
    assert result.applied and mine.state is SpanState.EVICTED
    manager.check()


@pytest.mark.parametrize("bad", [SpanState.ARCHIVED, SpanState.EVICTABLE])
def test_illegal_moves_name_the_allowed_ones(bad: SpanState) -> None:
    port, manager = simulated()
    span = port.add(manager, SpanKind.USER, "text")
    manager.move(span, SpanState.EVICTED, reason="test")
    with pytest.raises(ValueError, match="allowed from evicted: committed"):
        manager.move(span, bad, reason="test")


# -- the placement planner -------------------------------------------------------------------------

QUANTIZED_TOKEN_BYTES = 2
"""A token held at int4 in the simulated attended tier (a full-precision one is `BYTES_PER_TOKEN`)."""


class FakeQuantizingStore(FakeStore):
    """`FakeStore` with an attended quantized tier: a quantized token costs `QUANTIZED_TOKEN_BYTES`."""

    def __init__(self) -> None:
        super().__init__()
        self.quantized: dict[int, int] = {}
        """span id → tokens held quantized in attention."""

    def quantize_attended_until(self, spans: Sequence[Span], free_bytes: int | None) -> MoveResult:
        freed = 0
        tiers: dict[int, Tier] = {}
        for span in spans:
            if free_bytes is not None and freed >= free_bytes:
                break
            more = self.quantizable_tokens(span)
            if more:
                self.quantized[span.span_id] = self.quantized.get(span.span_id, 0) + more
                tiers[span.span_id] = Tier.ATTENDED_QUANTIZED
            freed += more * (BYTES_PER_TOKEN - QUANTIZED_TOKEN_BYTES)
        return MoveResult(tiers=tiers, freed=freed)

    def coarsen_attended_until(self, spans: Sequence[Span], free_bytes: int) -> int:
        return 0

    def fine_key_bytes(self) -> int:
        return 0

    def attended_floor(self) -> Any:
        from agentkv.store.protocol import AttendedFloor

        return AttendedFloor(QUANTIZED_TOKEN_BYTES, BYTES_PER_TOKEN, 0, 0)

    def attended_quantized_tokens(self, span: Span | None = None) -> int:
        if span is None:
            return sum(self.quantized.values())
        return self.quantized.get(span.span_id, 0) if span.tier.attended else 0

    def quantizable_tokens(self, span: Span) -> int:
        if not span.tier.attended:
            return 0
        return span.held_tokens - self.quantized.get(span.span_id, 0)

    def attended_token_counts(self, spans: Sequence[Span]) -> dict[int, tuple[int, int]]:
        return {s.span_id: (self.attended_quantized_tokens(s), self.quantizable_tokens(s)) for s in spans}

    def attended_costs(self, spans: Sequence[Span]) -> dict[int, SpanCosts]:
        out: dict[int, SpanCosts] = {}
        for span in spans:
            if not span.tier.attended:
                continue
            q, m = self.attended_quantized_tokens(span), self.quantizable_tokens(span)
            now = (span.held_tokens - q) * BYTES_PER_TOKEN + q * QUANTIZED_TOKEN_BYTES
            coarse = now - m * (BYTES_PER_TOKEN - QUANTIZED_TOKEN_BYTES)
            archived = span.held_tokens * BYTES_PER_TOKEN // 4  # what `quantizing`'s accounting counts
            host = span.held_tokens * BYTES_PER_TOKEN
            costs = SpanCosts(span.held_tokens, q, 0, m, now, None, coarse, archived, archived, host)
            out[span.span_id] = costs
        return out

    def quantized_offsets(self, span: Span) -> list[int]:
        return span.kept_offsets[: self.attended_quantized_tokens(span)]

    def recompute_pending(self, span: Span) -> Tier:
        self.quantized.pop(span.span_id, None)
        return Tier.DEVICE

    def drop(self, span: Span) -> Tier:
        self.quantized.pop(span.span_id, None)
        return super().drop(span)

    def archive(self, span: Span, tier: str) -> Tier:
        self.quantized.pop(span.span_id, None)
        return super().archive(span, tier)

    def check(self, spans: Sequence[Span]) -> list[str]:
        problems = super().check(spans)
        for span in spans:
            quantized = self.attended_quantized_tokens(span) > 0
            if quantized != (span.tier is Tier.ATTENDED_QUANTIZED):
                problems.append(f"span {span.span_id} tier {span.tier.value} but {quantized=}")
        return problems


def quantizing(**config: Any) -> tuple[FakePort, LifecycleManager]:
    agentkv_config = AgentKVConfig.from_dict(config)
    port = FakePort(agentkv_config)
    store = FakeQuantizingStore()
    port.store = store

    def bytes_by_tier() -> TierBytes:
        device = host = quantized = 0
        for span in port.table.spans:
            if span.tier.attended:
                q = store.quantized.get(span.span_id, 0)
                device += (span.held_tokens - q) * BYTES_PER_TOKEN + q * QUANTIZED_TOKEN_BYTES
            elif span.tier is Tier.HOST:
                host += span.held_tokens * BYTES_PER_TOKEN
            elif span.tier is Tier.QUANTIZED:
                quantized += span.held_tokens * BYTES_PER_TOKEN // 4
        return TierBytes(device, quantized, host)

    store.bytes_by_tier = bytes_by_tier  # type: ignore[method-assign]
    port._bytes_by_tier = bytes_by_tier  # type: ignore[method-assign]
    manager = LifecycleManager(port, BudgetLimits.resolve(agentkv_config.budget, BYTES_PER_TOKEN))
    return port, manager


def conversation(port: FakePort, manager: LifecycleManager, turns: int, seed: int) -> list[Span]:
    """A system prompt and `turns` user/answer/tool turns of pseudo-random lengths, each turn ended."""
    import random

    rng = random.Random(seed)
    spans = [port.add(manager, SpanKind.SYSTEM, " ".join(f"s{i}" for i in range(rng.randint(2, 8))))]
    for t in range(turns):
        for kind in (SpanKind.USER, SpanKind.ASSISTANT, SpanKind.TOOL_RESULT):
            words = " ".join(f"w{t}x{i}" for i in range(rng.randint(1, 30)))
            span = port.add(manager, kind, words)
            span.score = rng.random() * 3
            spans.append(span)
        manager.apply(TurnEnded())
    return spans


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("archive_tier", ["host", "int8", "drop"])
def test_the_planner_meets_the_limit_and_never_demotes_pinned_or_active_spans(
    seed: int, archive_tier: str
) -> None:
    port, manager = quantizing(budget={"device_tokens": 40}, archive_tier=archive_tier)
    spans = conversation(port, manager, turns=5, seed=seed)
    pinned = spans[2]
    manager.pin(span_ids=[pinned.span_id], reason="confirmed", commit=True)
    active = port.add(manager, SpanKind.USER, "the new question arrives now")
    manager.after_operation()
    usage = manager.budget.usage_bytes()
    limit = manager.budget.limits.device_bytes
    assert limit is not None and usage <= manager.budget.limits.high_bytes(limit)
    assert manager.budget_satisfied
    for span in (spans[0], pinned, active):
        assert span.tier.attended and span.state not in (SpanState.ARCHIVED, SpanState.EVICTED)
    assert active.state is SpanState.ACTIVE
    manager.check()


def test_every_span_is_held_at_int4_before_any_leaves_attention() -> None:
    port, manager = quantizing(budget={"device_tokens": 60})
    spans = conversation(port, manager, turns=4, seed=1)
    manager.after_operation()
    store = port.store
    assert isinstance(store, FakeQuantizingStore)
    assert all(s.tier.attended for s in spans), "int4 in attention fits all of it"
    assert store.attended_quantized_tokens() > 0 and manager.budget_satisfied
    # The tier says which spans are held quantized in attention: the store agrees span by span.
    assert any(s.tier is Tier.ATTENDED_QUANTIZED for s in spans)
    for span in spans:
        assert (span.tier is Tier.ATTENDED_QUANTIZED) == (store.attended_quantized_tokens(span) > 0)


def test_a_pinned_prompt_larger_than_the_budget_is_held_at_int4_never_dropped() -> None:
    port, manager = quantizing(budget={"device_tokens": 20})
    prompt = port.add(manager, SpanKind.SYSTEM, " ".join(f"tool{i}" for i in range(60)))
    assert prompt.pinned
    port.add(manager, SpanKind.USER, "hi")
    manager.after_operation()
    store = port.store
    assert isinstance(store, FakeQuantizingStore)
    assert prompt.tier is Tier.ATTENDED_QUANTIZED and prompt.state is SpanState.COMMITTED
    assert store.attended_quantized_tokens(prompt) == prompt.length  # the cheaper rung, still attended


def value_lost(port: FakePort, store: FakeQuantizingStore) -> float:
    """What the held set lost: a span's score times the share of it not held at full precision."""
    lost = 0.0
    for span in port.table.spans:
        if not span.tier.attended:
            lost += span.score
        else:
            lost += 0.25 * span.score * store.attended_quantized_tokens(span) / max(1, span.held_tokens)
    return lost


@pytest.mark.parametrize("seed", range(4))
def test_more_budget_never_loses_more_value(seed: int) -> None:
    """Monotone in the budget: each larger limit leaves at least as much attended, losing no more."""
    results = []
    for tokens in (20, 40, 80, 160, 320):
        port, manager = quantizing(budget={"device_tokens": tokens})
        conversation(port, manager, turns=6, seed=seed)
        manager.after_operation()
        store = port.store
        assert isinstance(store, FakeQuantizingStore)
        attended = sum(s.held_tokens for s in port.table.spans if s.tier.attended)
        results.append((attended, value_lost(port, store)))
    for (fewer, lost_small), (more, lost_large) in zip(results, results[1:], strict=False):
        assert more >= fewer and lost_large <= lost_small + 1e-9, results


def test_plan_placement_takes_attended_steps_first_and_the_cheapest_closing_step() -> None:
    from agentkv.lifecycle.placement import plan_placement
    from agentkv.lifecycle.rungs import Rung, RungOption, SpanOptions

    def span(span_id: int, tokens: int, value: float, klass: int = 0) -> SpanOptions:
        options = (
            RungOption(Rung.FULL, tokens * 10, 0.0),
            RungOption(Rung.ATTENDED_Q, tokens * 2, 0.25),
            RungOption(Rung.ARCHIVED, 0, 0.9),
        )
        return SpanOptions(span_id, value, options, klass=klass, order=span_id)

    choices = [span(1, 100, 1.0), span(2, 10, 5.0, klass=1), span(3, 50, 0.1)]
    usage = 1600
    # Int4 for all three is 320 bytes: reached without archiving anything.
    plan = plan_placement(choices, usage, target=400)
    assert set(plan.rungs.values()) == {Rung.ATTENDED_Q} and plan.met
    # The needed span (class 1) is the last to be quantized.
    plan = plan_placement(choices, usage, target=1200)
    assert 2 not in plan.rungs and plan.met
    # Below int4 for all (old order, by name), the span of least value per byte leaves attention first.
    plan = plan_placement(choices, usage, target=250, order="attended_first")
    assert plan.rungs[3] is Rung.ARCHIVED and plan.rungs.get(2) is Rung.ATTENDED_Q and plan.met
    # A limit nothing can meet archives every archivable span and says so.
    assert not plan_placement(choices, usage, target=-1).met


def test_the_needed_span_stays_at_full_precision_until_the_rest_is_archived() -> None:
    """`needed_last`: the spans the question needs give up int4 only after every other span left attention."""
    from agentkv.lifecycle.placement import plan_placement
    from agentkv.lifecycle.rungs import Rung, RungOption, SpanOptions

    def span(span_id: int, tokens: int, value: float, klass: int = 0) -> SpanOptions:
        options = (
            RungOption(Rung.FULL, tokens * 10, 0.0),
            RungOption(Rung.ATTENDED_Q, tokens * 2, 0.25),
            RungOption(Rung.ARCHIVED, 0, 0.9),
        )
        return SpanOptions(span_id, value, options, klass=klass, order=span_id)

    needed = span(2, 10, 5.0, klass=1)
    choices = [span(1, 100, 1.0), needed, span(3, 50, 0.1)]
    usage = 1600
    # Archiving the rest meets the limit: the needed span is not touched (the old order quantized it).
    plan = plan_placement(choices, usage, target=250, order="needed_last")
    assert plan.rungs == {1: Rung.ARCHIVED, 3: Rung.ARCHIVED} and plan.met
    # With nothing else left to give, the needed span goes to int4, then out of attention.
    plan = plan_placement(choices, usage, target=20, order="needed_last")
    assert plan.rungs[2] is Rung.ATTENDED_Q and plan.met
    assert plan_placement(choices, usage, target=0, order="needed_last").rungs[2] is Rung.ARCHIVED
    # A pinned or active span's int4 still comes before the rest is archived.
    pinned = span(4, 10, 5.0, klass=3)
    plan = plan_placement([span(1, 100, 1.0), pinned], 1100, target=250, order="needed_last")
    assert plan.rungs == {1: Rung.ATTENDED_Q, 4: Rung.ATTENDED_Q}
    with pytest.raises(ValueError, match="unknown placement order"):
        plan_placement(choices, usage, target=250, order="nope")


@pytest.mark.parametrize("seed", range(8))
def test_both_limits_hold_through_recall_and_every_budget_check(seed: int) -> None:
    """Device and host budgets, recall asking the plan for spans back at each question: after every
    operation the device usage is under its limit whenever the budget says it is met, the host under
    its own (no span copied there and dropped by the same check), and a span recalled for the turn
    is attended."""
    import random

    rng = random.Random(seed)
    port, manager = quantizing(
        budget={"device_tokens": rng.randint(20, 60), "host_tokens": rng.randint(4, 60)}, archive_tier="host"
    )
    enforce = manager.budget.enforce

    def one_plan() -> None:
        before = len(port.store.calls)
        enforce()
        moves = port.store.calls[before:]
        archived = {i for verb, i in moves if verb == "archive"}
        assert not {i for verb, i in moves if verb == "drop"} & archived, "copied to the host, then dropped"

    manager.budget.enforce = one_plan  # type: ignore[method-assign]
    spans = conversation(port, manager, turns=4, seed=seed)
    limits = manager.budget.limits
    device_limit, host_limit = limits.device_bytes, limits.host_bytes
    assert device_limit is not None and host_limit is not None
    for _ in range(4):
        asked = rng.sample(spans, k=2)
        words = [port.token_text(t).strip() for span in asked for t in span.token_ids[:2]]
        recalled = manager.recall(ChatMessage("user", " ".join(words)))
        for span_id in recalled:
            assert port.table.span(span_id).tier.attended
        spans.append(port.add(manager, SpanKind.USER, " ".join(words)))
        manager.after_operation()
        if manager.budget_satisfied:
            assert manager.budget.usage_bytes() <= limits.high_bytes(device_limit)
        assert port.store.host_bytes() <= limits.high_bytes(host_limit)
        manager.apply(TurnEnded())
        manager.after_operation()
        manager.check()
