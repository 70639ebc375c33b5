"""Say lifecycle facts from inside a run: `confirm()`, `prune_branch("b2")` and the like.

Each helper dispatches one LangChain custom event (`dispatch_custom_event`) that
`KVLifecycleCallbackHandler` turns into an agentkv event on the session of the run
it is called from, so code in a node, a tool or a runnable never needs the backend
or the event names. Call them inside a run (a LangGraph node, a tool, a
`RunnableLambda`); outside one there is no run to attach the event to.

Every helper is safe to call twice: LangGraph re-runs an interrupted node from
the top, and the session ignores an event it has already applied.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from langchain_core.callbacks import dispatch_custom_event
from langchain_core.runnables import RunnableConfig

from agentkv import Event
from agentkv_langchain.callbacks import (
    CONFIRM_EVENT,
    GENERIC_EVENT,
    PIN_EVENT,
    PRUNE_BRANCH_EVENT,
    REJECT_EVENT,
    SELECT_BRANCH_EVENT,
)

__all__ = ["confirm", "kv_event", "pin", "prune_branch", "reject", "select_branch", "send_event"]


def confirm(owner: str | None = None, config: RunnableConfig | None = None) -> None:
    """The user confirmed a proposal: `UserConfirmed` (pinned by the default rules).

    Args:
        owner: The confirmed message's id (an `AIMessage.id`) or another span owner;
            None = the session's most recent assistant message.
        config: The run's config, when the contextvar does not carry it (async code
            on Python < 3.11, threads you started yourself).
    """
    _dispatch(CONFIRM_EVENT, {"owner": owner}, config)


def reject(owner: str | None = None, config: RunnableConfig | None = None) -> None:
    """The user rejected a proposal: `UserRejected` (released by the default rules).

    Args:
        owner: As for `confirm`.
        config: As for `confirm`.
    """
    _dispatch(REJECT_EVENT, {"owner": owner}, config)


def prune_branch(branch: str, config: RunnableConfig | None = None) -> None:
    """A branch lost: `BranchPruned` on the parent session, which closes the branch's session.

    The branch's own KV is freed at once; the prefix it shared with its parent stays.

    Args:
        branch: The branch id (`agentkv_langgraph.current_branch(config)` inside the branch).
        config: As for `confirm`.
    """
    _dispatch(PRUNE_BRANCH_EVENT, {"branch": branch}, config)


def select_branch(branch: str, config: RunnableConfig | None = None) -> None:
    """A branch won: `BranchSelected` on the parent session; its siblings' sessions are closed.

    Args:
        branch: The winning branch id.
        config: As for `confirm`.
    """
    _dispatch(SELECT_BRANCH_EVENT, {"branch": branch}, config)


def pin(owner: str, config: RunnableConfig | None = None) -> None:
    """Pin the spans `owner` names (never demoted); the handler keeps the lease (`handler.release`).

    Args:
        owner: A message id, `tool_call_id` or branch id.
        config: As for `confirm`.
    """
    _dispatch(PIN_EVENT, {"owner": owner}, config)


def kv_event(
    name: str,
    owner: str | None = None,
    payload: Mapping[str, Any] | None = None,
    config: RunnableConfig | None = None,
) -> None:
    """A user event: `Custom(event=name, owner=owner)`, acted on by the rule `custom:<name>`.

    Args:
        name: The event name; the YAML rules key is `custom:<name>`.
        owner: The span owner the rule's `owner` target names.
        payload: Extra data kept on the event (not used by the rules).
        config: As for `confirm`.
    """
    _dispatch(GENERIC_EVENT, {"event": name, "owner": owner, "payload": dict(payload or {})}, config)


def send_event(event: Event, config: RunnableConfig | None = None) -> None:
    """Any `agentkv` event, applied to the session of the current run.

    Args:
        event: The event (e.g. `ToolCallFailed(tool_call_id=...)`).
        config: As for `confirm`.
    """
    _dispatch(GENERIC_EVENT, event, config)


def _dispatch(name: str, data: Any, config: RunnableConfig | None) -> None:
    try:
        dispatch_custom_event(name, data, config=config)
    except RuntimeError as e:
        msg = (
            f"{name}: call it inside a LangChain/LangGraph run (a node, a tool, a runnable) so the "
            f"callback handler knows which session it is about ({e})"
        )
        raise RuntimeError(msg) from e
