"""The `<tool_call>` protocol: describing tools to a model, and reading its calls back.

A chat template without tool support gets the tools in its system prompt, with one
instruction: answer a call as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.
That is the Hermes / Qwen convention, so models trained on it follow it without
further prompting, and it is the same text `agentkv.chat` writes when it renders an
assistant message's tool calls for such a template, so the history the model reads
and the calls it writes have one shape.

Everything here is deterministic (the tool prompt is a pure function of the tool
list): the system message must render to the same tokens call after call, or the
session's prefix cache would stop matching.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from langchain_core.messages import InvalidToolCall, ToolCall
from langchain_core.messages.tool import invalid_tool_call, tool_call

from agentkv.chat import TOOL_CALL_CLOSE, TOOL_CALL_OPEN

__all__ = [
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

TOOL_PROMPT_HEADER = (
    "You can call tools (functions) to help you answer. The tools, one JSON schema per line:\n<tools>\n"
)
TOOL_PROMPT_FOOTER = (
    "\n</tools>\n"
    "To call a tool, reply with its name and its arguments as JSON inside tool_call tags, "
    "one block per call:\n"
    f'{TOOL_CALL_OPEN}{{"name": "<tool name>", "arguments": {{"<argument name>": <argument value>}}}}'
    f"{TOOL_CALL_CLOSE}\n"
    "The result comes back in the next message. If no tool is needed, answer directly."
)

FORCING_CHOICES = ("any", "required")
"""`tool_choice` values that force some call; the model chooses which of the bound tools."""
ANY_TOOL = "<any bound tool>"
"""What `resolve_tool_choice` returns for a forced call among several tools (not a valid tool name)."""
CALL_NAME_OPENING = f'{TOOL_CALL_OPEN}{{"name": "'
"""A call's text up to its tool name: the context in which the model's choice of tool is scored."""
FREE_CHOICES = ("auto", "none")
"""`tool_choice` values that do not force a call ("none" forbids one)."""

_NAME_RE = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_ARG_KEYS = ("arguments", "args", "parameters")
_MAX_CLOSERS = 3
"""How many missing closing braces a truncated call may lack and still be repaired."""


def render_tool_prompt(tools: Sequence[Mapping[str, Any]]) -> str:
    """The system-prompt text that describes `tools` and the `<tool_call>` protocol.

    Args:
        tools: OpenAI-format tool schemas (`{"type": "function", "function": {...}}`),
            as `convert_to_openai_tool` makes them.

    Returns:
        The same text for the same tools, every time (the prefix cache depends on it).
    """
    lines = [json.dumps(dict(schema), ensure_ascii=False) for schema in tools]
    return TOOL_PROMPT_HEADER + "\n".join(lines) + TOOL_PROMPT_FOOTER


def call_opening(name: str) -> str:
    """A call to `name` up to its arguments object: `<tool_call>{"name": "<name>", "arguments": `."""
    return f'{TOOL_CALL_OPEN}{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": '


def forced_call_prefix(name: str, parameters: Mapping[str, Any] | None = None) -> str:
    """The opening of a call to `name`, prefilled so that even a tiny model emits a parseable call.

    The opening reaches into the arguments object: up to the first argument's name
    (a required one when the schema has any) and, for a string, its opening quote;
    or `{}` for a tool without arguments. Small models left at `"arguments": ` write
    bare values or copy the prompt's placeholder; given the key, they only have to
    write its value.

    Args:
        name: the tool to call.
        parameters: its JSON schema (`function.parameters` of the OpenAI format), if known.
    """
    opening = call_opening(name) + "{"
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


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall], list[InvalidToolCall]]:
    """Split a model answer into its text content and the `<tool_call>` blocks in it.

    Tolerant of what small models write: whitespace and code fences around the JSON,
    a missing closing tag (the generation ended, or the next call began), `"args"` or
    `"parameters"` for `"arguments"`, arguments as a JSON string, trailing junk after
    the object, and up to three missing closing braces. A block that still does not
    parse becomes an `InvalidToolCall` (with the name, when one can be read).

    Args:
        text: the answer as generated (including any prefilled call opening).

    Returns:
        `(content, tool_calls, invalid_tool_calls)`. Without blocks, `content` is `text`
        unchanged. With blocks, it is the text outside them: the text before the first
        block with trailing whitespace removed, then each later piece stripped, joined
        by newlines (so a streamed prefix of the first piece is always a prefix of it).
        Every call gets a fresh id (`call_<8 hex>`).
    """
    if TOOL_CALL_OPEN not in text:
        return text, [], []
    outside: list[str] = []
    calls: list[ToolCall] = []
    invalid: list[InvalidToolCall] = []
    position = 0
    while (start := text.find(TOOL_CALL_OPEN, position)) >= 0:
        outside.append(text[position:start])
        body_start = start + len(TOOL_CALL_OPEN)
        # Tags are looked for after the call's JSON object: its strings may contain them.
        search = _object_end(text, body_start) or body_start
        ends = [i for i in (text.find(TOOL_CALL_CLOSE, search), text.find(TOOL_CALL_OPEN, search)) if i >= 0]
        body_end = min(ends) if ends else len(text)
        _read_call(text[body_start:body_end], calls, invalid)
        position = body_end
        if text.startswith(TOOL_CALL_CLOSE, position):
            position += len(TOOL_CALL_CLOSE)
    outside.append(text[position:])
    pieces = [outside[0].rstrip()] + [piece.strip() for piece in outside[1:]]
    return "\n".join(piece for piece in pieces if piece), calls, invalid


def _object_end(text: str, start: int) -> int | None:
    """Where the JSON object that opens a block ends, if the block holds a complete one.

    A constrained call is a complete JSON object, and its string values may contain
    anything, the closing tag included: the block's end tag is looked for after the
    object. None when the block does not start with a complete object.
    """
    at = start
    while at < len(text) and text[at].isspace():
        at += 1
    if not text.startswith("{", at):
        return None
    try:
        obj, end = json.JSONDecoder().raw_decode(text, at)
    except json.JSONDecodeError:
        return None
    return end if isinstance(obj, dict) else None


def _read_call(body: str, calls: list[ToolCall], invalid: list[InvalidToolCall]) -> None:
    call_id = new_tool_call_id()
    raw = _strip_fence(body.strip())
    obj, error = _load_object(raw)
    if obj is not None:
        name = obj.get("name")
        args: Any = next((obj[key] for key in _ARG_KEYS if key in obj), {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as e:
                args, error = None, f"arguments: not valid JSON: {e}"
        if not isinstance(name, str) or not name:
            error = f'"name": expected a non-empty string, got {name!r}'
        elif not isinstance(args, dict):
            error = error or f'"arguments": expected a JSON object, got {type(args).__name__}'
        else:
            calls.append(tool_call(name=name, args=args, id=call_id))
            return
    match = _NAME_RE.search(raw)
    name_guess = json.loads(f'"{match.group(1)}"') if match else None
    invalid.append(invalid_tool_call(name=name_guess, args=raw, id=call_id, error=error))


def _strip_fence(raw: str) -> str:
    """Unwrap a Markdown code fence around the JSON (some models write one)."""
    if raw.startswith("```"):
        raw = raw[3:]
        raw = raw[4:] if raw.startswith("json") else raw
        raw = raw[: raw.rfind("```")] if raw.rstrip().endswith("```") else raw
    return raw.strip()


def _load_object(raw: str) -> tuple[dict[str, Any] | None, str | None]:
    """The first JSON object in `raw`, repairing trailing junk and a few missing `}`."""
    decoder = json.JSONDecoder()
    first_error: str | None = None
    for closers in range(_MAX_CLOSERS + 1):
        try:
            obj, _ = decoder.raw_decode(raw + "}" * closers)
        except json.JSONDecodeError as e:
            first_error = first_error or f"not valid JSON: {e}"
            continue
        if isinstance(obj, dict):
            return obj, None
        return None, f"expected a JSON object, got {type(obj).__name__}"
    return None, first_error


# ---------------------------------------------------------------------------- streaming


class CallEnd:
    """Tells when a prefilled call's JSON object is complete, so decoding can stop right there.

    A forced call stops at `</tool_call>`, but a small model often closes the object
    and then rambles on instead of writing the tag; counting brackets (outside
    strings) ends the call at its last `}` and saves those tokens.
    """

    def __init__(self, prefix: str) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.done = False
        self.feed(prefix.removeprefix(TOOL_CALL_OPEN))

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

    Text is passed on until a `<tool_call>` tag starts; a tail that might be the start
    of the tag, and trailing whitespace, are held back (`parse_tool_calls` drops the
    whitespace before a block). What was emitted is therefore always a prefix of the
    final `content`, and the rest is sent with the last chunk.
    """

    def __init__(self) -> None:
        self.text = ""
        self.emitted = 0
        self.in_call = False

    def feed(self, piece: str) -> str:
        """Add a piece of generated text; return the part that is safe to show now."""
        self.text += piece
        if self.in_call:
            return ""
        start = self.text.find(TOOL_CALL_OPEN)
        if start >= 0:
            self.in_call = True
            visible = self.text[:start]
        else:
            visible = self.text[: len(self.text) - _partial_tag(self.text)]
        safe = len(visible.rstrip())
        if safe <= self.emitted:
            return ""
        out = self.text[self.emitted : safe]
        self.emitted = safe
        return out

    def rest(self, content: str) -> str:
        """What remains of the final `content` after what was already emitted."""
        shown = self.text[: self.emitted]
        if not content.startswith(shown):  # cannot happen by construction; never emit twice
            return ""
        return content[len(shown) :]


