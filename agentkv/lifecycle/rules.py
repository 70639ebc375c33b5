"""Lifecycle states, the allowed moves between them, and the rules table.

    ACTIVE ──commit──► COMMITTED ──archive──► ARCHIVED
      │                   │  ▲                  │
      └──release──► EVICTABLE ◄──release────────┘
                          │        (recall: ARCHIVED/EVICTED → COMMITTED)
                        evict ─────► EVICTED  (KV dropped, token ids kept)

`pinned` is not a state but a set of leases on a span (`agentkv.spans.Lease`):
a pinned span is never demoted by budget pressure. Rules map an event's targets to
actions; an action leads to a state through `ACTION_STATES`. The rules are
validated once, by `agentkv.config.rule_problems` (the YAML validation and
`Rules` both call it).
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping

from agentkv.config import rule_problems
from agentkv.spans import SpanState

TRANSITIONS: dict[SpanState, frozenset[SpanState]] = {
    SpanState.ACTIVE: frozenset(
        {SpanState.COMMITTED, SpanState.ARCHIVED, SpanState.EVICTABLE, SpanState.EVICTED}
    ),
    SpanState.COMMITTED: frozenset({SpanState.ARCHIVED, SpanState.EVICTABLE, SpanState.EVICTED}),
    SpanState.ARCHIVED: frozenset({SpanState.COMMITTED, SpanState.EVICTABLE, SpanState.EVICTED}),
    SpanState.EVICTABLE: frozenset({SpanState.COMMITTED, SpanState.EVICTED}),
    SpanState.EVICTED: frozenset({SpanState.COMMITTED}),
}
"""Allowed moves. EVICTED → COMMITTED is recall by recomputing the span from its token ids."""

DEMOTED_STATES = frozenset({SpanState.ARCHIVED, SpanState.EVICTABLE, SpanState.EVICTED})
"""States a pinned span never enters."""

ACTION_STATES: dict[str, SpanState | None] = {
    "keep": None,
    "commit": SpanState.COMMITTED,
    "release": SpanState.EVICTABLE,
    "archive": SpanState.ARCHIVED,
    "evict": SpanState.EVICTED,
    "pin": None,
    "unpin": None,
}

DEFAULT_RULES: dict[str, dict[str, str]] = {
    "turn_ended": {
        "user": "commit",
        "answer": "commit",
        # The conclusion of a selected tree-of-thought branch is the agent's decision: kept like a
        # confirmation (the branch's own sessions are closed, so this answer is all that is left of it).
        "decision": "pin",
        "reasoning": "release",
        "tool_calls": "release",
        "tool_results": "commit",
        "prompt": "release",
    },
    "tool_call_completed": {"result": "commit", "call": "release"},
    # An error output is an observation the agent made ("quota exceeded for account 7A-…"): it is kept
    # like a result; the failed call itself is released.
    "tool_call_failed": {"result": "commit", "call": "release"},
    "user_confirmed": {"target": "pin"},
    "user_rejected": {"target": "release"},
    "branch_opened": {},
    "branch_pruned": {"branch": "evict"},
    "branch_selected": {"branch": "commit", "siblings": "evict"},
    "session_closed": {"all": "evict"},
    # The forgetting side thread / `forget_tool_outputs` tool (`agentkv.forget`): the named tool
    # result's KV goes now; its token ids stay, so recall can recompute it if it is needed after all.
    "custom:forget_tool_output": {"owner": "evict"},
}
"""What each event does by default; `AgentKVConfig.rules` overrides entries target by target."""


def check_transition(current: SpanState, target: SpanState, event: str) -> None:
    """Raise `ValueError` naming the state, the event and the allowed moves when a move is illegal."""
    if target is current:
        return
    allowed = TRANSITIONS[current]
    if target not in allowed:
        names = ", ".join(sorted(s.value for s in allowed)) or "none"
        msg = (
            f"cannot move a {current.value} span to {target.value} on {event!r}; "
            f"allowed from {current.value}: {names}"
        )
        raise ValueError(msg)


class Rules:
    """The event → target → action table, defaults merged with overrides."""

    def __init__(self, overrides: Mapping[str, Mapping[str, str]] | None = None) -> None:
        overrides = overrides or {}
        problems = rule_problems(overrides)
        if problems:
            msg = "; ".join(f"rules.{'.'.join(path)}: {message}" for path, message in problems)
            raise ValueError(msg)
        table = {name: dict(targets) for name, targets in DEFAULT_RULES.items()}
        for name, targets in overrides.items():
            table.setdefault(name, {}).update(targets)
        self.table = table

    def actions(self, event_name: str) -> dict[str, str]:
        """Target → action for an event name (empty for an unknown custom event)."""
        return dict(self.table.get(event_name, {}))

    def unknown_custom(self, event: str) -> str:
        """Why a `Custom(event=...)` does nothing: no rule names it; the custom rules there are."""
        names = sorted(name.removeprefix("custom:") for name in self.table if name.startswith("custom:"))
        close = difflib.get_close_matches(event, names, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        return f"no rule for custom event {event!r} (rules define: {', '.join(names) or 'none'}){hint}"
