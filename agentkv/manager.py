"""The lifecycle manager: events → transitions → store moves, budgets and recall.

One manager per session. It is the only place where lifecycle state and storage
tier change together, so the invariants (`check()`) are written next to the code
that could break them.

Two budget modes:
- *span mode* (policy `lifecycle`): pressure demotes whole spans — evictable
  first, then the lowest-scored committed ones are archived, then archives beyond
  their budget are evicted. Spans are compressed once, at commit, and then frozen.
- *token mode* (generic baselines: window, StreamingLLM, H2O, SnapKV, …): pressure
  re-scores every attended token and keeps the top ones, as those methods do.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import types
import typing
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from agentkv.backend.runner import Feed
from agentkv.chat import ChatMessage
from agentkv.events import (
    EVENT_TYPES,
    BranchOpened,
    BranchPruned,
    BranchSelected,
    Custom,
    Event,
    SessionClosed,
    ToolCallCompleted,
    ToolCallFailed,
    TurnEnded,
    UserConfirmed,
    UserRejected,
)
from agentkv.lifecycle import ACTION_STATES, TRANSITIONS, Lease, Rules, check_transition
from agentkv.policies import AttentionProbe, LifecyclePolicy, Policy, SpanView, make_policy
from agentkv.recall import choose_within_room, rank_for_recall
from agentkv.spans import Span, SpanKind, SpanState, Tier
from agentkv.store.block import tensor_bytes

if TYPE_CHECKING:
    from agentkv.session import Session

logger = logging.getLogger("agentkv.lifecycle")

DEMOTED_STATES = frozenset({SpanState.ARCHIVED, SpanState.EVICTABLE, SpanState.EVICTED})
ATTENTION_DECAY = 0.9


def validate_event(event: object) -> None:
    """Reject what is not a well-formed event, before it reaches the session's state.

    Events come from integrations and user code; a wrong type should be a clear
    error naming the field, not an `AttributeError` deep in the manager or an
    "unhashable type" from the idempotence set (events are deduplicated by value).

    Raises:
        TypeError: `event` is not an `Event`, a field has the wrong type, or the event
            cannot be hashed (so it could not be applied idempotently).
    """
    if not isinstance(event, Event):
        kinds = ", ".join(cls.__name__ for cls in EVENT_TYPES)
        msg = f"expected an agentkv Event ({kinds} or Custom), got {type(event).__name__}: {event!r:.80}"
        raise TypeError(msg)
    for name, allowed in _field_types(type(event)).items():
        value = getattr(event, name)
        if not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed):
            names = " | ".join("None" if t is type(None) else t.__name__ for t in allowed)
            msg = f"{type(event).__name__}.{name}: expected {names}, got {type(value).__name__} {value!r:.80}"
            raise TypeError(msg)
    try:
        hash(event)
    except TypeError as e:
        msg = f"{type(event).__name__} must be hashable to be applied idempotently (a frozen dataclass): {e}"
        raise TypeError(msg) from e


_FIELD_TYPES: dict[type, dict[str, tuple[type, ...]]] = {}


def _field_types(cls: type) -> dict[str, tuple[type, ...]]:
    """For each field of an event class with a simple annotation, the types it accepts (cached)."""
    cached = _FIELD_TYPES.get(cls)
    if cached is not None:
        return cached
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # noqa: BLE001 - a user event with annotations we cannot resolve: no checks
        hints = {}
    out: dict[str, tuple[type, ...]] = {}
    for f in dataclasses.fields(cls):
        hint = hints.get(f.name)
        options = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
        allowed: list[type] = []
        for option in options:
            origin = typing.get_origin(option) or option  # Mapping[str, Any] -> Mapping
            if not isinstance(origin, type):
                break  # an annotation we do not understand: leave the field alone
            allowed.append(origin)
        else:
            out[f.name] = tuple(allowed)
    _FIELD_TYPES[cls] = out
    return out


@dataclass(frozen=True)
class Transition:
    """One span's move."""

    span_id: int
    before: SpanState
    after: SpanState
    tier: Tier
    reason: str


@dataclass(frozen=True)
class ApplyResult:
    """What `Session.apply(event)` did."""

    event: str
    applied: bool
    """False for a no-op (duplicate, unknown target, span already evicted)."""
    transitions: tuple[Transition, ...] = ()
    leases: tuple[Lease, ...] = ()
    reason: str = ""


@dataclass
class _Budget:
    limit_bytes: int | None
    high: float
    low: float
    host_limit_bytes: int | None
    global_limit_bytes: int | None


@dataclass
class _TurnState:
    recalled: set[int] = field(default_factory=set)
    relevance: dict[int, float] = field(default_factory=dict)
    """Recall score of each span recalled this turn (the least relevant goes first under pressure)."""