def _partial_tag(text: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `<tool_call>`."""
    for keep in range(min(len(TOOL_CALL_OPEN) - 1, len(text)), 0, -1):
        if TOOL_CALL_OPEN.startswith(text[-keep:]):
            return keep
    return 0


# ---------------------------------------------------------------------------- constrained choices


def choose_tool(score: Any, names: Sequence[str]) -> str:
    """The bound tool the model itself would call, constrained to the bound ones.

    OpenAI's `tool_choice="required"` means "some tool, the model's pick". A prefilled
    call must name one, so the names are scored instead: the teacher-forced
    log-probability of each name (and its closing quote) after `CALL_NAME_OPENING`,
    the model's own preference restricted to what is bound.

    Args:
        score: `(answer, prefix) -> log-probability`, e.g. `Session.answer_logprob`.
        names: The bound tools' names.
    """
    scores = {name: float(score(f'{name}"', prefix=CALL_NAME_OPENING)) for name in dict.fromkeys(names)}
    return max(scores, key=lambda name: (scores[name], -names.index(name)))


_BANNED = "<tool"
"""What a text-only answer must not write: the start of a `<tool_call>` tag."""


class ToolCallBan:
    """A logits processor that keeps a `<tool_call>` tag from being written, and nothing else.

    `tool_choice="none"` (or an answer with no tools bound in a thread whose prompt
    describes tools) must return the text answer: stopping at the tag would return
    whatever came before it (often nothing). Forbidding only the tokens that would
    complete `<tool` lets the model write its answer instead.

    Args:
        tokenizer: The model's tokenizer (each token's text is read once, at construction).
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        size = len(tokenizer)
        texts = [tokenizer.decode([i]) for i in range(size)]
        # contains[i]: token i writes the whole tag start; starts[k][i]: it completes a tag of
        # which the text already ends with the first k characters.
        self.contains = torch.tensor([_BANNED in t for t in texts], dtype=torch.bool)
        self.starts = {
            k: torch.tensor([bool(t) and t.startswith(_BANNED[k:]) for t in texts], dtype=torch.bool)
            for k in range(1, len(_BANNED))
        }

    def __call__(self, produced: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
        """Logits `[V]` with the tag-completing tokens at -inf."""
        tail = self.tokenizer.decode(list(produced[-len(_BANNED) :])) if produced else ""
        banned = self.contains.clone()
        for k, mask in self.starts.items():
            if tail.endswith(_BANNED[:k]):
                banned |= mask
        vocab = logits.shape[-1]
        if banned.numel() < vocab:  # the model's head may be padded past the tokenizer's size
            banned = torch.cat([banned, torch.zeros(vocab - banned.numel(), dtype=torch.bool)])
        return logits.masked_fill(banned[:vocab].to(logits.device), float("-inf"))
