"""The lifecycle manager: one per session, wiring events, rules, the mover, placement and its peers.

It owns no logic of its own beyond dispatch: event targets come from `targets`,
what happens to them from `rules`, every state-and-tier change goes through
`mover`, room and plans are the placement service's (`placer`), and its three
peers ask it: `budget` relieves pressure, `recall` brings demoted spans back for a
new question and `exact_recall` recomputes what that question needs at full
precision. The peers never call each other: what
one found is handed to the next here. `invariants` checks the result. It reads and
writes the session's state only through the span table and the `SessionPort` services.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from agentkv.chat import ChatMessage
from agentkv.events import Event, TurnEnded
from agentkv.lifecycle.budget import BudgetKeeper
from agentkv.lifecycle.compression import Compressor, span_view
from agentkv.lifecycle.dispatch import EventDispatcher
from agentkv.lifecycle.exact_recall import ExactRecall
from agentkv.lifecycle.invariants import raise_problems, table_problems
from agentkv.lifecycle.limits import BudgetLimits
from agentkv.lifecycle.marks import RecallMarks
from agentkv.lifecycle.mover import Mover
from agentkv.lifecycle.placer import Placer
from agentkv.lifecycle.port import SessionPort
from agentkv.lifecycle.recall import Recaller
from agentkv.lifecycle.results import ApplyResult, Transition
from agentkv.lifecycle.rules import Rules
from agentkv.lifecycle.targets import ToolCallRegistry
from agentkv.lifecycle.timing import SectionTimer
from agentkv.policies import Policy, SpanView, make_policy
from agentkv.spans import Lease, Span, SpanKind, SpanState

logger = logging.getLogger(__name__)


class LifecycleManager:
    """Applies events, enforces budgets and recalls archived spans for one session."""

    def __init__(self, port: SessionPort, limits: BudgetLimits) -> None:
        self.port = port
        self.table = port.table
        config = port.config
        policy = make_policy(config.policy.name, config.policy.params)
        # `full` (no policy) keeps whole spans and never compresses; otherwise the policy says.
        self.whole_spans = policy is None or policy.whole_spans
        self.timer = SectionTimer(self.table.counters)
        self.marks = RecallMarks()
        self.tool_calls = ToolCallRegistry()
        self.mover = Mover(
            self.table,
            port.store,
            port.recompute,
            config.archive_tier,
            self.marks,
            self.timer,
            recompute_offsets=port.recompute_offsets,
        )
        self.compressor = Compressor(
            self.table,
            port.store,
            policy,
            config,
            self.timer,
            self.mover,
            whole_spans=self.whole_spans,
            window_attention=port.window_attention,
        )
        self.mover.compress_at_commit = self.compressor.compress_at_commit
        self.placer = Placer(port, limits, self.mover, self.marks)
        self.placer.placement_order = config.budget.placement_order
        self.budget = BudgetKeeper(
            self.placer,
            self.timer,
            self.compressor,
            whole_spans=self.whole_spans,
            enforced=policy is not None,
        )
        recall = config.recall
        self.recaller = Recaller(self.placer, self.timer, recall, enabled=self.whole_spans)
        self.exact = ExactRecall(self.placer, self.timer, enabled=recall.recompute_quantized)
        """Recomputes relevant spans held quantized at full precision (`recall.recompute_quantized`)."""
        if policy is None and limits.device_bytes is not None:
            logger.warning(
                "policy 'full' keeps every token: the device budget is reported but never enforced"
            )
        self.events = EventDispatcher(port, Rules(config.rules), self.tool_calls, self.mover, self.pin)
        """Resolves each event's targets with the rules and moves them (idempotent)."""

    # -- hooks from the session -----------------------------------------------------------------

    def on_span_created(self, span: Span) -> None:
        """System prompts are pinned (span mode): the agent's instructions never go."""
        if span.kind is SpanKind.SYSTEM and self.whole_spans:
            self.table.grant([span], "system prompt")

    def on_span_removed(self, span: Span) -> None:
        """Forget registrations of a span removed by a history rewrite."""
        self.tool_calls.forget_span(span.span_id)
        self.marks.recallable.discard(span.span_id)

    def carry_over(self, old: Span, new: Span) -> None:
        """A message a history rewrite re-encoded keeps its standing: its lifecycle state and its pins.

        `old` held the message before the rewrite dropped it; `new` holds the same message
        (same owner and fingerprint), encoded again. A confirmed plan stays pinned and
        committed, a rejected one released, a committed result committed; where its KV sits
        is the budget's to decide again. A span that had left the device comes back
        released: it was the first to go before, and its token ids stay.
        """
        target = {
            SpanState.COMMITTED: SpanState.COMMITTED,
            SpanState.ARCHIVED: SpanState.COMMITTED,
            SpanState.EVICTABLE: SpanState.EVICTABLE,
            SpanState.EVICTED: SpanState.EVICTABLE,
        }.get(old.state)
        self.table.move_pins(old, new)
        if new.pinned:
            target = SpanState.COMMITTED
        if target is not None:
            self.mover.move(new, target, reason="message re-encoded")

    def register_tool_call(self, call_id: str, span: Span) -> None:
        """Remember which span made a tool call, so `ToolCallCompleted` can release it."""
        self.tool_calls.register(call_id, span)

    def on_new_user_turn(self) -> None:
        """A new user message ends the previous turn (an implicit `TurnEnded`)."""
        table = self.table
        if any(s.state is SpanState.ACTIVE and s.turn == table.turn for s in table.spans):
            self.events.end_turn(TurnEnded(turn=table.turn), implicit=True)
        self.marks.new_turn()

    def note_branch(self, branch: str) -> None:
        """A branch session was forked from this one (its prune/select events are then known)."""
        self.events.branches_seen.add(branch)

    def inherit(self, parent: LifecycleManager) -> None:
        """A fork starts with its parent's registrations."""
        self.tool_calls.inherit(parent.tool_calls)
        self.marks.inherit(parent.marks)

    # -- events ---------------------------------------------------------------------------------

    def apply(self, event: Event, *, enforce: bool = True) -> ApplyResult:
        """Resolve an event's targets with the rules and move them (idempotent).

        `enforce=False` leaves the budget check to the caller: events that arrive with
        a message are applied before the budget plans that message's pressure
        (`Session.extend(messages, events=...)`), so a confirmation pins its span
        before the pressure the confirming message adds can demote it. The session
        validated the event (`agentkv.events.validate_event`) where it came in.
        """
        with self.timer.timed("lifecycle_seconds"):
            result = self.events.apply(event)
        if enforce:
            self.after_operation()
        return result

    # -- moves, pins, budgets, recall -------------------------------------------------------------

    def move(self, span: Span, target: SpanState, *, reason: str) -> Transition | None:
        """Move one span to `target` (see `Mover.move`); None when nothing changed."""
        return self.mover.move(span, target, reason=reason)

    def pin(
        self,
        *,
        owner: str | None = None,
        span_ids: Sequence[int] | None = None,
        reason: str = "",
        commit: bool = False,
    ) -> Lease:
        """Pin spans by owner or id; returns the receipt. Unknown owners give an empty lease."""
        table = self.table
        if span_ids is None:
            spans = table.owned_by(owner) if owner else []
        else:
            wanted = set(span_ids)
            spans = [s for s in table.spans if s.span_id in wanted]
        pinned = [s for s in spans if self.mover.ready_to_pin(s, confirmed=commit, reason=reason or "pin")]
        lease = table.grant(pinned, reason)
        if not pinned:
            table.counters.events_noop += 1
            logger.info("session %s: pin of %r matched no live span", table.session_id, owner)
        return lease

    def release(self, lease: Lease) -> bool:
        """Give a lease back; only that lease's pins go."""
        return self.table.give_back(lease)

    def after_operation(self) -> None:
        """Enforce the budgets after an extend, a generate or an event."""
        with self.timer.timed("lifecycle_seconds"):
            self.mover.commit_computed()
            self.budget.enforce()

    def recall(self, message: ChatMessage) -> list[int]:
        """Before a new user message: recall, then exact recall with what recall found.

        Returns:
            Ids of the spans brought back (recalled, recomputed exactly).
        """
        found = self.recaller.recall(message)
        exact = self.exact.recompute(found.relevant, found.floor, found.pages_of, found.scores)
        if found.spans or exact:
            self.table.record("recall", spans=found.spans, exact=exact)
        return found.spans + exact

    @property
    def policy(self) -> Policy | None:
        """The scorer (None for `full`). Replacing it keeps the session's mode (span or token)."""
        return self.compressor.policy

    @policy.setter
    def policy(self, policy: Policy | None) -> None:
        self.compressor.policy = policy

    def scoring_view(self, span: Span | None = None) -> SpanView:
        """What the policy sees of `span`'s attended tokens (or all); TypeError: the store cannot."""
        tokens = self.port.store.attended_tokens(span, keys=True, queries=True)
        if tokens is None:
            msg = f"scoring_view needs a store that reads its tokens, got {type(self.port.store).__name__}"
            raise TypeError(msg)
        return span_view(tokens, self.table)

    @property
    def budget_satisfied(self) -> bool:
        """Whether the last budget check met the device budget."""
        return self.budget.satisfied

    @property
    def recallable(self) -> set[int]:
        """Ids of the spans recall may bring back."""
        return self.marks.recallable

    # -- invariants --------------------------------------------------------------------------------

    def check(self) -> None:
        """Verify accounting, positions, states, leases and the budget.

        Raises:
            RuntimeError: Naming every broken invariant (the first ten).
        """
        problems = table_problems(self.table, self.tool_calls.calls.items())
        problems += self.port.store.check(self.table.spans)
        problems += self.budget.check()
        raise_problems(self.table.session_id, problems)
