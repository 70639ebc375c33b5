"""Chat messages in, token ids per message out.

The session needs the token ids of each message separately (one span each), so
it renders the conversation incrementally with the tokenizer's chat template:
message i's text is `render(messages[:i+1])` minus `render(messages[:i])`. That is
exact for templates whose rendering of a prefix is a prefix of the rendering (all
ChatML / Llama-style templates); a template that rewrites earlier text when a
message is added is detected and reported.

Messages may be plain dicts (`{"role", "content", "tool_calls", "tool_call_id",
"id"}`), `(role, content)` tuples, or LangChain message objects (duck-typed:
the core never imports LangChain).
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
"""ChatML, used (with a warning) when a tokenizer has no chat template of its own."""

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"


@dataclass(frozen=True)
class ToolCall:
    """A tool call an assistant message made (OpenAI / LangChain shape)."""

    id: str
    name: str
    args: Mapping[str, Any] = field(default_factory=dict, hash=False)

    def as_json(self) -> str:
        """The call as the `<tool_call>` protocol writes it."""
        return json.dumps({"name": self.name, "arguments": dict(self.args)}, sort_keys=True, default=str)


@dataclass(frozen=True)
class ChatMessage:
    """One normalised chat message."""

    role: str
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    message_id: str | None = None
    name: str | None = None
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
            self.role, self.content, self.tool_calls, self.tool_call_id, tools_json=self.tools_json
        )

    def template_dict(self, *, tools_in_template: bool) -> dict[str, Any]:
        """The dict handed to the chat template."""
        content = self.content
        if self.tool_calls and not tools_in_template:
            calls = "\n".join(
                f"{TOOL_CALL_OPEN}{call.as_json()}{TOOL_CALL_CLOSE}" for call in self.tool_calls
            )
            content = f"{content}\n{calls}" if content else calls
        out: dict[str, Any] = {"role": self.role, "content": content}
        if self.tool_calls and tools_in_template:
            out["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": dict(c.args)}}
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out


def message_fingerprint(
    role: str,
    content: str,
    tool_calls: Sequence[ToolCall] = (),
    tool_call_id: str | None = None,
    *,
    tools_json: str | None = None,
) -> str:
    """Hash of role, content, tool calls and tool_call_id (and the tool schemas a message carries)."""
    fields: list[Any] = [role, content, [[c.id, c.name, dict(c.args)] for c in tool_calls], tool_call_id]
    if tools_json is not None:  # appended only when present: other messages keep their hashes
        fields.append(tools_json)
    payload = json.dumps(fields, sort_keys=True, default=str)
    return hashlib.sha1(payload.encode("utf-8")).hexdigest()


def _check_unicode(text: str, where: str) -> str:
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
        return _check_unicode(content, f"{where}.content")
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
        return _check_unicode("".join(parts), f"{where}.content")
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
        _check_unicode(name, f"{where}.tool_calls[{j}].name")
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
    if role == "tool" and not tool_call_id:
        logger.debug("%s: tool message without tool_call_id; events cannot name it", where)
    message_id = get("id")
    tools = get("tools") if isinstance(message, Mapping) else None
    return ChatMessage(
        role=role,
        content=_content_text(get("content"), where),
        tool_calls=_tool_calls(get("tool_calls"), where) if role == "assistant" else (),
        tool_call_id=str(tool_call_id) if tool_call_id else None,
        message_id=str(message_id) if message_id else None,
        name=get("name") if isinstance(get("name"), str) else None,
        tools_json=_tools_json(tools, where) if tools else None,
    )


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

    A tool result whose `tool_call_id` answers no call made earlier in the list is
    kept (the history may have been trimmed), with a warning: events name results
    by that id, so a typo there silently detaches the result from its lifecycle.
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        msg = f"messages: expected a list of chat messages, got {type(messages).__name__}"
        raise TypeError(msg)
    out = [normalize_message(m, i) for i, m in enumerate(messages)]
    warn_unmatched_tool_results(out)
    return out


_WARNED_RESULTS: set[str] = set()
"""Tool call ids already warned about (each unmatched result is reported once, not every call)."""
_MAX_WARNED = 10_000


def warn_unmatched_tool_results(messages: Sequence[ChatMessage]) -> list[int]:
    """Warn (once per id) about tool results that answer no earlier call; return their indexes."""
    calls: set[str] = set()
    unmatched: list[int] = []
    for i, message in enumerate(messages):
        calls.update(call.id for call in message.tool_calls)
        if message.role == "tool" and message.tool_call_id and message.tool_call_id not in calls:
            unmatched.append(i)
            if message.tool_call_id in _WARNED_RESULTS:
                continue  # the same history comes back every call: say it once
            if len(_WARNED_RESULTS) > _MAX_WARNED:
                _WARNED_RESULTS.clear()
            _WARNED_RESULTS.add(message.tool_call_id)
            known = ", ".join(sorted(calls)[:10]) or "none"
            logger.warning(
                "messages[%d]: tool result for tool_call_id %r answers no earlier tool call (calls: %s); "
                "it is encoded, but lifecycle events for that call will not find it",
                i,
                message.tool_call_id,
                known,
            )
    return unmatched


class ChatFormat:
    """Renders messages with a tokenizer's chat template, message by message."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        template = getattr(tokenizer, "chat_template", None)
        if not template:
            logger.warning(
                "tokenizer has no chat template; using the built-in ChatML fallback "
                "(<|im_start|>role\\ncontent<|im_end|>). Pass a tokenizer with a template for best results."
            )
            template = FALLBACK_CHAT_TEMPLATE
        self.template: str = template if isinstance(template, str) else str(template)
        self.uses_fallback = not getattr(tokenizer, "chat_template", None)
        self.tools_in_template = "tool_calls" in self.template
        self._suffix_ids: list[int] | None = None
        self._prompt_ids: list[int] | None = None
        self._stop_ids: frozenset[int] | None = None

    # -- rendering --------------------------------------------------------------------------

    def render(self, messages: Sequence[ChatMessage], *, add_generation_prompt: bool = False) -> str:
        """The template's text for a conversation."""
        if not messages:
            return ""
        dicts = [m.template_dict(tools_in_template=self.tools_in_template) for m in messages]
        tools_json = next((m.tools_json for m in messages if m.tools_json), None)
        extra: dict[str, Any] = {"tools": json.loads(tools_json)} if tools_json else {}
        text = self.tokenizer.apply_chat_template(
            dicts,
            chat_template=self.template,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **extra,
        )
        return str(text)

    def encode(self, text: str) -> list[int]:
        """Token ids of a piece of template text (special tokens written in it are parsed)."""
        if not text:
            return []
        _check_unicode(text, "text to encode")
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def message_texts(self, messages: Sequence[ChatMessage], start: int) -> list[str]:
        """Text of each message from index `start` on (each the difference of two renders)."""
        texts: list[str] = []
        previous = self.render(messages[:start])
        for i in range(start, len(messages)):
            current = self.render(messages[: i + 1])
            if not current.startswith(previous):
                msg = (
                    f"the chat template rewrites earlier text when message {i} is added, so messages cannot "
                    "be cached one by one; use a template whose rendering is append-only"
                )
                raise ValueError(msg)
            texts.append(current[len(previous) :])
            previous = current
        return texts

    def message_ids(self, messages: Sequence[ChatMessage], start: int = 0) -> list[list[int]]:
        """Token ids of each message from index `start` on."""
        return [self.encode(text) for text in self.message_texts(messages, start)]

    def generation_prompt_ids(self, messages: Sequence[ChatMessage]) -> list[int]:
        """Ids the template adds to ask for an assistant answer (e.g. `<|im_start|>assistant` + newline)."""
        plain = self.render(messages)
        prompted = self.render(messages, add_generation_prompt=True)
        if not prompted.startswith(plain):
            msg = "the chat template's generation prompt rewrites earlier text"
            raise ValueError(msg)
        return self.encode(prompted[len(plain) :])

    def assistant_suffix_ids(self) -> list[int]:
        """Ids the template writes after an assistant message's content (e.g. `<|im_end|>` + newline)."""
        if self._suffix_ids is None:
            marker = "\x1fAGENTKV\x1f"
            probe = [ChatMessage("user", "u"), ChatMessage("assistant", marker)]
            text = self.render(probe)
            self._suffix_ids = self.encode(text[text.index(marker) + len(marker) :])
        return self._suffix_ids

    def stop_token_ids(self) -> set[int]:
        """Token ids that end an assistant turn: EOS and the template's end-of-turn token.

        Computed once: `get_vocab()` builds a dict of the whole vocabulary (~135 ms for
        a 49k vocabulary on a loaded CPU), which was paid before every answer's first token.
        """
        if self._stop_ids is None:
            self._stop_ids = frozenset(self._find_stop_token_ids())
        return set(self._stop_ids)

    def _find_stop_token_ids(self) -> set[int]:
        ids: set[int] = set()
        eos = getattr(self.tokenizer, "eos_token_id", None)
        if isinstance(eos, int):
            ids.add(eos)
        suffix = self.assistant_suffix_ids()
        special = set(getattr(self.tokenizer, "all_special_ids", []) or [])
        if suffix and suffix[0] in special:
            ids.add(suffix[0])
        vocab = self.tokenizer.get_vocab()
        for token in ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>"):
            if token in vocab:
                ids.add(vocab[token])
        return ids