class LifecycleManager:
    """Applies events, enforces budgets and recalls archived spans for one session."""

    def __init__(self, session: Session) -> None:
        self.session = session
        config = session.config
        self.rules = Rules(config.rules)
        self.policy: Policy | None = make_policy(config.policy.name, config.policy.params)
        self.span_mode = config.policy.name in ("lifecycle", "full")
        self.full = config.policy.name == "full"
        self.archive_tier = config.archive_tier
        bpt = session.runner.bytes_per_token
        b = config.budget
        limit = (
            b.device_bytes
            if b.device_bytes is not None
            else (b.device_tokens * bpt if b.device_tokens else None)
        )
        host = b.host_bytes if b.host_bytes is not None else (b.host_tokens * bpt if b.host_tokens else None)
        self.budget = _Budget(limit, b.high_watermark, b.low_watermark, host, b.global_device_bytes)
        if self.full and limit is not None:
            logger.warning(
                "policy 'full' keeps every token: the device budget is reported but never enforced"
            )
        self.tool_calls: dict[str, int] = {}
        self.tool_calls_done: set[str] = set()
        self.applied: set[Any] = set()
        self.budget_satisfied = True
        self.last_limit: int | None = None
        """The device limit the last `after_operation` enforced (`check` holds usage to it)."""
        self.recallable: set[int] = set()
        self.turn_state = _TurnState()
        self.system_lease: Lease | None = None
        self.branches_seen: set[str] = set()
        self._token_keys: dict[int, str] = {}
        self._recall_memo: dict[Any, Any] = {}
        """Per-span recall features and embeddings, computed once (`rank_for_recall(memo=...)`)."""
        self._timing_stack: list[list[float]] = []

    # -- timing ---------------------------------------------------------------------------------

    @contextmanager
    def _timed(self, counter: str) -> Iterator[None]:
        """Charge the time spent inside to `counter`, excluding nested sections and model forwards.

        Sections nest: a budget check (`lifecycle_seconds`) moves spans (`store_seconds`),
        a commit scores them (`policy_seconds`), a recomputed span runs the model inside
        `store_seconds`. Charging each section only its own time makes lifecycle + policy
        + store add up to the overhead without double counting, and keeps forwards in
        `forward_seconds` alone.
        """
        counters = self.session.counters
        frame = [0.0, 0.0]  # [elapsed of nested sections, forward seconds inside them]
        self._timing_stack.append(frame)
        started = time.perf_counter()
        forward_before = counters.forward_seconds
        try:
            yield
        finally:
            self._timing_stack.pop()
            elapsed = time.perf_counter() - started
            forward = counters.forward_seconds - forward_before
            own = max(0.0, elapsed - frame[0] - (forward - frame[1]))
            setattr(counters, counter, getattr(counters, counter) + own)
            if self._timing_stack:
                self._timing_stack[-1][0] += elapsed
                self._timing_stack[-1][1] += forward

    # -- hooks from the session -----------------------------------------------------------------

    def on_span_created(self, span: Span) -> None:
        """System prompts are pinned (span mode): the agent's instructions never go."""
        if span.kind is SpanKind.SYSTEM and self.span_mode:
            lease = Lease.new(self.session.session_id, (span.span_id,), "system prompt")
            span.leases.add(lease.lease_id)
            self.session.leases[lease.lease_id] = lease

    def on_span_removed(self, span: Span) -> None:
        """Forget registrations of a span removed by a history rewrite."""
        for call_id, span_id in list(self.tool_calls.items()):
            if span_id == span.span_id:
                del self.tool_calls[call_id]
        self.recallable.discard(span.span_id)

    def register_tool_call(self, call_id: str, span: Span) -> None:
        """Remember which span made a tool call, so `ToolCallCompleted` can release it."""
        self.tool_calls[call_id] = span.span_id

    def on_new_user_turn(self) -> None:
        """A new user message ends the previous turn (an implicit `TurnEnded`)."""
        session = self.session
        if any(s.state is SpanState.ACTIVE and s.turn == session.turn for s in session.spans):
            self._apply_turn_ended(TurnEnded(turn=session.turn), implicit=True)
        self.turn_state = _TurnState()

    def inherit(self, parent: LifecycleManager) -> None:
        """A fork starts with its parent's registrations."""
        self.tool_calls = dict(parent.tool_calls)
        self.tool_calls_done = set(parent.tool_calls_done)
        self.recallable = set(parent.recallable)

    # -- forwards with the attention signal ----------------------------------------------------

    def observed_forward(self, feed: Feed, **kwargs: Any) -> torch.Tensor | None:
        """Run a forward; on prefills, collect the attention signal when the policy uses it."""
        session = self.session
        physical = session.store.physical
        wants = self.policy is not None and self.policy.needs_attention and len(feed) > 1
        if not wants or kwargs.get("attention_mask") is not None:
            return session.runner.forward(physical, feed, **kwargs)
        window = min(len(feed), session.config.commit.window)
        with AttentionProbe(session.runner.model, window=window) as probe:
            logits = session.runner.forward(physical, feed, **kwargs)
        attention = probe.attention()
        if attention is not None:
            physical.accumulate_attention(attention, ATTENTION_DECAY)
        return logits

    # -- events ---------------------------------------------------------------------------------

    def apply(self, event: Event) -> ApplyResult:
        """Resolve an event's targets with the rules and move them (idempotent)."""
        validate_event(event)
        with self._timed("lifecycle_seconds"):
            key = self._event_key(event)
            if key in self.applied:
                return self._noop(event, "duplicate event")
            if isinstance(event, TurnEnded):
                result = self._apply_turn_ended(event)
            else:
                result = self._apply_targets(event, self._targets(event))
            if result.applied:
                self.applied.add(key)
        self.after_operation()
        return result

    def _event_key(self, event: Event) -> Any:
        if isinstance(event, TurnEnded) and event.turn is None:
            return (event.name, self.session.turn)
        return (event.name, event)

    def _noop(self, event: Event, reason: str, internal: bool = False) -> ApplyResult:
        self._count(applied=False, internal=internal)
        logger.info("session %s: %s ignored: %s", self.session.session_id, event.name, reason)
        self.session._record("event", event=event.name, applied=False, reason=reason)
        return ApplyResult(event.name, applied=False, reason=reason)

    def _targets(self, event: Event) -> dict[str, list[Span]]:
        spans = self.session.spans
        if isinstance(event, (ToolCallCompleted, ToolCallFailed)):
            result = [s for s in spans if s.kind is SpanKind.TOOL_RESULT and s.owner == event.tool_call_id]
            call_span = self.tool_calls.get(event.tool_call_id)
            calls = [s for s in spans if s.span_id == call_span]
            self.tool_calls_done.add(event.tool_call_id)
            # A call span with several calls is released only when all of them are done.
            pending = {c for c, sid in self.tool_calls.items() if sid == call_span} - self.tool_calls_done
            return {"result": result, "call": [] if pending else calls}
        if isinstance(event, (UserConfirmed, UserRejected)):
            if event.owner is None:
                assistant = [s for s in spans if s.kind in (SpanKind.ASSISTANT, SpanKind.TOOL_CALL)]
                return {"target": assistant[-1:]}
            return {"target": self.session.spans_owned_by(event.owner)}
        if isinstance(event, BranchPruned):
            return {"branch": [s for s in spans if s.branch == event.branch]}
        if isinstance(event, BranchSelected):
            branch = [s for s in spans if s.branch == event.branch]
            siblings = [s for s in spans if s.branch is not None and s.branch != event.branch]
            return {"branch": branch, "siblings": siblings}
        if isinstance(event, SessionClosed):
            return {"all": list(spans)}
        if isinstance(event, Custom):
            return {"owner": self.session.spans_owned_by(event.owner) if event.owner else []}
        if isinstance(event, BranchOpened):
            return {}
        return {}

    def _branch_known(self, branch: str) -> bool:
        return branch in self.branches_seen

    def _settle_branch_sessions(self, event: BranchPruned | BranchSelected) -> None:
        """Close the branch sessions an event settles.

        A pruned branch's session is closed (its own KV freed, the shared prefix stays);
        selecting a branch closes its siblings' sessions.
        """
        backend = self.session.backend
        prefix = f"{self.session.session_id}/"
        for child in list(backend.sessions()):
            if not child.session_id.startswith(prefix) or child.parent is not self.session:
                continue
            branch = child.branch
            self.branches_seen.add(branch or "")
            pruned = isinstance(event, BranchPruned) and branch == event.branch
            sibling = isinstance(event, BranchSelected) and branch != event.branch
            if pruned or sibling:
                backend.close(child.session_id)
                self.session._record("branch", closed=child.session_id, reason=event.name)

    def _rules_for(self, event: Event) -> dict[str, str]:
        if isinstance(event, Custom):
            return self.rules.actions(f"custom:{event.event}")
        return self.rules.actions(event.name)

    def _count(self, *, applied: bool, internal: bool) -> None:
        """Count an event: internal ones (implicit turn ends) apart from what the user's run sent."""
        counters = self.session.counters
        if internal:
            counters.events_internal += 1
        elif applied:
            counters.events_applied += 1
        else:
            counters.events_noop += 1

    def _apply_targets(
        self, event: Event, targets: dict[str, list[Span]], *, internal: bool = False
    ) -> ApplyResult:
        if isinstance(event, BranchOpened):
            self.branches_seen.add(event.branch)
            self.session._record("event", event=event.name, branch=event.branch)
            self.session.counters.events_applied += 1
            return ApplyResult(event.name, applied=True)
        if isinstance(event, (BranchPruned, BranchSelected)):
            self._settle_branch_sessions(event)
        if not any(targets.values()):
            if isinstance(event, (BranchPruned, BranchSelected)) and self._branch_known(event.branch):
                self.session.counters.events_applied += 1
                return ApplyResult(event.name, applied=True, reason="branch sessions settled")
            return self._noop(
                event, "no span matches its target (unknown owner or already removed)", internal
            )
        live = {t: [s for s in spans if s.state is not SpanState.EVICTED] for t, spans in targets.items()}
        if not any(live.values()):
            return self._noop(event, "its spans were already evicted", internal)
        transitions: list[Transition] = []
        leases: list[Lease] = []
        for target, action in self._rules_for(event).items():
            spans = live.get(target, [])
            if action == "pin" and spans:
                lease = self.pin(span_ids=[s.span_id for s in spans], reason=event.name, commit=True)
                leases.append(lease)
                continue
            if action == "unpin":
                for span in spans:
                    self._unpin_all(span)
                continue
            state = ACTION_STATES[action]
            if state is None:
                continue
            for span in spans:
                if span.state is not state and state not in TRANSITIONS[span.state]:
                    # A rule naming a move its target's state does not allow (archiving a span
                    # already released) is a hint that no longer applies, not an error.
                    logger.debug(
                        "span %s is %s: %s does not %s it", span.span_id, span.state.value, event.name, action
                    )
                    continue
                moved = self.move(span, state, reason=event.name)
                if moved is not None:
                    transitions.append(moved)
        self._count(applied=True, internal=internal)
        self.session._record(
            "event",
            event=event.name,
            applied=True,
            transitions=[(t.span_id, t.after.value) for t in transitions],
        )
        return ApplyResult(event.name, applied=True, transitions=tuple(transitions), leases=tuple(leases))

    def _apply_turn_ended(self, event: TurnEnded, *, implicit: bool = False) -> ApplyResult:
        session = self.session
        turn = session.turn if event.turn is None else event.turn
        spans = [s for s in session.spans if s.turn == turn]
        if not spans:
            return self._noop(event, f"turn {turn} has no spans", implicit)
        answers = [s for s in spans if s.kind is SpanKind.ASSISTANT]
        targets = {
            "user": [s for s in spans if s.kind in (SpanKind.USER, SpanKind.SYSTEM)],
            "answer": answers[-1:],
            "reasoning": [s for s in spans if s.kind is SpanKind.REASONING] + answers[:-1],
            "tool_calls": [s for s in spans if s.kind is SpanKind.TOOL_CALL],
            "tool_results": [s for s in spans if s.kind is SpanKind.TOOL_RESULT],
            "prompt": [s for s in spans if s.kind is SpanKind.PROMPT],
        }
        # Only spans still ACTIVE are moved by a turn end: earlier events already decided the rest.
        targets = {t: [s for s in ss if s.state is SpanState.ACTIVE] for t, ss in targets.items()}
        result = self._apply_targets(event, targets, internal=implicit)
        if implicit and result.applied:
            self.applied.add(("turn_ended", turn))
        return result

    # -- transitions ------------------------------------------------------------------------------

    def move(self, span: Span, target: SpanState, *, reason: str) -> Transition | None:
        """Move one span to `target`, doing the store work the move needs. None when nothing changed."""
        if span.state is target:
            return None
        if span.pinned and target in DEMOTED_STATES:
            logger.debug("span %s is pinned: %s does not demote it", span.span_id, reason)
            return None
        check_transition(span.state, target, reason)
        before = span.state
        store = self.session.store
        with self._timed("store_seconds"):
            if target is SpanState.COMMITTED:
                if span.tier is not Tier.DEVICE and not self._bring_back(span):
                    self._settle_failed_bring_back(span)
                    return None
                if not span.frozen:
                    self._compress_at_commit(span)
            elif target is SpanState.ARCHIVED:
                if span.tier is Tier.DEVICE and not self._archive(span):
                    return None
                if span.tier is Tier.DROPPED:
                    target = SpanState.EVICTED
            elif target is SpanState.EVICTED:
                store.drop(span)
                self.recallable.discard(span.span_id)
        span.state = target
        self.session.counters.transitions += 1
        logger.debug(
            "session %s span %s (%s): %s -> %s [%s] on %s",
            self.session.session_id,
            span.span_id,
            span.kind.value,
            before.value,
            target.value,
            span.tier.value,
            reason,
        )
        return Transition(span.span_id, before, target, span.tier, reason)

    def _settle_failed_bring_back(self, span: Span) -> None:
        """After a restore *and* its recompute failed, say what is true: the KV is gone.

        The failed restore already dropped the archived block to fall back on
        recomputing; when the recompute fails too, an ARCHIVED span would claim KV it
        no longer has. It becomes EVICTED: its token ids remain, so a later recall
        (or `move(span, COMMITTED)`) recomputes it.
        """
        if span.tier is Tier.DROPPED and span.state is not SpanState.EVICTED:
            before = span.state
            span.state = SpanState.EVICTED
            self.session.counters.transitions += 1
            self.session._record(
                "transition",
                span=span.span_id,
                before=before.value,
                after="evicted",
                reason="restore and recompute failed",
            )

    def _archive(self, span: Span) -> bool:
        """Archive to the configured tier; on failure keep the span on the device (a recorded fault)."""
        try:
            self.session.store.archive(span, self.archive_tier)
        except Exception as e:  # noqa: BLE001 - a failed offload must never lose the span
            self._fault("archive", span, e)
            return False
        return True

    def _bring_back(self, span: Span) -> bool:
        """Restore an archived span, or recompute a dropped one."""
        session = self.session
        if span.tier in (Tier.HOST, Tier.QUANTIZED):
            try:
                session.store.restore(span)
                session.counters.restored_tokens += span.held_tokens
                return True
            except Exception as e:  # noqa: BLE001 - fall back to recomputing from the token ids
                self._fault("restore", span, e)
                session.store.drop(span)
        return self.rehydrate(span)

    def rehydrate(self, span: Span) -> bool:
        """Recompute a dropped span's KV from its token ids at its logical positions.

        Exact when every token logically before the span is attended at full
        precision; otherwise the span is recomputed against what the cache holds
        now (an approximation, as with any lazy rehydration).
        """
        session = self.session
        if span.tier is not Tier.DROPPED:
            return True
        positions = list(range(span.start, span.start + span.n_computed))
        if not positions:
            span.tier = Tier.DEVICE
            return True
        feed = Feed(
            span.token_ids[: span.n_computed],
            positions,
            [span.span_id] * len(positions),
            list(range(len(positions))),
        )
        try:
            session.store.physical.compact_pending()
            mask = session.runner.logical_mask(session.store.physical, positions)
            with session.backend.model_lock:
                session._forward(feed, logits="none", attention_mask=mask)
        except Exception as e:  # noqa: BLE001
            self._fault("rehydrate", span, e)
            return False
        span.tier = Tier.DEVICE
        span.kept = None
        span.frozen = False
        session.counters.rehydrated_tokens += len(positions)
        return True

    def _fault(self, where: str, span: Span | None, error: Exception) -> None:
        self.session.counters.faults += 1
        span_id = None if span is None else span.span_id
        logger.warning(
            "session %s: %s of span %s failed (%s); kept safe", self.session.session_id, where, span_id, error
        )
        self.session._record("fault", where=where, span=span_id, error=repr(error))

    # -- commit-time compression -----------------------------------------------------------------

    def _view(self, slots: torch.Tensor) -> SpanView:
        session = self.session
        physical = session.store.physical
        keys = []
        for layer in range(physical.num_layers):
            layer_keys = physical.layer_keys(layer)
            if layer_keys is None:
                msg = "empty cache"
                raise RuntimeError(msg)
            keys.append(layer_keys.index_select(-2, slots.to(layer_keys.device)))
        kinds = {s.span_id: s.kind for s in session.spans}
        recent = torch.arange(max(0, physical.length - 16), physical.length)
        query_keys = tuple(
            k.index_select(-2, recent.to(k.device))
            for k in (physical.layer_keys(i) for i in range(physical.num_layers))
            if k is not None
        )
        return SpanView(
            keys=tuple(keys),
            positions=physical.slot_position[slots],
            span_ids=physical.slot_span[slots],
            span_kinds=kinds,
            sequence_length=session.logical_length,
            attention=physical.slot_attention[slots],
            accumulated_attention=physical.slot_attention[slots],
            query_keys=query_keys,
        )

    def _compress_at_commit(self, span: Span) -> None:
        """Score the span once (and keep its top tokens if its kind has a keep ratio), then freeze it."""
        session = self.session
        physical = session.store.physical
        slots = physical.slots_of(span.span_id)
        span.frozen = True
        if self.policy is None or slots.numel() == 0 or not self.span_mode:
            return
        try:
            with self._timed("policy_seconds"):
                view = self._view(slots)
                scores = self.policy.score(view).float()
                span.score = float(scores.mean()) if scores.numel() else 0.0
                if isinstance(self.policy, LifecyclePolicy):
                    span.score = float(self.policy.span_score(view).get(span.span_id, span.score))
                ratio = session.config.commit.keep_ratio.get(span.kind.value, 1.0)
                keep = max(session.config.commit.min_keep_tokens, round(ratio * slots.numel()))
                if keep >= slots.numel():
                    return
                chosen = self.policy.select(view, keep)
            offsets = physical.slot_offset[slots[chosen]].tolist()
            dropped = session.store.compress(span, offsets)
            session.counters.compressed_tokens += dropped
        except Exception as e:  # noqa: BLE001 - a failing policy keeps the whole span
            self._fault("policy", span, e)

    # -- pins ------------------------------------------------------------------------------------

    def pin(
        self,
        *,
        owner: str | None = None,
        span_ids: Sequence[int] | None = None,
        reason: str = "",
        commit: bool = False,
    ) -> Lease:
        """Pin spans by owner or id; returns the receipt. Unknown owners give an empty lease."""
        session = self.session
        if span_ids is None:
            spans = session.spans_owned_by(owner) if owner else []
        else:
            wanted = set(span_ids)
            spans = [s for s in session.spans if s.span_id in wanted]
        pinned: list[Span] = []
        for span in spans:
            if span.state is SpanState.EVICTED:
                continue
            # A pinned span is never demoted, so one that already was (released, archived)
            # comes back first; one that cannot (a restore and its recompute failed) is not pinned.
            if (commit and span.state is not SpanState.COMMITTED) or span.state in DEMOTED_STATES:
                self.move(span, SpanState.COMMITTED, reason=reason or "pin")
            if span.state not in DEMOTED_STATES:
                pinned.append(span)
        spans = pinned
        lease = Lease.new(session.session_id, tuple(s.span_id for s in spans), reason)
        for span in spans:
            span.leases.add(lease.lease_id)
        session.leases[lease.lease_id] = lease
        if not spans:
            session.counters.events_noop += 1
            logger.info("session %s: pin of %r matched no live span", session.session_id, owner)
        return lease

    def release(self, lease: Lease) -> bool:
        """Give a lease back; only that lease's pins go."""
        session = self.session
        if session.leases.get(lease.lease_id) != lease:
            return False
        del session.leases[lease.lease_id]
        for span in session.spans:
            span.leases.discard(lease.lease_id)
        return True

    def _unpin_all(self, span: Span) -> None:
        for lease_id in list(span.leases):
            lease = self.session.leases.get(lease_id)
            if lease is not None:
                self.release(lease)

    # -- budgets ---------------------------------------------------------------------------------

    def usage_bytes(self) -> int:
        """What the device budget counts: attended KV plus quantized archives (both on the device)."""
        tiers = self.session.store.bytes_by_tier()
        return tiers.device + tiers.quantized

    def _effective_limit(self) -> int | None:
        limit = self.budget.limit_bytes
        global_limit = self.budget.global_limit_bytes
        if global_limit is not None:
            backend_usage = self.session.backend.device_bytes()
            if backend_usage > global_limit * self.budget.high:
                # This session pays for the excess of all sessions (the one that is growing now).
                own = self.usage_bytes()
                share = max(0, own - (backend_usage - int(global_limit * self.budget.low)))
                limit = share if limit is None else min(limit, share)
        return limit

    def after_operation(self) -> None:
        """Enforce the budgets after an extend, a generate or an event."""
        session = self.session
        with self._timed("lifecycle_seconds"):
            limit = None if self.full else self._effective_limit()
            self.last_limit = limit
            if limit is not None:
                usage = self.usage_bytes()
                if usage > limit * self.budget.high:
                    target = int(limit * self.budget.low)
                    if self.span_mode:
                        with session.store.physical.deferred_removal():  # one compaction for all moves
                            self._demote_spans(target)
                    else:
                        self._evict_tokens(target)
                    usage = self.usage_bytes()
                satisfied = usage <= limit * self.budget.high
                if not satisfied and self.budget_satisfied:
                    logger.warning(
                        "session %s: device budget %d B cannot be met (%d B held) without demoting pinned "
                        "or active spans",
                        session.session_id,
                        limit,
                        usage,
                    )
                if not satisfied:
                    session.counters.budget_unmet += 1
                self.budget_satisfied = satisfied
            else:
                self.budget_satisfied = True
            self._enforce_host_budget()
            tiers = session.store.bytes_by_tier()
            session.counters.peak_device_bytes = max(session.counters.peak_device_bytes, tiers.device)

    def _demotable(self, span: Span) -> bool:
        return not span.pinned and span.span_id not in self.turn_state.recalled

    def _demote_spans(self, target: int) -> None:
        """Demote whole spans until device usage is at most `target` bytes.

        Order: the grace queue (evictable spans, oldest first), then committed spans on
        the device, lowest score first, then quantized archives. Spans recalled for this
        turn go last, least relevant first, and only as far as the limit itself (the high
        watermark, not `target`): recall chose them for the question being answered, but
        the budget is a limit and the turn's own new content (a long tool result arriving
        after the recall) must fit. Pinned and active spans are never demoted. Usage is
        re-read only after a move (`usage_bytes` sums every block).
        """
        spans = self.session.spans
        usage = self.usage_bytes()
        limit = self.last_limit
        hard = max(target, int(limit * self.budget.high)) if limit is not None else target

        def demote(candidates: list[Span], state: SpanState, *, recalled: bool = False) -> bool:
            nonlocal usage
            goal = hard if recalled else target
            for span in candidates:
                if usage <= goal:
                    return True
                if span.pinned or (span.span_id in self.turn_state.recalled) is not recalled:
                    continue
                was_recallable = span.span_id in self.recallable
                if self.move(span, state, reason="budget") is None:
                    continue
                # Archived by the budget, or an archive the budget evicted: still recallable
                # (restored, or recomputed from its token ids). Released spans are not.
                if state is SpanState.ARCHIVED or was_recallable:
                    self.recallable.add(span.span_id)
                usage = self.usage_bytes()
            return usage <= goal

        def by_score(state: SpanState, tier: Tier) -> list[Span]:
            chosen = (s for s in spans if s.state is state and s.tier is tier)
            return sorted(chosen, key=lambda s: (s.score, s.start))

        # 1. The grace queue: evictable spans go first, oldest first.
        evictable = sorted((s for s in spans if s.state is SpanState.EVICTABLE), key=lambda s: s.start)
        if demote(evictable, SpanState.EVICTED):
            return
        # 2. Committed spans on the device, lowest score first (whole spans: never re-scored).
        if demote(by_score(SpanState.COMMITTED, Tier.DEVICE), SpanState.ARCHIVED):
            return
        # 3. Quantized archives still count on the device: the lowest-scored go.
        if demote(by_score(SpanState.ARCHIVED, Tier.QUANTIZED), SpanState.EVICTED):
            return
        # 4. Last resort: what recall brought in for this turn, least relevant first.
        relevance = self.turn_state.relevance
        recalled = sorted(
            (s for s in spans if s.state is SpanState.COMMITTED and s.tier is Tier.DEVICE),
            key=lambda s: (relevance.get(s.span_id, 0.0), s.start),
        )
        demote(recalled, SpanState.ARCHIVED, recalled=True)

    def _enforce_host_budget(self) -> None:
        limit = self.budget.host_limit_bytes
        if limit is None:
            return
        store = self.session.store
        host = [s for s in self.session.spans if s.tier is Tier.HOST]
        for span in sorted(host, key=lambda s: (s.score, s.start)):
            if store.host_bytes() <= limit * self.budget.low:
                return
            if self._demotable(span) and span.state is not SpanState.EVICTED:
                self.move(span, SpanState.EVICTED, reason="host budget")

    def _evict_tokens(self, target: int) -> None:
        """Token mode: keep the policy's top tokens across the whole attended cache."""
        session = self.session
        physical = session.store.physical
        if self.policy is None or physical.length == 0:
            return
        per_token = max(1, physical.bytes_per_token())
        keep = max(0, (target - session.store.bytes_by_tier().quantized) // per_token)
        if keep >= physical.length:
            return
        slots = torch.arange(physical.length)
        # Pins are receipts in every mode: a pinned span's tokens are never dropped.
        pinned_ids = [s.span_id for s in session.spans if s.pinned]
        protected = torch.isin(physical.slot_span, torch.tensor(pinned_ids, dtype=torch.long))
        try:
            with self._timed("policy_seconds"):
                view = self._view(slots)
                chosen = self.policy.select(view, max(int(keep), int(protected.sum())), protected=protected)
        except Exception as e:  # noqa: BLE001 - a failing policy drops nothing this time
            self._fault("policy", None, e)
            return
        drop_mask = torch.ones(physical.length, dtype=torch.bool)
        drop_mask[chosen] = False
        with self._timed("store_seconds"):
            dropped_by_span: dict[int, set[int]] = {}
            for slot in drop_mask.nonzero().flatten().tolist():
                dropped_by_span.setdefault(int(physical.slot_span[slot]), set()).add(
                    int(physical.slot_offset[slot])
                )
            physical.remove(drop_mask.nonzero().flatten())
            for span in session.spans:
                dropped = dropped_by_span.get(span.span_id)
                if not dropped:
                    continue
                span.kept = [o for o in span.kept_offsets if o not in dropped]
                session.counters.compressed_tokens += len(dropped)
                if not span.kept:
                    span.tier = Tier.DROPPED
                    span.kept = None
                    span.state = SpanState.EVICTED

    # -- recall ----------------------------------------------------------------------------------

    def recall(self, message: ChatMessage) -> list[int]:
        """Before answering a new user turn, make the spans most relevant to it attended.

        Candidates are the spans budget pressure demoted (archived, and evicted ones when
        `rehydrate_evicted`) and the committed spans still on the device: a relevant span
        that is already attended is protected for this turn like a recalled one, so the
        demotions after the prefill cannot push it out in favour of less relevant spans.

        Recall may fill the budget up to its high watermark minus what cannot be demoted
        (pinned and active spans, the new message included): recalled spans displace
        lower-ranked committed spans, which the budget check after the prefill archives
        as usual. A fixed fraction of the budget would rule out recalling a long tool
        result at tight budgets, precisely where it matters. `max_spans` bounds the spans
        brought back; protecting an attended span only spends budget room.

        Returns:
            Ids of the spans brought back to the device (restored or recomputed).
        """
        session = self.session
        config = session.config.recall
        if not config.enabled or not self.span_mode:
            return []
        demoted = [
            s
            for s in session.spans
            if s.span_id in self.recallable
            and (s.state is SpanState.ARCHIVED or (config.rehydrate_evicted and s.state is SpanState.EVICTED))
        ]
        if not demoted:
            return []
        attended = [
            s
            for s in session.spans
            if s.state is SpanState.COMMITTED and s.tier is Tier.DEVICE and not s.pinned
        ]
        with self._timed("policy_seconds"):
            query = session.format.encode(message.content)
            ranked = rank_for_recall(
                query,
                demoted + attended,
                session.spans,
                embed=self._embedder(),
                canonical=self._canonical,
                memo=self._recall_memo,
            )
        ranked = [
            (span, score)
            for span, score in ranked
            if score > 0 and (config.min_score is None or score >= config.min_score)
        ]
        costs = [self._recall_cost(span) for span, _ in ranked]
        picked = choose_within_room(ranked, costs, self._recall_room(), relative_floor=config.relative_floor)
        chosen: list[tuple[Span, float]] = []
        for span, score in (ranked[i] for i in picked):
            if span.state is SpanState.COMMITTED:  # already attended: keep it there for this turn
                self.turn_state.recalled.add(span.span_id)
                self.turn_state.relevance[span.span_id] = score
            elif len(chosen) < config.max_spans:
                chosen.append((span, score))
        self._restore_together([span for span, _ in chosen])
        recalled: list[int] = []
        for span, score in chosen:
            if self.move(span, SpanState.COMMITTED, reason="recall") is not None:
                recalled.append(span.span_id)
                self.turn_state.recalled.add(span.span_id)
                self.turn_state.relevance[span.span_id] = score
        if recalled:
            session._record("recall", spans=recalled)
        return recalled

    def _restore_together(self, spans: Sequence[Span]) -> None:
        """Restore archived spans with one append, before their moves (which then find them attended).

        On failure nothing is restored and each span's own move restores it, or
        recomputes it from its token ids.
        """
        archived = [s for s in spans if s.tier in (Tier.HOST, Tier.QUANTIZED)]
        if len(archived) < 2:
            return
        session = self.session
        with self._timed("store_seconds"):
            try:
                session.store.restore_many(archived)
            except Exception as e:  # noqa: BLE001 - each span falls back on its own move
                self._fault("restore", None, e)
                return
            session.counters.restored_tokens += sum(s.held_tokens for s in archived)

    def _recall_room(self) -> int | None:
        """Device bytes recall may fill: the high watermark minus pinned and active spans (None = no limit).

        Up to the high watermark, not the low one: the low watermark is where demotion
        stops, the high one is the limit the prefill that follows must respect.
        """
        limit = self._effective_limit()
        if limit is None:
            return None
        fixed = sum(
            s.held_tokens + (s.length - s.n_computed)
            for s in self.session.spans
            if s.tier is Tier.DEVICE and (s.pinned or s.state is SpanState.ACTIVE)
        )
        return max(0, int(limit * self.budget.high) - fixed * self.session.runner.bytes_per_token)

    def _recall_cost(self, span: Span) -> int:
        """Device bytes a span holds once attended (a dropped span is recomputed in full)."""
        tokens = span.n_computed if span.tier is Tier.DROPPED else span.held_tokens
        return tokens * self.session.runner.bytes_per_token

    def _canonical(self, token: int) -> str:
        """A token's stripped, casefolded text: the key recall counts word overlap on (cached)."""
        key = self._token_keys.get(token)
        if key is None:
            key = str(self.session.backend.tokenizer.decode([token])).strip().casefold()
            self._token_keys[token] = key
        return key

    def _embedder(self) -> Any:
        model = self.session.runner.model
        get = getattr(model, "get_input_embeddings", None)
        return get() if callable(get) else None

    # -- accounting and invariants -----------------------------------------------------------------

    def span_bytes(self, span: Span) -> int:
        """Bytes held for a span in its tier."""
        store = self.session.store
        if span.tier is Tier.DEVICE:
            slots = int((store.physical.slot_span == span.span_id).sum())
            return slots * store.physical.bytes_per_token()
        block = store.blocks.get(span.span_id)
        return 0 if block is None else block.nbytes

    def check(self) -> None:
        """Verify accounting, positions, states, leases and the budget.

        Raises:
            RuntimeError: Naming every broken invariant (the first ten), so a failing
                property test says what went wrong, not just that something did.
        """
        session = self.session
        physical = session.store.physical
        problems: list[str] = []
        by_id = {s.span_id: s for s in session.spans}
        if len(by_id) != len(session.spans):
            problems.append("two spans share an id")
        expected_start = 0
        message_index = 0
        for span in session.spans:
            if span.start != expected_start:
                problems.append(f"span {span.span_id} starts at {span.start}, expected {expected_start}")
            expected_start = span.end
            if span.message_index >= 0:
                if span.message_index != message_index:
                    problems.append(
                        f"span {span.span_id} is message {span.message_index}, expected {message_index}"
                    )
                message_index += 1
            if not 0 <= span.n_computed <= span.length:
                problems.append(f"span {span.span_id} computed {span.n_computed} of {span.length} tokens")
            if span.kept is not None and (
                span.kept != sorted(set(span.kept)) or any(not 0 <= o < span.n_computed for o in span.kept)
            ):
                problems.append(f"span {span.span_id} keeps offsets outside its computed tokens")
        if message_index != len(session.messages):
            problems.append(f"{message_index} message spans for {len(session.messages)} messages")
        # Slots: each belongs to a live span, sits at that span's logical position, and appears once.
        offsets: dict[int, list[int]] = {}
        for slot_span, offset, position in zip(
            physical.slot_span.tolist(),
            physical.slot_offset.tolist(),
            physical.slot_position.tolist(),
            strict=True,
        ):
            owner = by_id.get(slot_span)
            if owner is None:
                problems.append(f"physical slot holds unknown span {slot_span}")
                continue
            offsets.setdefault(slot_span, []).append(offset)
            if position != owner.start + offset:
                problems.append(
                    f"span {slot_span} offset {offset} at position {position}, "
                    f"expected {owner.start + offset}"
                )
        for span in session.spans:
            held = sorted(offsets.get(span.span_id, []))
            block = session.store.blocks.get(span.span_id)
            if span.tier is Tier.DEVICE:
                if held != span.kept_offsets:
                    problems.append(
                        f"span {span.span_id} holds {len(held)} slots, expected {span.held_tokens} "
                        "(its kept offsets)"
                    )
                if block is not None:
                    problems.append(f"device span {span.span_id} also has an archived block")
            else:
                if held:
                    problems.append(
                        f"span {span.span_id} on tier {span.tier.value} still has {len(held)} slots"
                    )
                if span.tier is Tier.DROPPED and block is not None:
                    problems.append(f"dropped span {span.span_id} still has a block")
                if span.tier in (Tier.HOST, Tier.QUANTIZED) and (
                    block is None or sorted(block.offsets) != span.kept_offsets
                ):
                    problems.append(f"archived span {span.span_id} block does not match its kept tokens")
            if span.state is SpanState.ARCHIVED and span.tier not in (Tier.HOST, Tier.QUANTIZED):
                problems.append(f"archived span {span.span_id} is on tier {span.tier.value}")
            if span.state is SpanState.EVICTED and span.tier is not Tier.DROPPED:
                problems.append(f"evicted span {span.span_id} is on tier {span.tier.value}")
            if span.state in (SpanState.ACTIVE, SpanState.COMMITTED) and span.tier is not Tier.DEVICE:
                problems.append(f"{span.state.value} span {span.span_id} is on tier {span.tier.value}")
            if span.pinned and span.state in DEMOTED_STATES:
                problems.append(f"pinned span {span.span_id} is {span.state.value}")
            for lease_id in span.leases:
                lease = session.leases.get(lease_id)
                if lease is None or span.span_id not in lease.span_ids:
                    problems.append(
                        f"span {span.span_id} is pinned by lease {lease_id}, which does not list it"
                    )
        for block_span in session.store.blocks:
            if block_span not in by_id:
                problems.append(f"archived block of unknown span {block_span}")
        for lease in session.leases.values():
            for span_id in lease.span_ids:
                live = by_id.get(span_id)
                if live is not None and lease.lease_id not in live.leases:
                    problems.append(f"lease {lease.lease_id} lists span {span_id}, which lost the pin")
        for call_id, span_id in self.tool_calls.items():
            if span_id not in by_id:
                problems.append(f"tool call {call_id!r} registered to unknown span {span_id}")
        # Accounting: what the tiers report is what their tensors hold.
        tiers = session.store.bytes_by_tier()
        walked = sum(tensor_bytes(t) for t in physical.tensors())
        if walked != physical.nbytes():
            problems.append(f"the cache's tensors hold {walked} B, its accounting says {physical.nbytes()} B")
        if tiers.device != physical.nbytes():
            problems.append(f"device tier reports {tiers.device} B, the cache holds {physical.nbytes()} B")
        if self.budget_satisfied and self.last_limit is not None:
            usage = self.usage_bytes()
            if usage > self.last_limit * self.budget.high:
                problems.append(
                    f"budget reported as met but device usage {usage} B is over the high watermark "
                    f"({self.budget.high} of {self.last_limit} B)"
                )
        if problems:
            msg = f"session {session.session_id}: " + "; ".join(problems[:10])
            raise RuntimeError(msg)
