"""Tool calls in the model's own format: describing tools, forcing a call, reading calls back.

The format (`agentkv.toolformats`: Hermes `<tool_call>`, Llama 3.x JSON, Mistral
`[TOOL_CALLS]`, Granite / Phi-4 `<|tool_call|>`, pythonic) is the backend's
(`ChatFormat.tool_format`, detected from the chat template, or named); every
function here takes it and defaults to Hermes, the protocol agentkv describes in the
system prompt for a template without tool support. The same format renders a call
into history, so the history the model reads and the calls it writes have one shape.

Everything here is deterministic (the tool prompt is a pure function of the tool
list): the system message must render to the same tokens call after call, or the
session's prefix cache would stop matching.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from langchain_core.messages import InvalidToolCall, ToolCall
from langchain_core.messages.tool import invalid_tool_call, tool_call

from agentkv.chat import TOOL_CALL_CLOSE, TOOL_CALL_OPEN
from agentkv.toolformats import (
    HERMES,
    JsonCallFormat,
    ParsedAnswer,
    ReasoningTags,
    ToolFormat,
    split_reasoning,
)

__all__ = [
    "banned_opening",
    "as_langchain",
    "split_answer",
    "ANY_TOOL",
    "CALL_NAME_OPENING",
    "CallEnd",
    "ToolCallBan",
    "TOOL_CALL_CLOSE",
    "TOOL_CALL_OPEN",
    "ToolCallStreamFilter",
    "call_opening",
    "forced_call_prefix",
    "new_tool_call_id",
    "parse_tool_calls",
    "render_tool_prompt",
    "resolve_tool_choice",
    "choose_tool",
    "tool_names",
    "tool_parameters",
]

FORCING_CHOICES = ("any", "required")
"""`tool_choice` values that force some call; the model chooses which of the bound tools."""
ANY_TOOL = "<any bound tool>"
"""What `resolve_tool_choice` returns for a forced call among several tools (not a valid tool name)."""
CALL_NAME_OPENING = HERMES.opening(None)
"""A Hermes call's text up to its tool name: the context in which the model's choice of tool is scored."""
FREE_CHOICES = ("auto", "none")
"""`tool_choice` values that do not force a call ("none" forbids one)."""


def render_tool_prompt(tools: Sequence[Mapping[str, Any]], fmt: ToolFormat = HERMES) -> str:
    """The system-prompt text that describes `tools` and how to call them in `fmt`.

    Args:
        tools: OpenAI-format tool schemas (`{"type": "function", "function": {...}}`),
            as `convert_to_openai_tool` makes them.
        fmt: the tool-call format (default Hermes, `<tool_call>`).

    Returns:
        The same text for the same tools, every time (the prefix cache depends on it).
    """
    return fmt.describe(tools)


def call_opening(name: str, fmt: ToolFormat = HERMES) -> str:
    """A call to `name` up to its arguments: `<tool_call>{"name": "<name>", "arguments": ` in Hermes."""
    return fmt.opening(name)


def forced_call_prefix(
    name: str, parameters: Mapping[str, Any] | None = None, fmt: ToolFormat = HERMES
) -> str:
    """The opening of a call to `name`, prefilled so that even a tiny model emits a parseable call.

    In a JSON format the opening reaches into the arguments object: up to the first
    argument's name (a required one when the schema has any) and, for a string, its
    opening quote; or `{}` for a tool without arguments. Small models left at
    `"arguments": ` write bare values or copy the prompt's placeholder; given the key,
    they only have to write its value. Other formats stop at the call's opening.

    Args:
        name: the tool to call.
        parameters: its JSON schema (`function.parameters` of the OpenAI format), if known.
        fmt: the tool-call format.
    """
    if not isinstance(fmt, JsonCallFormat):
        return fmt.opening(name)
    opening = call_opening(name, fmt) + "{"
    if parameters is None:
        return opening
    properties = parameters.get("properties") or {}
    if not properties:
        return opening + "}"
    required = [key for key in parameters.get("required") or [] if key in properties]
    first = required[0] if required else next(iter(properties))
    schema = properties[first]
    quote = '"' if isinstance(schema, Mapping) and schema.get("type") == "string" else ""
    return f"{opening}{json.dumps(first, ensure_ascii=False)}: {quote}"


def new_tool_call_id() -> str:
    """A fresh tool call id (`call_<8 hex>`): the owner of the call's result span."""
    return f"call_{uuid.uuid4().hex[:8]}"


def tool_names(tools: Sequence[Mapping[str, Any]]) -> list[str]:
    """The function names of OpenAI-format tool schemas, in order."""
    return [str(schema.get("function", {}).get("name", "")) for schema in tools]


def tool_parameters(tools: Sequence[Mapping[str, Any]], name: str) -> Mapping[str, Any] | None:
    """The parameters schema of the tool called `name` (None when absent)."""
    for schema in tools:
        function = schema.get("function", {})
        if function.get("name") == name:
            parameters = function.get("parameters")
            return parameters if isinstance(parameters, Mapping) else None
    return None


