"""Chat messages, normalised: what a session matches, fingerprints and renders.

Messages may be plain dicts (`{"role", "content", "tool_calls", "tool_call_id",
"id", "reasoning_content"}`), `(role, content)` tuples, or LangChain message objects
(duck-typed: the core never imports LangChain). Rendering them with a chat template
is `agentkv.templates.ChatFormat`.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from agentkv.spans import SpanKind

logger = logging.getLogger("agentkv.chat")

ROLES = ("system", "user", "assistant", "tool")
_LANGCHAIN_TYPES = {
    "system": "system",
    "human": "user",
    "ai": "assistant",
    "tool": "tool",
    "developer": "system",
}
_ROLE_ALIASES = {"human": "user", "ai": "assistant", "developer": "system", "function": "tool"}

FALLBACK_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
"""ChatML, used (with a warning, and the tokenizer's `bos` in front when it has one) when a tokenizer has
no chat template of its own (see `agentkv.templates.ChatFormat`)."""

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"


@dataclass(frozen=True)
class ToolCall:
    """A tool call an assistant message made (OpenAI / LangChain shape)."""

    id: str
    name: str
    args: Mapping[str, Any] = field(default_factory=dict, hash=False)


@dataclass(frozen=True)
class ChatMessage:
    """One normalised chat message."""

    role: str
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    message_id: str | None = None
    name: str | None = None
    reasoning: str | None = None
    """An assistant message's reasoning (`reasoning_content`), rendered where the template keeps it."""
    tools_json: str | None = None
    """Tool schemas (a JSON list) for a chat template with tool support. The first message
    carries them, so a changed tool list changes its fingerprint and re-encodes from there."""

    @property
    def kind(self) -> SpanKind:
        """The span kind this message becomes."""
        if self.role == "assistant" and self.tool_calls:
            return SpanKind.TOOL_CALL
        return {
            "system": SpanKind.SYSTEM,
            "user": SpanKind.USER,
            "assistant": SpanKind.ASSISTANT,
            "tool": SpanKind.TOOL_RESULT,
        }[self.role]

    @property
    def owner(self) -> str | None:
        """What events call this message: its `tool_call_id` for tool results, else its id."""
        return self.tool_call_id if self.role == "tool" and self.tool_call_id else self.message_id

    def fingerprint(self) -> str:
        """Identity used to match an incoming message with a cached one (ids excluded on purpose)."""
        return message_fingerprint(
            self.role,
            self.content,
            self.tool_calls,
            self.tool_call_id,
            tools_json=self.tools_json,
            reasoning=self.reasoning,
        )


def message_fingerprint(
    role: str,
    content: str,
    tool_calls: Sequence[ToolCall] = (),
    tool_call_id: str | None = None,
    *,
    tools_json: str | None = None,
    reasoning: str | None = None,
) -> str:
    """Hash of role, content, tool calls and tool_call_id (and a message's tool schemas or reasoning)."""
    fields: list[Any] = [role, content, [[c.id, c.name, dict(c.args)] for c in tool_calls], tool_call_id]
    if tools_json is not None:  # appended only when present: other messages keep their hashes
        fields.append(tools_json)
    if reasoning:
        fields.append({"reasoning": reasoning})
    payload = json.dumps(fields, sort_keys=True, default=str)
    return hashlib.sha1(payload.encode("utf-8")).hexdigest()


def check_unicode(text: str, where: str) -> str:
    """Return `text` if the tokenizer can encode it, else raise a `ValueError` naming `where`.

    A lone surrogate (from bytes decoded with `errors="surrogateescape"`, or half an
    emoji) makes the Rust tokenizer raise an opaque `TypeError` deep inside the call.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        msg = (
            f"{where}: not valid Unicode text ({e.reason} {text[e.start]!r} at index {e.start}); "
            "decode bytes with errors='replace' before sending them"
        )
        raise ValueError(msg) from None
    return text


def _content_text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return check_unicode(content, f"{where}.content")
    if isinstance(content, Sequence) and not isinstance(content, bytes | bytearray):
        parts: list[str] = []
        for block in content:
            if isinstance(block, str):
                parts.append(block)
            elif isinstance(block, Mapping) and block.get("type") == "text":
                parts.append(str(block.get("text", "")))
            else:
                kind = block.get("type") if isinstance(block, Mapping) else type(block).__name__
                msg = f"{where}.content: only text content is supported, got a {kind!r} block"
                raise ValueError(msg)
        return check_unicode("".join(parts), f"{where}.content")
    msg = f"{where}.content: expected a string or a list of text blocks, got {type(content).__name__}"
    raise TypeError(msg)


def _tool_calls(raw: Any, where: str) -> tuple[ToolCall, ...]:
    if not raw:
        return ()
    if isinstance(raw, str | bytes | Mapping) or not isinstance(raw, Sequence):
        msg = f"{where}.tool_calls: expected a list of tool calls, got {type(raw).__name__}"
        raise TypeError(msg)
    calls: list[ToolCall] = []
    for j, call in enumerate(raw):
        if not isinstance(call, Mapping):
            msg = f"{where}.tool_calls[{j}]: expected a mapping, got {type(call).__name__}"
            raise TypeError(msg)
        if "function" in call:  # OpenAI shape
            function = call["function"]
            if not isinstance(function, Mapping):
                msg = f"{where}.tool_calls[{j}].function: expected a mapping, got {type(function).__name__}"
                raise TypeError(msg)
            args = function.get("arguments", {})
            if isinstance(args, str):
                try:
                    args = json.loads(args) if args else {}
                except json.JSONDecodeError as e:
                    msg = f"{where}.tool_calls[{j}].function.arguments: not valid JSON: {e}"
                    raise ValueError(msg) from e
            name = function.get("name")
        else:  # LangChain shape
            name, args = call.get("name"), call.get("args", {})
        if not isinstance(name, str) or not name:
            msg = f"{where}.tool_calls[{j}].name: expected a non-empty string, got {name!r}"
            raise ValueError(msg)
        check_unicode(name, f"{where}.tool_calls[{j}].name")
        args = args or {}
        if not isinstance(args, Mapping) or not all(isinstance(k, str) for k in args):
            msg = f"{where}.tool_calls[{j}] arguments: expected a mapping with string keys, got {args!r:.60}"
            raise ValueError(msg)
        calls.append(ToolCall(id=str(call.get("id") or f"call_{j}"), name=name, args=dict(args)))
    return tuple(calls)


def normalize_message(message: Any, index: int = 0) -> ChatMessage:
    """Turn a dict, a `(role, content)` tuple or a LangChain message into a `ChatMessage`."""
    where = f"messages[{index}]"
    if isinstance(message, ChatMessage):
        return message
    if isinstance(message, tuple) and len(message) == 2:
        message = {"role": message[0], "content": message[1]}
    if isinstance(message, Mapping):
        role = message.get("role")
        get = message.get
    elif hasattr(message, "type") and hasattr(message, "content"):
        role = _LANGCHAIN_TYPES.get(str(message.type))
        if role is None:
            msg = (
                f"{where}: unsupported message type {message.type!r}; allowed: {', '.join(_LANGCHAIN_TYPES)}"
            )
            raise ValueError(msg)
        obj = message

        def get(key: str, default: Any = None) -> Any:
            return getattr(obj, "id" if key == "id" else key, default)

    else:
        msg = (
            f"{where}: expected a dict with 'role' and 'content', a (role, content) tuple or a chat message, "
        )
        msg += f"got {type(message).__name__}"
        raise TypeError(msg)
    if not isinstance(role, str):
        msg = f"{where}.role: expected a string, got {role!r}"
        raise ValueError(msg)
    role = _ROLE_ALIASES.get(role, role)
    if role not in ROLES:
        msg = f"{where}.role: unknown role {role!r}; allowed: {', '.join(ROLES)}"
        raise ValueError(msg)
    # Only an assistant message that carries tool calls says everything without content.
    calls_only = role == "assistant" and isinstance(message, Mapping) and bool(message.get("tool_calls"))
    if isinstance(message, Mapping) and message.get("content") is None and not calls_only:
        msg = (
            f"{where}: a {role!r} message needs 'content' (a string or a list of text blocks), "
            f"got keys {sorted(map(str, message))}; only an assistant message with tool_calls may omit it"
        )
        raise ValueError(msg)
    tool_call_id = get("tool_call_id")
    message_id = get("id")
    tools = get("tools") if isinstance(message, Mapping) else None
    reasoning = _reasoning(message) if role == "assistant" else None
    return ChatMessage(
        role=role,
        content=_content_text(get("content"), where),
        tool_calls=_tool_calls(get("tool_calls"), where) if role == "assistant" else (),
        tool_call_id=str(tool_call_id) if tool_call_id else None,
        message_id=str(message_id) if message_id else None,
        name=get("name") if isinstance(get("name"), str) else None,
        tools_json=_tools_json(tools, where) if tools else None,
        reasoning=reasoning,
    )


def _reasoning(message: Any) -> str | None:
    """An assistant message's reasoning (a dict's or `additional_kwargs`' `reasoning_content`)."""
    if isinstance(message, Mapping):
        value = message.get("reasoning_content")
    else:
        extra = getattr(message, "additional_kwargs", None) or {}
        value = extra.get("reasoning_content") if isinstance(extra, Mapping) else None
    return value if isinstance(value, str) and value else None


def _tools_json(tools: Any, where: str) -> str:
    if isinstance(tools, (str, bytes)) or not isinstance(tools, Sequence):
        msg = f"{where}.tools: expected a list of tool schemas (dicts), got {type(tools).__name__}"
        raise TypeError(msg)
    for j, schema in enumerate(tools):
        if not isinstance(schema, Mapping):
            msg = f"{where}.tools[{j}]: expected a dict (OpenAI tool schema), got {type(schema).__name__}"
            raise TypeError(msg)
    return json.dumps(list(tools), default=str)


def normalize_messages(messages: Any) -> list[ChatMessage]:
    """Normalise a list of messages, with errors that name the bad index.

    A tool result without a `tool_call_id`, or whose id answers no call made earlier
    in the list, is kept (the history may have been trimmed), with a warning: events
    name results by that id, so a missing id or a typo detaches the result from its lifecycle.
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        msg = f"messages: expected a list of chat messages, got {type(messages).__name__}"
        raise TypeError(msg)
    out = [normalize_message(m, i) for i, m in enumerate(messages)]
    warn_unmatched_tool_results(out)
    return out


_WARNED_RESULTS: set[str] = set()
"""Tool results already warned about, by call id or, without one, by fingerprint (once, not every call)."""
_MAX_WARNED = 10_000


def warn_unmatched_tool_results(messages: Sequence[ChatMessage]) -> list[int]:
    """Warn (once per result) about tool results without an id or answering no earlier call; their indexes."""
    calls: set[str] = set()
    unmatched: list[int] = []
    for i, message in enumerate(messages):
        calls.update(call.id for call in message.tool_calls)
        if message.role != "tool" or (message.tool_call_id and message.tool_call_id in calls):
            continue
        unmatched.append(i)
        key = message.tool_call_id or f"no id: {message.fingerprint()}"
        if key in _WARNED_RESULTS:
            continue  # the same history comes back every call: say it once
        if len(_WARNED_RESULTS) > _MAX_WARNED:
            _WARNED_RESULTS.clear()
        _WARNED_RESULTS.add(key)
        known = ", ".join(sorted(calls)[:10]) or "none"
        if message.tool_call_id is None:
            logger.warning(
                "messages[%d]: tool result without a tool_call_id (calls: %s); it is encoded, but "
                "lifecycle events cannot name it: give it the id of the tool call it answers",
                i,
                known,
            )
        else:
            logger.warning(
                "messages[%d]: tool result for tool_call_id %r answers no earlier tool call (calls: %s); "
                "it is encoded, but lifecycle events for that call will not find it",
                i,
                message.tool_call_id,
                known,
            )
    return unmatched
