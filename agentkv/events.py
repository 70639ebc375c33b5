"""Lifecycle events: what the agent framework knows, said to the cache.

Events are frozen dataclasses. Each names its targets by *owner* (a `tool_call_id`,
a message id, a branch id), never by token position, so an integration can send
them without knowing anything about the cache. Applying an event twice changes
nothing the second time (LangGraph re-runs a node from the top on resume), and an
event naming something the session does not know is a logged no-op.

The rules table (`agentkv.lifecycle.rules.DEFAULT_RULES`) maps each event's `name` and
*target* (one of `EVENT_TARGETS[name]`) to an *action* (one of `ACTIONS`).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

ACTIONS: tuple[str, ...] = ("keep", "commit", "release", "archive", "evict", "pin", "unpin")
"""What a rule may do to a target span (`agentkv.lifecycle.rules.ACTION_STATES`: the state each leads to)."""


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
    """A tool raised or returned an error: its error output is committed like a result, the call released."""

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
    "turn_ended": ("user", "answer", "decision", "reasoning", "tool_calls", "tool_results", "prompt"),
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
