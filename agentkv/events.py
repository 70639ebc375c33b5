"""Lifecycle events: what the agent framework knows, said to the cache.

Events are frozen dataclasses. Each names its targets by *owner* (a `tool_call_id`,
a message id, a branch id), never by token position, so an integration can send
them without knowing anything about the cache. Applying an event twice changes
nothing the second time (LangGraph re-runs a node from the top on resume), and an
event naming something the session does not know is a logged no-op.

The rules table (`agentkv.lifecycle.DEFAULT_RULES`) maps each event's `name` and
*target* (one of `EVENT_TARGETS[name]`) to an *action* (one of `ACTIONS`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

ACTIONS: tuple[str, ...] = ("keep", "commit", "release", "archive", "evict", "pin", "unpin")
"""What a rule may do to a target span: see `agentkv.lifecycle` for the state each leads to."""


@dataclass(frozen=True)
class Event:
    """Base class of every lifecycle event."""

    name: ClassVar[str] = "event"


@dataclass(frozen=True)
class TurnEnded(Event):
    """The agent finished answering a user turn.

    Commits the user message and the final answer; releases intermediate reasoning
    and tool-call scaffolding of the turn (default rules).
    """

    name: ClassVar[str] = "turn_ended"
    turn: int | None = None
    """The turn that ended; None = the session's current turn."""


@dataclass(frozen=True)
class ToolCallCompleted(Event):
    """A tool returned: its result is worth keeping, the call's scaffolding is not."""

    name: ClassVar[str] = "tool_call_completed"
    tool_call_id: str = ""


@dataclass(frozen=True)
class ToolCallFailed(Event):
    """A tool raised or returned an error: the call and its error output are released."""

    name: ClassVar[str] = "tool_call_failed"
    tool_call_id: str = ""
    error: str = ""


@dataclass(frozen=True)
class UserConfirmed(Event):
    """The user confirmed a proposal (plan, tool call, fact): pin it."""

    name: ClassVar[str] = "user_confirmed"
    owner: str | None = None
    """The confirmed span's owner; None = the most recent assistant span."""


@dataclass(frozen=True)
class UserRejected(Event):
    """The user rejected a proposal: release it."""

    name: ClassVar[str] = "user_rejected"
    owner: str | None = None
    """The rejected span's owner; None = the most recent assistant span."""


@dataclass(frozen=True)
class BranchOpened(Event):
    """A tree-of-thought branch (or LangGraph `Send` task) started."""

    name: ClassVar[str] = "branch_opened"
    branch: str = ""
    parent: str | None = None


@dataclass(frozen=True)
class BranchPruned(Event):
    """A branch lost: its own spans are evicted at once (default rules)."""

    name: ClassVar[str] = "branch_pruned"
    branch: str = ""


@dataclass(frozen=True)
class BranchSelected(Event):
    """A branch won: it is committed and its siblings are released."""

    name: ClassVar[str] = "branch_selected"
    branch: str = ""


@dataclass(frozen=True)
class SessionClosed(Event):
    """The conversation is over: everything is released."""

    name: ClassVar[str] = "session_closed"


@dataclass(frozen=True)
class Custom(Event):
    """A user-defined event; its `event` name is looked up in the rules table.

    The rule's single target `owner` is the span(s) named by `owner`.
    """

    name: ClassVar[str] = "custom"
    event: str = ""
    owner: str | None = None
    payload: Mapping[str, Any] = field(default_factory=dict, hash=False, compare=False)


EVENT_TYPES: tuple[type[Event], ...] = (
    TurnEnded,
    ToolCallCompleted,
    ToolCallFailed,
    UserConfirmed,
    UserRejected,
    BranchOpened,
    BranchPruned,
    BranchSelected,
    SessionClosed,
)
"""The built-in event classes (`Custom` events carry their own names)."""

EVENT_TARGETS: dict[str, tuple[str, ...]] = {
    "turn_ended": ("user", "answer", "reasoning", "tool_calls", "tool_results", "prompt"),
    "tool_call_completed": ("result", "call"),
    "tool_call_failed": ("result", "call"),
    "user_confirmed": ("target",),
    "user_rejected": ("target",),
    "branch_opened": (),
    "branch_pruned": ("branch",),
    "branch_selected": ("branch", "siblings"),
    "session_closed": ("all",),
}
"""For each built-in event name, the targets a rule can name."""

EVENT_NAMES: tuple[str, ...] = tuple(EVENT_TARGETS)


def event_key(event: Event) -> tuple[str, Event]:
    """The identity used to make events idempotent."""
    return (event.name, event)
