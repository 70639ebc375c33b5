"""The lifecycle manager: one per session, wiring events, rules, the mover, budgets and recall.

It owns no logic of its own beyond dispatch: event targets come from
`targets`, what happens to them from `rules`, every state-and-tier change goes
through `mover`, pressure is relieved by `budget`, demoted spans come back
through `recall`, and `invariants` checks the result. It reads and writes the
session's state only through the span table and the `SessionPort` services.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from agentkv.chat import ChatMessage
from agentkv.events import (
    BranchOpened,
    BranchPruned,
    BranchSelected,
    Custom,
    Event,
    TurnEnded,
    validate_event,
)
from agentkv.lifecycle.budget import BudgetKeeper
from agentkv.lifecycle.compression import Compressor, span_view
from agentkv.lifecycle.invariants import raise_problems, table_problems
from agentkv.lifecycle.leases import Lease
from agentkv.lifecycle.limits import BudgetLimits
from agentkv.lifecycle.marks import RecallMarks
from agentkv.lifecycle.mover import Mover
from agentkv.lifecycle.pages import PageIndex
from agentkv.lifecycle.port import SessionPort
from agentkv.lifecycle.recall import Recaller
from agentkv.lifecycle.results import ApplyResult, Transition
from agentkv.lifecycle.rules import ACTION_STATES, TRANSITIONS, Rules
from agentkv.lifecycle.targets import Targets, ToolCallRegistry, find_targets, turn_targets
from agentkv.lifecycle.timing import SectionTimer
from agentkv.policies import Policy, SpanView, make_policy
from agentkv.spans import Span, SpanKind, SpanState

logger = logging.getLogger(__name__)


class LifecycleManager:
    """Applies events, enforces budgets and recalls archived spans for one session."""

    def __init__(self, port: SessionPort, limits: BudgetLimits) -> None:
        self.port = port
        self.table = port.table
        config = port.config
        self.rules = Rules(config.rules)
        policy = make_policy(config.policy.name, config.policy.params)
        # `full` (no policy) keeps whole spans and never compresses; otherwise the policy says.
        self.whole_spans = policy is None or policy.whole_spans
        self.timer = SectionTimer(self.table.counters)
        self.marks = RecallMarks()
        self.tool_calls = ToolCallRegistry()
        self.mover = Mover(
            self.table, port.store, port.recompute, config.archive_tier, self.marks, self.timer
        )
        self.pages = PageIndex(port, config.recall)
        self.compressor = Compressor(
            self.table,
            port.store,
            policy,
            config,
            self.timer,
            self.mover.fault,
            whole_spans=self.whole_spans,
            window_attention=port.window_attention,
            page_tokens=config.recall.page_tokens if self.whole_spans and self.pages.enabled else None,
        )
        self.mover.compress_at_commit = self.compressor.compress_at_commit
        self.budget = BudgetKeeper(
            port,
            limits,
            self.mover,
            self.compressor,
            self.marks,
            whole_spans=self.whole_spans,
            enforced=policy is not None,
        )
        self.budget.placement_order = config.budget.placement_order
        self.recaller = Recaller(
            port,
            config.recall,
            self.budget,
            self.mover,
            self.marks,
            self.timer,
            self.pages,
            enabled=self.whole_spans,
        )
        if policy is None and limits.device_bytes is not None:
            logger.warning(
                "policy 'full' keeps every token: the device budget is reported but never enforced"
            )
        self.applied: set[Any] = set()
        self.branches_seen: set[str] = set()

    # -- hooks from the session -----------------------------------------------------------------

    def on_span_created(self, span: Span) -> None:
        """System prompts are pinned (span mode): the agent's instructions never go."""
        if span.kind is SpanKind.SYSTEM and self.whole_spans:
            self.table.grant([span], "system prompt")

    def on_span_removed(self, span: Span) -> None:
        """Forget registrations of a span removed by a history rewrite."""
        self.tool_calls.forget_span(span.span_id)
        self.marks.recallable.discard(span.span_id)

    def register_tool_call(self, call_id: str, span: Span) -> None:
        """Remember which span made a tool call, so `ToolCallCompleted` can release it."""
        self.tool_calls.register(call_id, span)

    def on_new_user_turn(self) -> None:
        """A new user message ends the previous turn (an implicit `TurnEnded`)."""
        table = self.table
        if any(s.state is SpanState.ACTIVE and s.turn == table.turn for s in table.spans):
            self._apply_turn_ended(TurnEnded(turn=table.turn), implicit=True)
        self.marks.new_turn()

    def note_branch(self, branch: str) -> None:
        """A branch session was forked from this one (its prune/select events are then known)."""
        self.branches_seen.add(branch)

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
        before the pressure the confirming message adds can demote it.
        """
        validate_event(event)
        with self.timer.timed("lifecycle_seconds"):
            key = self._event_key(event)
            if key in self.applied:
                return self._noop(event, "duplicate event")
            if isinstance(event, TurnEnded):
                result = self._apply_turn_ended(event)
            else:
                result = self._apply_targets(event, find_targets(event, self.table, self.tool_calls))
            if result.applied:
                self.applied.add(key)
        if enforce:
            self.after_operation()
        return result

    def _event_key(self, event: Event) -> Any:
        if isinstance(event, TurnEnded) and event.turn is None:
            return (event.name, self.table.turn)
        return (event.name, event)

    def _count(self, *, applied: bool, internal: bool) -> None:
        """Count an event: internal ones (implicit turn ends) apart from what the user's run sent."""
        counters = self.table.counters
        if internal:
            counters.events_internal += 1
        elif applied:
            counters.events_applied += 1
        else:
            counters.events_noop += 1

    def _noop(self, event: Event, reason: str, internal: bool = False) -> ApplyResult:
        self._count(applied=False, internal=internal)
        logger.info("session %s: %s ignored: %s", self.table.session_id, event.name, reason)
        self.table.record("event", event=event.name, applied=False, reason=reason)
        return ApplyResult(event.name, applied=False, reason=reason)

    def _settle_branch_sessions(self, event: BranchPruned | BranchSelected) -> None:
        """Close the branch sessions an event settles.

        A pruned branch's session is closed (its own KV freed, the shared prefix stays);
        selecting a branch closes its siblings' sessions.
        """
        for child_id, branch in self.port.child_branches():
            self.branches_seen.add(branch or "")
            pruned = isinstance(event, BranchPruned) and branch == event.branch
            sibling = isinstance(event, BranchSelected) and branch != event.branch
            if pruned or sibling:
                self.port.close_child(child_id)
                self.table.record("branch", closed=child_id, reason=event.name)

    def _rules_for(self, event: Event) -> dict[str, str]:
        if isinstance(event, Custom):
            return self.rules.actions(f"custom:{event.event}")
        return self.rules.actions(event.name)

    def _apply_targets(self, event: Event, targets: Targets, *, internal: bool = False) -> ApplyResult:
        table = self.table
        if isinstance(event, BranchOpened):
            self.branches_seen.add(event.branch)
            table.record("event", event=event.name, branch=event.branch)
            table.counters.events_applied += 1
            return ApplyResult(event.name, applied=True)
        if isinstance(event, (BranchPruned, BranchSelected)):
            self._settle_branch_sessions(event)
        if not any(targets.values()):
            if isinstance(event, (BranchPruned, BranchSelected)) and event.branch in self.branches_seen:
                table.counters.events_applied += 1
                return ApplyResult(event.name, applied=True, reason="branch sessions settled")
            return self._noop(
                event, "no span matches its target (unknown owner or already removed)", internal
            )
        actions = self._rules_for(event)
        # A confirmation is the strongest hint there is: a confirmed span that was already
        # dropped comes back (`pin` recomputes it); any other action skips evicted spans.
        live = {
            t: [s for s in spans if s.state is not SpanState.EVICTED or actions.get(t) == "pin"]
            for t, spans in targets.items()
        }
        if not any(live.values()):
            return self._noop(event, "its spans were already evicted", internal)
        transitions: list[Transition] = []
        leases: list[Lease] = []
        for target, action in actions.items():
            spans = live.get(target, [])
            if action == "pin" and spans:
                lease = self.pin(span_ids=[s.span_id for s in spans], reason=event.name, commit=True)
                leases.append(lease)
                continue
            if action == "unpin":
                for span in spans:
                    table.unpin_all(span)
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
                moved = self.mover.move(span, state, reason=event.name)
                if moved is not None:
                    transitions.append(moved)
        self._count(applied=True, internal=internal)
        table.record(
            "event",
            event=event.name,
            applied=True,
            transitions=[(t.span_id, t.after.value) for t in transitions],
        )
        return ApplyResult(event.name, applied=True, transitions=tuple(transitions), leases=tuple(leases))

    def _apply_turn_ended(self, event: TurnEnded, *, implicit: bool = False) -> ApplyResult:
        turn = self.table.turn if event.turn is None else event.turn
        if not self.table.in_turn(turn):
            return self._noop(event, f"turn {turn} has no spans", implicit)
        result = self._apply_targets(event, turn_targets(self.table, turn), internal=implicit)
        if implicit and result.applied:
            self.applied.add(("turn_ended", turn))
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
        """Bring the spans most relevant to a new user message back (see `Recaller.recall`)."""
        return self.recaller.recall(message)

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
