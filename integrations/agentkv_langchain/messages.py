"""LangChain messages as the plain chat dicts a session reads."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from langchain_core.messages import (
    AIMessage,
    BaseMessage,
    ChatMessage,
    FunctionMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)

__all__ = ["to_chat_dicts"]

_SKIPPED_BLOCKS = frozenset(
    {
        "tool_use",
        "tool_call",
        "tool_call_chunk",
        "invalid_tool_call",
        "server_tool_call",
        "reasoning",
        "thinking",
    }
)
"""Content blocks a text model does not read: tool calls travel in `tool_calls`; past reasoning is dropped."""


def to_chat_dicts(messages: Sequence[BaseMessage]) -> list[dict[str, Any]]:
    """LangChain messages as the plain dicts `Session.extend` reads.

    Ids become span owners (a `ToolMessage` is owned by its `tool_call_id`), tool
    calls travel in `tool_calls`, and content is reduced to its text: tool-call and
    reasoning blocks are skipped, and media blocks are refused (a text model cannot
    read them; better an error than an answer about an image it never saw).

    Raises:
        ValueError: a message has image, audio or file content, or an unknown type.
    """
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        entry: dict[str, Any] = {"role": _role(message, i), "content": _text(message.content, i)}
        if message.id:
            entry["id"] = message.id
        if isinstance(message.name, str) and message.name:
            entry["name"] = message.name
        reasoning = (
            message.additional_kwargs.get("reasoning_content") if isinstance(message, AIMessage) else None
        )
        if isinstance(reasoning, str) and reasoning:
            entry["reasoning_content"] = reasoning  # the template renders it where the family keeps it
        if isinstance(message, AIMessage) and message.tool_calls:
            entry["tool_calls"] = [
                {"id": c.get("id"), "name": c["name"], "args": c["args"]} for c in message.tool_calls
            ]
        if isinstance(message, ToolMessage):
            entry["tool_call_id"] = message.tool_call_id
        out.append(entry)
    return out


def _role(message: BaseMessage, index: int) -> str:
    if isinstance(message, SystemMessage):
        return "system"
    if isinstance(message, HumanMessage):
        return "user"
    if isinstance(message, AIMessage):
        return "assistant"
    if isinstance(message, (ToolMessage, FunctionMessage)):
        return "tool"
    if isinstance(message, ChatMessage):
        return message.role
    msg = f"messages[{index}]: unsupported message type {type(message).__name__}"
    raise ValueError(msg)


def _text(content: str | list[str | dict[str, Any]], index: int) -> str:
    if isinstance(content, str):
        return content
    parts: list[str] = []
    for block in content:
        if isinstance(block, str):
            parts.append(block)
            continue
        kind = block.get("type")
        if kind == "text":
            parts.append(str(block.get("text", "")))
        elif kind not in _SKIPPED_BLOCKS:
            msg = (
                f"messages[{index}].content: a {kind!r} block cannot be read by a text-only local model; "
                f"allowed: text blocks (skipped: {', '.join(sorted(_SKIPPED_BLOCKS))})"
            )
            raise ValueError(msg)
    return "".join(parts)