def resolve_tool_choice(tool_choice: Any, names: Sequence[str]) -> str | None:
    """Normalise a LangChain `tool_choice` to a tool name to force, "none", or None (model decides).

    Accepted: None / "auto" (model decides), "none" (no call), "any" / "required" / True
    (a call is forced and the model picks the tool: `ANY_TOOL` with several tools, see
    `choose_tool`), a tool name, or a dict naming a function
    (`{"type": "function", "function": {"name": ...}}` or `{"name": ...}`).

    Raises:
        ValueError: the choice names no bound tool, or is not one of the accepted forms.
    """
    if tool_choice is None or tool_choice is False or tool_choice == "auto":
        return None
    if tool_choice == "none":
        return "none"
    if not names:
        msg = f"tool_choice={tool_choice!r} needs at least one bound tool; bind_tools got none"
        raise ValueError(msg)
    if tool_choice is True or tool_choice in FORCING_CHOICES:
        return names[0] if len(set(names)) == 1 else ANY_TOOL
    name: Any = tool_choice
    if isinstance(tool_choice, Mapping):
        function = tool_choice.get("function")
        name = function.get("name") if isinstance(function, Mapping) else tool_choice.get("name")
    if isinstance(name, str) and name in names:
        return name
    allowed = ", ".join([*FREE_CHOICES, *FORCING_CHOICES, *names])
    msg = f"tool_choice: expected one of {allowed} or a dict naming one of the tools, got {tool_choice!r}"
    raise ValueError(msg)


# ---------------------------------------------------------------------------- parsing


def parse_tool_calls(
    text: str, fmt: ToolFormat = HERMES
) -> tuple[str, list[ToolCall], list[InvalidToolCall]]:
    """Split a model answer into its text content and the calls in it (in `fmt`).

    Tolerant of what small models write (see the format's `parse`): whitespace and code
    fences around the JSON, a missing closing tag, `"args"` / `"parameters"` for
    `"arguments"`, arguments as a JSON string, trailing junk, a few missing closing
    braces. A call that still does not parse becomes an `InvalidToolCall` (with the
    name, when one can be read).

    Returns:
        `(content, tool_calls, invalid_tool_calls)`. Without calls, `content` is `text`
        unchanged. With calls, it is the text outside them: the text before the first
        with trailing whitespace removed, then each later piece stripped, joined by
        newlines (so a streamed prefix of the first piece is always a prefix of it).
        Every call gets a fresh id (`call_<8 hex>`) unless the format writes one.
    """
    return as_langchain(fmt.parse(text))


def as_langchain(parsed: ParsedAnswer) -> tuple[str, list[ToolCall], list[InvalidToolCall]]:
    """A parsed answer as LangChain's `(content, tool_calls, invalid_tool_calls)`."""
    calls = [tool_call(name=c.name, args=c.args, id=c.id) for c in parsed.calls]
    invalid = [invalid_tool_call(name=b.name, args=b.raw, id=b.id, error=b.error) for b in parsed.invalid]
    return parsed.content, calls, invalid


def split_answer(text: str, reasoning: ReasoningTags | None) -> tuple[str | None, str]:
    """`(reasoning, rest)` of an answer whose family thinks in `reasoning` tags (None: no split)."""
    if reasoning is None:
        return None, text
    return split_reasoning(text, reasoning)


# ---------------------------------------------------------------------------- streaming


class CallEnd:
    """Tells when a prefilled call's JSON object is complete, so decoding can stop right there.

    A forced call stops at `</tool_call>`, but a small model often closes the object
    and then rambles on instead of writing the tag; counting brackets (outside
    strings) ends the call at its last `}` and saves those tokens.
    """

    def __init__(self, prefix: str, fmt: ToolFormat = HERMES) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.done = False
        # The brackets of a JSON format's opening tags (`[TOOL_CALLS][`) are not the call's.
        opening = fmt.open + fmt.call_open if isinstance(fmt, JsonCallFormat) else ""
        self.feed(prefix.removeprefix(opening))

    def feed(self, text: str) -> bool:
        """Add generated text; True once the call's outermost object has closed."""
        for char in text:
            if self.done:
                break
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char == '"':
                    self.in_string = False
            elif char == '"':
                self.in_string = True
            elif char in "{[":
                self.depth += 1
            elif char in "}]":
                self.depth -= 1
                self.done = self.depth <= 0
        return self.done


