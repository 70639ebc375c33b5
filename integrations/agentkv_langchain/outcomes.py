"""How a unit of agent work ended: completed, failed, interrupted or replayed — decided in one place.

A LangChain run (a graph, a node, a model call, a tool), a tool call wrapped by
`AgentKVMiddleware`, and a LangGraph task all end in one of four ways, and the
KV lifecycle treats each differently:

- `INTERRUPTED`: a LangGraph control-flow exception (`GraphInterrupt`, ...), an
  `__interrupt__` output, or an interrupt seen inside the unit. Nothing is released
  and the turn goes on: LangGraph runs the unit again on resume.
- `FAILED`: any other exception, or a tool result `ToolMessage(status="error")`. A
  tool call's result and scaffolding are released (`ToolCallFailed`); a top-level
  run does not end the turn (the next user turn does).
- `REPLAYED`: a graph task interrupted in a run that has ended: it runs again from
  the top on resume, its new answers stand for the interrupted attempt's, and
  decisions about those land on them (`agentkv_langchain.replays`).
- `COMPLETED`: anything else. A tool call's result is committed
  (`ToolCallCompleted`); a top-level run ends the turn.

`decide` reads a unit's evidence, `after_run` what a graph task is when its run
ends, and `tool_event` is the event a tool call's outcome sends.
Both the callback handler and the middleware use them, so a tool paused by
`interrupt()` is never reported as failed, whichever of the two watches it.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any

from langchain_core.messages import ToolMessage

from agentkv import Event, ToolCallCompleted, ToolCallFailed

__all__ = [
    "BUBBLE_UPS",
    "INTERRUPT_KEY",
    "Outcome",
    "after_run",
    "decide",
    "is_bubble_up",
    "tool_event",
    "tool_message",
]

BUBBLE_UPS = frozenset({"GraphBubbleUp", "GraphInterrupt", "NodeInterrupt", "ParentCommand"})
"""LangGraph's control-flow exceptions (matched by name: LangGraph is optional): a pause, not a failure."""
INTERRUPT_KEY = "__interrupt__"
"""The key of a graph's output when the run stopped at an interrupt."""


class Outcome(enum.Enum):
    """How a unit of agent work ended (see the module table)."""

    COMPLETED = "completed"
    FAILED = "failed"
    INTERRUPTED = "interrupted"
    REPLAYED = "replayed"


def is_bubble_up(error: BaseException) -> bool:
    """Whether `error` is LangGraph control flow (an interrupt), not a failure."""
    return any(cls.__name__ in BUBBLE_UPS for cls in type(error).__mro__)


def tool_message(output: Any, call_id: str | None = None) -> ToolMessage | None:
    """The `ToolMessage` a tool produced: `output` itself, or one in a `Command(update={"messages": [...]})`.

    Args:
        output: What the tool (or the tool node) returned.
        call_id: Only a message answering this call; None = the first one.
    """
    if isinstance(output, ToolMessage):
        return output
    update = getattr(output, "update", None)
    messages = update.get("messages") if isinstance(update, Mapping) else None
    for message in messages or []:
        if isinstance(message, ToolMessage) and (call_id is None or message.tool_call_id == call_id):
            return message
    return None


def decide(
    output: Any = None,
    error: BaseException | None = None,
    *,
    result: ToolMessage | None = None,
    interrupted: bool = False,
) -> Outcome:
    """The outcome of one unit of work, from what it returned or raised.

    Args:
        output: What a run returned (a graph's output mapping: `__interrupt__` marks a pause).
        error: What it raised, if it raised.
        result: The `ToolMessage` a tool call produced (`status="error"` marks a failure).
        interrupted: An interrupt was seen inside the unit (a child paused, LangGraph
            reported `on_interrupt`): the unit is paused whatever it returned.

    Returns:
        `INTERRUPTED` for a pause (it wins over everything), else `FAILED` for an
        exception or an error result, else `COMPLETED` (a graph task becomes `REPLAYED`
        when its run ends: `after_run`).
    """
    if interrupted or (error is not None and is_bubble_up(error)):
        return Outcome.INTERRUPTED
    if isinstance(output, Mapping) and INTERRUPT_KEY in output:
        return Outcome.INTERRUPTED
    if error is not None or (result is not None and result.status == "error"):
        return Outcome.FAILED
    return Outcome.COMPLETED


def after_run(task: Outcome | None, run: Outcome) -> Outcome | None:
    """What a graph task is once its top-level run ended with outcome `run`.

    `REPLAYED` when the task was interrupted and so was the run (LangGraph runs the task
    again on resume); None when the task is done (its run completed or failed, or it
    was not the one that paused).
    """
    return Outcome.REPLAYED if task is Outcome.INTERRUPTED and run is Outcome.INTERRUPTED else None


def tool_event(
    call_id: str, output: Any = None, error: BaseException | None = None, *, interrupted: bool = False
) -> Event | None:
    """The event a tool call's outcome sends: `ToolCallCompleted`, `ToolCallFailed`, or None for a pause.

    Args:
        call_id: The call's `tool_call_id` (the span owner of its call and result).
        output: What the tool returned (its `ToolMessage`, a `Command` carrying it, a bare value).
        error: What it raised.
        interrupted: It stopped at an interrupt (it runs again on resume, and reports then).

    The failure's text is the exception's `repr`, or the error `ToolMessage`'s content.
    """
    message = tool_message(output, call_id)
    outcome = decide(error=error, result=message, interrupted=interrupted)
    if outcome is Outcome.INTERRUPTED:
        return None
    if outcome is Outcome.FAILED:
        text = repr(error) if error is not None else _text(message.content if message is not None else "")
        return ToolCallFailed(tool_call_id=call_id, error=text)
    return ToolCallCompleted(tool_call_id=call_id)


def _text(content: Any) -> str:
    return content if isinstance(content, str) else str(content)
