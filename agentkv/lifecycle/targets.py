"""Event targets: for each event type, the spans each of its rule targets names.

A table keyed by event type (`TARGET_FINDERS`), one small function per event,
instead of an `isinstance` chain: adding an event means adding a row. The rules
(`agentkv.lifecycle.rules`) then say what happens to each target.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from agentkv.events import (
    BranchOpened,
    BranchPruned,
    BranchSelected,
    Custom,
    Event,
    SessionClosed,
    ToolCallCompleted,
    ToolCallFailed,
    UserConfirmed,
    UserRejected,
)
from agentkv.lifecycle.table import SpanTable
from agentkv.spans import Span, SpanKind, SpanState

Targets = dict[str, list[Span]]
"""Rule target name (`EVENT_TARGETS[event.name]`) → the spans it names."""


@dataclass
class ToolCallRegistry:
    """Which span made each tool call, and which calls have completed."""

    calls: dict[str, int] = field(default_factory=dict)
    """tool_call_id → id of the span that made the call."""
    done: set[str] = field(default_factory=set)

    def register(self, call_id: str, span: Span) -> None:
        """Remember which span made a tool call, so `ToolCallCompleted` can release it."""
        self.calls[call_id] = span.span_id

    def forget_span(self, span_id: int) -> None:
        """Forget the calls a removed span made (a history rewrite)."""
        for call_id, owner in list(self.calls.items()):
            if owner == span_id:
                del self.calls[call_id]

    def inherit(self, parent: ToolCallRegistry) -> None:
        """A fork starts with its parent's calls."""
        self.calls = dict(parent.calls)
        self.done = set(parent.done)

    def complete(self, call_id: str) -> tuple[int | None, bool]:
        """Mark a call done; returns its span id and whether every call of that span is done."""
        span_id = self.calls.get(call_id)
        self.done.add(call_id)
        # A call span with several calls is released only when all of them are done.
        pending = {c for c, sid in self.calls.items() if sid == span_id} - self.done
        return span_id, not pending


TargetFinder = Callable[[Any, SpanTable, ToolCallRegistry], Targets]


def _tool_call(
    event: ToolCallCompleted | ToolCallFailed, table: SpanTable, calls: ToolCallRegistry
) -> Targets:
    result = [s for s in table.spans if s.kind is SpanKind.TOOL_RESULT and s.owner == event.tool_call_id]
    call_span, all_done = calls.complete(event.tool_call_id)
    call = [s for s in table.spans if s.span_id == call_span]
    return {"result": result, "call": call if all_done else []}


def _confirmation(event: UserConfirmed | UserRejected, table: SpanTable, calls: ToolCallRegistry) -> Targets:
    if event.owner is None:
        assistant = [s for s in table.spans if s.kind in (SpanKind.ASSISTANT, SpanKind.TOOL_CALL)]
        return {"target": assistant[-1:]}
    return {"target": table.owned_by(event.owner)}


def _pruned(event: BranchPruned, table: SpanTable, calls: ToolCallRegistry) -> Targets:
    return {"branch": [s for s in table.spans if s.branch == event.branch]}


def _selected(event: BranchSelected, table: SpanTable, calls: ToolCallRegistry) -> Targets:
    branch = [s for s in table.spans if s.branch == event.branch]
    siblings = [s for s in table.spans if s.branch is not None and s.branch != event.branch]
    return {"branch": branch, "siblings": siblings}


def _closed(event: SessionClosed, table: SpanTable, calls: ToolCallRegistry) -> Targets:
    return {"all": list(table.spans)}


def _custom(event: Custom, table: SpanTable, calls: ToolCallRegistry) -> Targets:
    return {"owner": table.owned_by(event.owner) if event.owner else []}


def _nothing(event: Event, table: SpanTable, calls: ToolCallRegistry) -> Targets:
    return {}


TARGET_FINDERS: dict[type[Event], TargetFinder] = {
    ToolCallCompleted: _tool_call,
    ToolCallFailed: _tool_call,
    UserConfirmed: _confirmation,
    UserRejected: _confirmation,
    BranchOpened: _nothing,
    BranchPruned: _pruned,
    BranchSelected: _selected,
    SessionClosed: _closed,
    Custom: _custom,
}
"""Event type → the function naming its targets (`TurnEnded` has its own: `turn_targets`)."""


def find_targets(event: Event, table: SpanTable, calls: ToolCallRegistry) -> Targets:
    """The spans each of the event's targets names (a subclass uses its nearest base's row)."""
    for cls in type(event).__mro__:
        finder = TARGET_FINDERS.get(cls)
        if finder is not None:
            return finder(event, table, calls)
    return {}


def turn_targets(table: SpanTable, turn: int, *, decided: bool = False) -> Targets:
    """What a `TurnEnded` names in `turn`: only spans still ACTIVE (earlier events decided the rest).

    `decided`: the session selected a branch in this turn (`BranchSelected` for a branch
    that ran in a session of its own), so the turn's answer is the selected branch's
    conclusion, the agent's decision: it is named `decision` instead of `answer`.
    """
    spans = table.in_turn(turn)
    answers = [s for s in spans if s.kind is SpanKind.ASSISTANT]
    targets = {
        "user": [s for s in spans if s.kind in (SpanKind.USER, SpanKind.SYSTEM)],
        "answer": [] if decided else answers[-1:],
        "decision": answers[-1:] if decided else [],
        "reasoning": [s for s in spans if s.kind is SpanKind.REASONING] + answers[:-1],
        "tool_calls": [s for s in spans if s.kind is SpanKind.TOOL_CALL],
        "tool_results": [s for s in spans if s.kind is SpanKind.TOOL_RESULT],
        "prompt": [s for s in spans if s.kind is SpanKind.PROMPT],
    }
    return {t: [s for s in ss if s.state is SpanState.ACTIVE] for t, ss in targets.items()}