class ToolCallStreamFilter:
    """Decides which streamed text is content, when the answer may contain tool calls.

    Text is passed on until the format's call trigger starts (`<tool_call>`); a tail
    that might be the start of the trigger, and trailing whitespace, are held back
    (`parse_tool_calls` drops the whitespace before a call). A reasoning block at the
    start (`<think>…</think>`) is not content: nothing is shown until it closes. What
    was emitted is therefore always a prefix of the final `content`, and the rest is
    sent with the last chunk.
    """

    def __init__(self, fmt: ToolFormat | None = HERMES, reasoning: ReasoningTags | None = None) -> None:
        self.text = ""
        self.emitted = 0
        self.in_call = False
        self.trigger = None if fmt is None else fmt.trigger or '{"name"'
        """What starts a call (None: no tools, so nothing does)."""
        self.reasoning = reasoning
        self.start: int | None = 0 if reasoning is None else None
        """Where the content starts in `text` (after a reasoning block); None: not known yet."""

    def feed(self, piece: str) -> str:
        """Add a piece of generated text; return the part that is safe to show now."""
        self.text += piece
        if self.in_call or not self._content_started():
            return ""
        assert self.start is not None
        start = self.text.find(self.trigger, self.start) if self.trigger else -1
        if start >= 0:
            self.in_call = True
            visible = self.text[:start]
        elif self.trigger:
            visible = self.text[: len(self.text) - _partial_tag(self.text, self.trigger)]
        else:
            visible = self.text
        safe = len(visible.rstrip())
        if safe <= self.start + self.emitted:
            return ""
        out = self.text[self.start + self.emitted : safe]
        self.emitted = safe - self.start
        return out

    def _content_started(self) -> bool:
        if self.start is not None:
            return True
        tags = self.reasoning
        assert tags is not None
        head = self.text.lstrip()
        if not head or tags.open.startswith(head):
            return False  # may still become a reasoning block
        if not head.startswith(tags.open):
            self.start = 0
            return True
        end = self.text.find(tags.close)
        if end < 0:
            return False
        after = end + len(tags.close)
        self.start = after + (len(self.text[after:]) - len(self.text[after:].lstrip()))
        return self.start < len(self.text)

    def rest(self, content: str) -> str:
        """What remains of the final `content` after what was already emitted."""
        begin = self.start or 0
        shown = self.text[begin : begin + self.emitted]
        if not content.startswith(shown):  # cannot happen by construction; never emit twice
            return ""
        return content[len(shown) :]


def _partial_tag(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for keep in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-keep:]):
            return keep
    return 0


# ---------------------------------------------------------------------------- constrained choices


def banned_opening(fmt: ToolFormat) -> str:
    """What a text answer in `fmt` must not write: Hermes' `<tool`, else the format's trigger."""
    if fmt.trigger.startswith(TOOL_CALL_OPEN):
        return _BANNED
    return fmt.trigger.strip().rstrip("[{") or '{"name"'


def choose_tool(score: Any, names: Sequence[str], fmt: ToolFormat = HERMES) -> str:
    """The bound tool the model itself would call, constrained to the bound ones.

    OpenAI's `tool_choice="required"` means "some tool, the model's pick". A prefilled
    call must name one, so the names are scored instead: the teacher-forced
    log-probability of each name (and what closes it) after the format's opening,
    the model's own preference restricted to what is bound.

    Args:
        score: `(answer, prefix) -> log-probability`, e.g. `Session.answer_logprob`.
        names: The bound tools' names.
        fmt: The tool-call format the call is written in.
    """
    opening, end = fmt.opening(None), fmt.name_end
    scores = {name: float(score(f"{name}{end}", prefix=opening)) for name in dict.fromkeys(names)}
    return max(scores, key=lambda name: (scores[name], -names.index(name)))


_BANNED = "<tool"
"""What a Hermes text-only answer must not write: the start of a `<tool_call>` tag."""


class ToolCallBan:
    """A logits processor that keeps a `<tool_call>` tag from being written, and nothing else.

    `tool_choice="none"` (or an answer with no tools bound in a thread whose prompt
    describes tools) must return the text answer: stopping at the tag would return
    whatever came before it (often nothing). Forbidding only the tokens that would
    complete `<tool` lets the model write its answer instead.

    Args:
        tokenizer: The model's tokenizer (each token's text is read once, at construction).
        banned: The text a call starts with (`<tool` in Hermes; another format's trigger).
    """

    def __init__(self, tokenizer: Any, banned: str = _BANNED) -> None:
        self.tokenizer = tokenizer
        self.banned = banned
        size = len(tokenizer)
        texts = [tokenizer.decode([i]) for i in range(size)]
        # contains[i]: token i writes the whole tag start; starts[k][i]: it completes a tag of
        # which the text already ends with the first k characters.
        self.contains = torch.tensor([banned in t for t in texts], dtype=torch.bool)
        self.starts = {
            k: torch.tensor([bool(t) and t.startswith(banned[k:]) for t in texts], dtype=torch.bool)
            for k in range(1, len(banned))
        }

    def __call__(self, produced: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
        """Logits `[V]` with the tag-completing tokens at -inf."""
        tail = self.tokenizer.decode(list(produced[-len(self.banned) :])) if produced else ""
        banned = self.contains.clone()
        for k, mask in self.starts.items():
            if tail.endswith(self.banned[:k]):
                banned |= mask
        vocab = logits.shape[-1]
        if banned.numel() < vocab:  # the model's head may be padded past the tokenizer's size
            banned = torch.cat([banned, torch.zeros(vocab - banned.numel(), dtype=torch.bool)])
        return logits.masked_fill(banned[:vocab].to(logits.device), float("-inf"))
