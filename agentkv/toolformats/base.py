"""What a tool-call format is: how calls are described, written, constrained and read back.

A format is the protocol one model family was trained on for tool calls (Hermes
`<tool_call>`, Llama 3.x JSON, Mistral `[TOOL_CALLS]`, Granite / Phi-4 `<|tool_call|>`,
pythonic `[f(a=1)]`). The same object renders a call into history, builds the
grammar a call is decoded under, and parses the answer, so what the model writes and
what the template renders back into the cache have one shape, and the next call
reuses the cache token for token.

Everything here is a pure function of its inputs (no tokenizer, no model): a
grammar names special tokens through `specials` (token text → id) handed in by the
caller, because the grammar library matches a special token only by its id.
"""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from agentkv.grammar.grammars import PSEUDO_CALLS, json_rule, lark_literal, prelude_rule, text_terminal

__all__ = [
    "CallMode",
    "ParsedAnswer",
    "ParsedCall",
    "BadCall",
    "ToolFormat",
    "new_call_id",
    "tool_functions",
]

CallMode = Literal["forced", "auto"]
"""`forced`: the answer is calls to the given tools (one named tool, or "any" of them);
`auto`: text, or text followed by calls."""


def new_call_id() -> str:
    """A fresh tool call id (`call_<8 hex>`): the owner of the call's result span."""
    return f"call_{uuid.uuid4().hex[:8]}"


@dataclass(frozen=True)
class ParsedCall:
    """A call read from an answer."""

    name: str
    args: dict[str, Any]
    id: str = field(default_factory=new_call_id)


@dataclass(frozen=True)
class BadCall:
    """Call text that could not be read as a call (the name when one could be read)."""

    name: str | None
    raw: str
    error: str
    id: str = field(default_factory=new_call_id)


@dataclass(frozen=True)
class ParsedAnswer:
    """An answer split into its text content and its calls."""

    content: str
    calls: tuple[ParsedCall, ...] = ()
    invalid: tuple[BadCall, ...] = ()


def tool_functions(tools: Sequence[Mapping[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """`(name, parameters schema)` of OpenAI-format tools, in order."""
    out: list[tuple[str, dict[str, Any]]] = []
    for tool in tools:
        function = tool.get("function", tool)
        parameters = function.get("parameters") or {"type": "object", "properties": {}}
        out.append((str(function.get("name", "")), dict(parameters)))
    return out


class ToolFormat(ABC):
    """One family's tool-call protocol (see the module docstring)."""

    name: str
    """The name a user gives to pick this format (`ChatAgentKV(tool_format=...)`, YAML)."""
    trigger: str
    """Text that starts the calls in an answer: a stream shows nothing from there on."""
    result_prefix: str = ""
    result_suffix: str = ""
    """How a tool result is worded as a user turn, for a template without a tool role."""
    name_end: str = '"'
    """What follows a tool's name in a call (its closing quote in JSON)."""
    whole_answer: bool = False
    """Calls are the whole answer (no text before them), so "auto" is text or calls."""

    # -- describing and rendering ---------------------------------------------------------------

    @abstractmethod
    def describe(self, tools: Sequence[Mapping[str, Any]]) -> str:
        """System-prompt text that lists `tools` and says how to call them (for templates without tools)."""

    @abstractmethod
    def render_calls(self, calls: Sequence[tuple[str, Mapping[str, Any], str]]) -> str:
        """The text of `(name, args, id)` calls in an assistant message, as the model writes them."""

    @property
    def call_tail(self) -> str:
        """What the format writes after a call's object closes (`</tool_call>`).

        The grammar asks for it, but decoding stops when the object closes (`CallEnd`).
        """
        return ""

    def render_result(self, content: str) -> str:
        """A tool result as the text of a user turn."""
        return f"{self.result_prefix}{content}{self.result_suffix}"

    # -- constraining -------------------------------------------------------------------------

    @abstractmethod
    def opening(self, name: str | None) -> str:
        """A call's text up to its arguments (`name`), or up to its name's first character (None)."""

    @abstractmethod
    def calls_tail(
        self, tools: Sequence[Mapping[str, Any]], parallel: bool, specials: Mapping[str, int]
    ) -> list[str]:
        """Lark rules whose `tail` rule is the answer's calls to `tools` after `trigger`."""

    def text_bans(self, tools: Sequence[Mapping[str, Any]]) -> tuple[str, ...]:
        """What a text answer may not contain (the openings of calls in any syntax)."""
        own = self.trigger.strip()
        return tuple(dict.fromkeys((*PSEUDO_CALLS, own) if own else PSEUDO_CALLS))

    def grammar(
        self,
        tools: Sequence[Mapping[str, Any]],
        mode: CallMode,
        *,
        parallel: bool = False,
        specials: Mapping[str, int] | None = None,
    ) -> str:
        """The Lark grammar (llguidance dialect) of an answer under `mode` with `tools`.

        `forced`: calls only (the caller prefills `opening`). `auto`: text that cannot
        start a call in any syntax, or text that ends at this format's trigger followed
        by calls that follow their schemas.
        """
        specials = specials or {}
        tail = self.calls_tail(tools, parallel, specials)
        trigger = literal(self.trigger, specials) if self.trigger else ""
        head = f"calls: {trigger} tail" if trigger else "calls: tail"
        if mode == "forced":
            return "\n".join(["start: calls", head, *tail]) + "\n"
        bans = self.text_bans(tools)
        lines = [head, *tail, text_terminal("TEXT", bans)]
        if not self.trigger or self.whole_answer:
            lines.insert(0, "start: TEXT | calls")
        elif any(token in self.trigger for token in specials):
            # A special token cannot be spelled by text: the text simply ends where it comes.
            lines.insert(0, "start: TEXT | TEXT? calls")
        else:
            # The text before a call ends at the first trigger (a lazy lexeme that includes it).
            lines.insert(0, "start: TEXT | prelude tail")
            lines.append(prelude_rule(self.trigger, bans))
        return "\n".join(lines) + "\n"

    # -- reading -------------------------------------------------------------------------------

    @abstractmethod
    def parse(self, text: str) -> ParsedAnswer:
        """Split an answer into content and calls (tolerant of what small models write)."""

    def __repr__(self) -> str:
        return f"<tool format {self.name!r}>"


def args_rule(index: int, parameters: Mapping[str, Any]) -> str:
    """The Lark rule `args_<index>` for one tool's arguments (strict JSON schema)."""
    return f"args_{index}: {json_rule(parameters)}"


def literal(text: str, specials: Mapping[str, int]) -> str:
    """Lark for `text` with special tokens as token references (see `lark_literal`)."""
    return lark_literal(text, specials)


def dumps(value: Any) -> str:
    """JSON as the grammars write it (and chat templates' `tojson`): `, ` / `: `, unicode kept."""
    return json.dumps(value, ensure_ascii=False)
