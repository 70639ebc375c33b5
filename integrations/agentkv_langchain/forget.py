"""`forget_tool_outputs`: the main agent names the tool results it no longer needs.

The same decision the forgetting side thread makes (`agentkv.forget`), as a tool a
model strong enough can call itself. Its call becomes one `ForgetRequested` event on
the session of the run (dispatched like every helper in `agentkv_langchain.helpers`,
so the tool needs no backend); the session checks the guard rails (never pinned
spans, the current turn's results, or results the last answer cited) and releases
the rest at the next turn boundary as `ToolOutputForgotten` events. A released
result keeps its token ids: recall recomputes it if a later question needs it.

Handles: `T1` is the conversation's first tool result, `T2` the second, and so on.
"""

from __future__ import annotations

from typing import Annotated

from langchain_core.runnables import RunnableConfig
from langchain_core.tools import InjectedToolCallId, StructuredTool
from pydantic import BaseModel, Field

from agentkv.forget import FORGET_TOOL_NAME, ForgetRequested
from agentkv_langchain.helpers import send_event

__all__ = ["FORGET_TOOL_DESCRIPTION", "ForgetToolOutputsArgs", "forget_tool_outputs"]

FORGET_TOOL_DESCRIPTION = (
    "Forget earlier tool results that will not be needed again, to free memory. Name them by "
    "handle: T1 is the first tool result of this conversation, T2 the second, and so on. "
    "Results of the current turn and results your last answer quoted are kept anyway."
)
"""What the model reads about the tool."""


class ForgetToolOutputsArgs(BaseModel):
    """Arguments of `forget_tool_outputs`."""

    handles: list[str] = Field(description="Handles of tool results no longer needed, e.g. ['T1', 'T3'].")
    """Handles of tool results no longer needed, e.g. ['T1', 'T3']."""
    tool_call_id: Annotated[str, InjectedToolCallId]
    """The call's id (injected by LangChain): it makes the request idempotent."""


def _forget(handles: list[str], tool_call_id: str, config: RunnableConfig) -> str:
    event = ForgetRequested(handles=tuple(handles), source="agent", request_id=tool_call_id)
    send_event(event, config=config)
    named = ", ".join(handles) or "nothing"
    return f"Noted: {named} will be forgotten at the end of this turn (kept if still needed)."


forget_tool_outputs = StructuredTool.from_function(
    func=_forget,
    name=FORGET_TOOL_NAME,
    description=FORGET_TOOL_DESCRIPTION,
    args_schema=ForgetToolOutputsArgs,
)
"""The LangChain tool; bind it with the agent's other tools (`llm.bind_tools([..., forget_tool_outputs])`)."""
