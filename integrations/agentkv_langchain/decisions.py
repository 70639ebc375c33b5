"""Reading a human's decisions and the agent's custom events as agentkv events.

`resume_decision` reads a resume value or a human-in-the-loop decision as confirm
or reject; `decisions_for` maps one answered interrupt to `(owner, decision)`
pairs; `custom_event` reads an `agentkv.*` custom event. The callback
handler (`agentkv_langchain.callbacks`) turns the results into events.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from agentkv import BranchPruned, BranchSelected, Custom, Event, UserConfirmed, UserRejected

__all__ = [
    "answered_interrupts",
    "decision_events",
    "CONFIRM_EVENT",
    "CUSTOM_EVENTS",
    "GENERIC_EVENT",
    "OWNER_KEY",
    "PIN_EVENT",
    "PRUNE_BRANCH_EVENT",
    "REJECT_EVENT",
    "SELECT_BRANCH_EVENT",
    "Decision",
    "ToolCallRecord",
    "custom_event",
    "custom_event_from",
    "decisions_for",
    "resume_decision",
]

CONFIRM_EVENT = "agentkv.confirm"
"""Custom event: the user confirmed `data["owner"]` (None = the latest answer) → `UserConfirmed`."""
REJECT_EVENT = "agentkv.reject"
"""Custom event: the user rejected `data["owner"]` → `UserRejected`."""
PRUNE_BRANCH_EVENT = "agentkv.prune_branch"
"""Custom event: branch `data["branch"]` lost → `BranchPruned` on the parent (closes the branch's session)."""
SELECT_BRANCH_EVENT = "agentkv.select_branch"
"""Custom event: branch `data["branch"]` won → `BranchSelected` on the parent (closes its siblings)."""
PIN_EVENT = "agentkv.pin"
"""Custom event: pin the spans owned by `data["owner"]`; the lease is kept in `handler.leases`."""
GENERIC_EVENT = "agentkv.event"
"""Custom event: `data` is an `agentkv.Event` or `{"event": name, "owner": ..., "payload": {}}` → `Custom`."""
CUSTOM_EVENTS: tuple[str, ...] = (
    CONFIRM_EVENT,
    REJECT_EVENT,
    PRUNE_BRANCH_EVENT,
    SELECT_BRANCH_EVENT,
    PIN_EVENT,
    GENERIC_EVENT,
)
"""Every custom event name the handler understands; other names are ignored (they belong to someone else)."""

OWNER_KEY = "agentkv_owner"
"""Key of an `interrupt()` value naming the span a confirmation is about (e.g. the plan's message id)."""

_CONFIRM_WORDS = frozenset(
    {
        "approve",
        "approved",
        "accept",
        "accepted",
        "yes",
        "y",
        "ok",
        "okay",
        "confirm",
        "confirmed",
        "true",
        "edit",
        "edited",
        "respond",
    }
)
_REJECT_WORDS = frozenset(
    {"reject", "rejected", "no", "n", "deny", "denied", "decline", "declined", "cancel", "false"}
)


Decision = Literal["confirm", "reject"]


def resume_decision(value: Any) -> Decision | None:
    """Read a human's answer (a `Command(resume=...)` value, a HITL decision) as confirm / reject.

    Confirm: `True`, "approve", "accept", "yes", "ok", "confirm", "edit", "respond",
    or a mapping whose `type` (or `decision` / `action`) is one of those, or
    `{"approved": True}`. Reject: `False`, "reject", "no", "deny", "decline",
    "cancel", or a mapping saying so. Words are matched case-insensitively.

    "edit" confirms because the human kept the proposal and changed its details
    (it runs, edited); "respond" (`HumanInTheLoopMiddleware`: the human answers in
    the tool's place) confirms because the human engaged with the call rather than
    dismissing it, and the answer becomes the call's result.

    Args:
        value: The resume value.

    Returns:
        "confirm", "reject", or None for anything else (free text, None): no event,
        since guessing would pin or drop the wrong thing.
    """
    if isinstance(value, bool):
        return "confirm" if value else "reject"
    if isinstance(value, str):
        word = value.strip().lower()
        if word in _CONFIRM_WORDS:
            return "confirm"
        if word in _REJECT_WORDS:
            return "reject"
        return None
    if isinstance(value, Mapping):
        approved = value.get("approved")
        if isinstance(approved, bool):
            return "confirm" if approved else "reject"
        for key in ("type", "decision", "action"):
            kind = value.get(key)
            if isinstance(kind, (str, bool)):
                return resume_decision(kind)
    return None


@dataclass(frozen=True)
class ToolCallRecord:
    """A tool call the model made: which message (span owner) holds it."""

    tool_call_id: str
    name: str
    args: Mapping[str, Any]
    message_id: str | None


def decisions_for(
    value: Any, answer: Any, records: Sequence[ToolCallRecord]
) -> list[tuple[str | None, Decision]]:
    """`(owner, decision)` pairs for one answered interrupt."""
    if isinstance(value, Mapping) and value.get("type") == "tool_approval":  # HITL per-call mode
        decision = resume_decision(answer)
        owner = owner_of_call(str(value.get("tool_call_id")), records)
        return [(owner, decision)] if decision else []
    if isinstance(value, Mapping) and "action_requests" in value and isinstance(answer, Mapping):
        requests = list(value.get("action_requests") or [])
        out: list[tuple[str | None, Decision]] = []
        unused = list(records)
        for request, item in zip(requests, answer.get("decisions") or [], strict=False):
            decision = resume_decision(item)
            record = match_request(request, unused)
            if record is not None:
                unused.remove(record)
            if decision:
                out.append((record.message_id if record is not None else None, decision))
        return out
    decision = resume_decision(answer)
    owner = value.get(OWNER_KEY) if isinstance(value, Mapping) else None
    return [(str(owner) if owner is not None else None, decision)] if decision else []


def owner_of_call(call_id: str, records: Sequence[ToolCallRecord]) -> str | None:
    """The message (span owner) that made tool call `call_id`, if known."""
    return next((r.message_id for r in records if r.tool_call_id == call_id), None)


def match_request(request: Any, records: Sequence[ToolCallRecord]) -> ToolCallRecord | None:
    """The tool call a HITL action request shows (requests carry name and args, not the call id)."""
    if not isinstance(request, Mapping):
        return None
    same_name = [r for r in records if r.name == request.get("name")]
    exact = [r for r in same_name if dict(r.args) == dict(request.get("args") or {})]
    candidates = exact or same_name
    return candidates[0] if candidates else None


def custom_event(name: str, data: Any) -> Event:
    """The event an `agentkv.*` custom event (one of `CUSTOM_EVENTS`) stands for.

    `PIN_EVENT` gives `Custom(event="pin", owner=...)`: the handler pins the owner
    (keeping the lease) rather than sending it. Branch decisions name the branch; the
    handler sends them to the thread (the branch's parent).

    Raises:
        TypeError: `data` is not a mapping (or, for `GENERIC_EVENT`, an `Event`).
        ValueError: an unknown name, a pin without an owner, a branch decision without a branch.
    """
    data = data if data is not None else {}
    if name == GENERIC_EVENT:
        return custom_event_from(data)
    if not isinstance(data, Mapping):
        msg = f"{name}: data must be a mapping, got {type(data).__name__}"
        raise TypeError(msg)
    owner = str(data["owner"]) if data.get("owner") is not None else None
    if name == CONFIRM_EVENT:
        return UserConfirmed(owner=owner)
    if name == REJECT_EVENT:
        return UserRejected(owner=owner)
    if name == PIN_EVENT:
        if owner is None:
            msg = f"{PIN_EVENT}: data['owner'] is required (the span owner to pin)"
            raise ValueError(msg)
        return Custom(event="pin", owner=owner)
    if name not in (PRUNE_BRANCH_EVENT, SELECT_BRANCH_EVENT):
        msg = f"unknown agentkv custom event {name!r}; allowed: {', '.join(CUSTOM_EVENTS)}"
        raise ValueError(msg)
    branch = data.get("branch")
    if not isinstance(branch, str) or not branch:
        msg = f"{name}: data['branch'] must be a non-empty string, got {branch!r}"
        raise ValueError(msg)
    return BranchPruned(branch=branch) if name == PRUNE_BRANCH_EVENT else BranchSelected(branch=branch)


def custom_event_from(data: Any) -> Event:
    """The event a `GENERIC_EVENT` custom event carries (an `Event`, or a mapping read as `Custom`)."""
    if isinstance(data, Event):
        return data
    if not isinstance(data, Mapping):
        kind = type(data).__name__
        msg = f"{GENERIC_EVENT}: data must be an agentkv Event or a mapping with 'event', got {kind}"
        raise TypeError(msg)
    name = data.get("event") or data.get("name")
    if not isinstance(name, str) or not name:
        msg = f"{GENERIC_EVENT}: data['event'] must name the event (rules key custom:<name>), got {name!r}"
        raise ValueError(msg)
    owner = data.get("owner")
    payload = data.get("payload") or {}
    if not isinstance(payload, Mapping):
        msg = f"{GENERIC_EVENT}: data['payload'] must be a mapping, got {type(payload).__name__}"
        raise TypeError(msg)
    return Custom(event=name, owner=str(owner) if owner is not None else None, payload=dict(payload))


def answered_interrupts(resume: Any, pending: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """Pair a resume value with the interrupts it answers: `(interrupt id, interrupt value, answer)`."""
    if isinstance(resume, Mapping) and resume and pending and all(str(k) in pending for k in resume):
        return [(str(k), pending[str(k)], v) for k, v in resume.items()]
    if pending:  # one value answers the oldest pending interrupt, as LangGraph resumes it
        interrupt_id = next(iter(pending))
        return [(interrupt_id, pending[interrupt_id], resume)]
    return [("", None, resume)]


def decision_events(
    answered: Sequence[tuple[str, Any, Any]], records: Sequence[ToolCallRecord]
) -> list[Event]:
    """Confirm/reject events for answered interrupts.

    A `HumanInTheLoopMiddleware` request reviews tool calls; its decisions are
    grouped by the message that made the calls: the message is confirmed when any
    of its calls was approved, edited or answered, rejected when all were rejected.
    Any other interrupt is about `value["agentkv_owner"]` (None = the latest
    assistant message).
    """
    by_owner: dict[str | None, list[Decision]] = {}
    for _, value, answer in answered:
        for owner, decision in decisions_for(value, answer, records):
            by_owner.setdefault(owner, []).append(decision)
    events: list[Event] = []
    for owner, decisions in by_owner.items():
        if "confirm" in decisions:
            events.append(UserConfirmed(owner=owner))
        else:
            events.append(UserRejected(owner=owner))
    return events
