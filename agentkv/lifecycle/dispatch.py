"""Events to moves: each event's targets (`targets`) get the action the rules name (`rules`).

Events are idempotent (LangGraph re-runs a node from the top on resume): an event
seen before, one for an unknown owner, one whose spans are already evicted, or a
`Custom` event no rule names is a logged no-op. Every move goes through the mover;
a pin goes through the manager's `pin` (a confirmed span that was demoted comes back first).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from agentkv.events import BranchOpened, BranchPruned, BranchSelected, Custom, Event, TurnEnded
from agentkv.lifecycle.mover import Mover
from agentkv.lifecycle.port import SessionPort
from agentkv.lifecycle.results import ApplyResult, Transition
from agentkv.lifecycle.rules import ACTION_STATES, TRANSITIONS, Rules
from agentkv.lifecycle.targets import Targets, ToolCallRegistry, find_targets, turn_targets
from agentkv.spans import Lease, SpanState

logger = logging.getLogger(__name__)

Pin = Callable[..., Lease]
"""`LifecycleManager.pin(span_ids=..., reason=..., commit=...)`: pin spans, bringing them back first."""


class EventDispatcher:
    """Applies lifecycle events to one session's spans, once each."""

    def __init__(
        self, port: SessionPort, rules: Rules, tool_calls: ToolCallRegistry, mover: Mover, pin: Pin
    ) -> None:
        self.port = port
        self.table = port.table
        self.rules = rules
        self.tool_calls = tool_calls
        self.mover = mover
        self.pin = pin
        self.applied: set[Any] = set()
        """Keys of the events applied (a duplicate is a no-op)."""
        self.branches_seen: set[str] = set()
        """Branches known to this session (their prune/select events apply even with no span left)."""
        self.decided_turns: set[int] = set()
        """Turns in which a branch run in its own session was selected: their answer is its conclusion."""

    def apply(self, event: Event) -> ApplyResult:
        """Resolve an event's targets with the rules and move them (idempotent)."""
        key = self._event_key(event)
        if key in self.applied:
            return self._noop(event, "duplicate event")
        if isinstance(event, Custom) and not self._rules_for(event):
            return self._noop(event, self.rules.unknown_custom(event.event), warn=True)
        if isinstance(event, TurnEnded):
            result = self.end_turn(event)
        else:
            result = self._apply_targets(event, find_targets(event, self.table, self.tool_calls))
        if result.applied:
            self.applied.add(key)
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

    def _noop(self, event: Event, reason: str, internal: bool = False, *, warn: bool = False) -> ApplyResult:
        """A logged no-op (`warn`: at warning level, for what is likely a mistake in the config)."""
        self._count(applied=False, internal=internal)
        log = logger.warning if warn else logger.info
        log("session %s: %s ignored: %s", self.table.session_id, event.name, reason)
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
                if isinstance(event, BranchSelected):
                    # The branch ran in a session of its own: this turn's answer is its conclusion.
                    self.decided_turns.add(table.turn)
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

    def end_turn(self, event: TurnEnded, *, implicit: bool = False) -> ApplyResult:
        """Apply a turn end (`implicit`: a new user message ended the turn, counted apart)."""
        turn = self.table.turn if event.turn is None else event.turn
        if not self.table.in_turn(turn):
            return self._noop(event, f"turn {turn} has no spans", implicit)
        targets = turn_targets(self.table, turn, decided=turn in self.decided_turns)
        result = self._apply_targets(event, targets, internal=implicit)
        if implicit and result.applied:
            self.applied.add(("turn_ended", turn))
        return result
