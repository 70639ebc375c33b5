"""The forgetting protocol: handles, the forced-call opening, the answer's grammar, the events.

Pure functions and frozen events, no session: `agentkv.forget.controller` runs the side
thread with them, and `agentkv_langchain.forget` builds the tool on the same names.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from agentkv.events import Custom, Event
from agentkv.toolformats import HERMES, ToolFormat

FORGET_EVENT = "forget_tool_output"
"""The `Custom` event name a forgotten result is released with (rules key `custom:forget_tool_output`)."""

FORGET_TOOL_NAME = "forget_tool_outputs"
"""The tool the side thread answers with, and the LangChain tool the main agent can call."""

FORGET_TOOL_PARAMETERS: dict[str, object] = {
    "type": "object",
    "properties": {
        "handles": {
            "type": "array",
            "items": {"type": "string"},
            "description": "Handles of tool results no longer needed (T1 = the first tool result).",
        }
    },
    "required": ["handles"],
}
"""JSON schema of the tool's arguments (OpenAI `function.parameters`)."""

SIDE_THREAD_BRANCH = "agentkv-forget"
"""Branch name prefix of the side thread's forks (`<session>/agentkv-forget-<n>`)."""

_HANDLE_RE = re.compile(r"^[Tt](\d+)$")
_WORD_RE = re.compile(r"[\w][\w.:/-]*\w|\w")
_CITE_WORDS = 4
"""A run of this many words shared by the last answer and a result counts as citing it."""


_PROBE_HANDLE = "T0"
"""A handle no conversation has (handles start at `T1`): where the opening is cut."""


def handle_of(index: int) -> str:
    """The handle of the `index`-th (0-based) tool result of a conversation: `T<index + 1>`."""
    return f"T{index + 1}"


def side_thread_opening(fmt: ToolFormat = HERMES) -> str:
    """The prefilled opening of the side thread's answer: a forced `forget_tool_outputs` call, up to `[`.

    The call as the session's tool-call format `fmt` writes it, cut before its first
    handle (`<tool_call>{"name": "forget_tool_outputs", "arguments": {"handles": [` in
    Hermes, `[forget_tool_outputs(handles=[` in the pythonic format): the model only
    writes handles and `]`, in the protocol it was trained on. In Hermes it is what
    `agentkv_langchain.tools.forced_call_prefix(FORGET_TOOL_NAME, FORGET_TOOL_PARAMETERS)`
    writes, plus the list's opening bracket.
    """
    rendered = fmt.render_calls([(FORGET_TOOL_NAME, {"handles": [_PROBE_HANDLE]}, "forget")])
    return rendered[: rendered.index(json.dumps(_PROBE_HANDLE))]


# ---------------------------------------------------------------------------- events


@dataclass(frozen=True)
class ForgetRequested(Event):
    """The main agent asks to forget tool results by handle (its `forget_tool_outputs` call).

    Checked against the guard rails now, applied at the next turn boundary as
    `ToolOutputForgotten` events. Unknown handles make the whole request a logged no-op.
    """

    name: ClassVar[str] = "forget_requested"
    handles: tuple[str, ...] = ()
    """Handles such as `T1` (the conversation's first tool result)."""
    source: str = "agent"
    """Who decided: `agent` (the tool) or `side_thread`."""
    request_id: str = ""
    """Distinguishes two requests with the same handles (e.g. the tool call id); "" = none."""


@dataclass(frozen=True)
class ToolOutputForgotten(Custom):
    """A tool result released because the model said it is no longer needed.

    A `Custom` event (rules key `custom:forget_tool_output`, target `owner` = the
    result's `tool_call_id`); `at_turn` keeps two decisions about the same result in
    different turns distinct (a result recalled after being forgotten can be forgotten
    again).
    """

    event: str = FORGET_EVENT
    at_turn: int = 0


def parse_forget_answer(text: str, offered: Sequence[str]) -> tuple[tuple[str, ...], str | None]:
    """Read the handles the side thread named after the prefilled `"handles": [`.

    The list must be closed (`]`) and hold only offered handles, separated by commas,
    each quoted as JSON or bare (small models drop the quotes: `T1, T3]` is as clear
    as `"T1", "T3"]`; case-insensitive, `t3` reads as `T3`). Anything else — an
    unclosed list, a handle that was not offered, any other text — rejects the whole
    answer: a malformed answer releases nothing. Duplicates are dropped, order kept.

    Returns:
        `(handles, None)`, or `((), reason)` when the answer is rejected.
    """
    end = text.find("]")
    if end < 0:
        return (), f"no closing ] in {text[:80]!r} (the answer ran out of tokens)"
    body = text[:end].strip()
    items = [_unquote(item) for item in body.split(",")] if body else []
    if any(item is None for item in items):
        return (), f"not a list of handles: {text[: end + 1][:80]!r}"
    return check_handles(items, offered)


def _unquote(item: str) -> str | None:
    """A list item as text: `"T1"` or bare `T1`; None for an empty item or stray quotes."""
    item = item.strip()
    if len(item) >= 2 and item[0] == item[-1] == '"':
        item = item[1:-1]
    return item if item and '"' not in item else None


def check_handles(items: Sequence[object], offered: Sequence[str]) -> tuple[tuple[str, ...], str | None]:
    """Normalise handles (`t3` -> `T3`) and check each is offered; `((), reason)` on the first bad one."""
    allowed = set(offered)
    out: list[str] = []
    for item in items:
        match = _HANDLE_RE.match(item.strip()) if isinstance(item, str) else None
        handle = f"T{match.group(1)}" if match else None
        if handle is None or handle not in allowed:
            return (), f"{item!r} is not one of the offered handles ({', '.join(offered) or 'none'})"
        if handle not in out:
            out.append(handle)
    return tuple(out), None


def cites(answer: str, result: str) -> bool:
    """Whether an answer cites a tool result (heuristic, errs on the side of keeping).

    Cited = the answer repeats a word with a digit in it (a number, a code, a date:
    what answers quote from tool output) that occurs in the result, or a run of
    four consecutive words of the result.
    """
    answer_words = [w.casefold() for w in _WORD_RE.findall(answer)]
    if not answer_words:
        return False
    result_words = [w.casefold() for w in _WORD_RE.findall(result)]
    result_set = set(result_words)
    if any(len(w) >= 2 and any(c.isdigit() for c in w) and w in result_set for w in answer_words):
        return True
    runs = {tuple(result_words[i : i + _CITE_WORDS]) for i in range(len(result_words) - _CITE_WORDS + 1)}
    return any(
        tuple(answer_words[i : i + _CITE_WORDS]) in runs for i in range(len(answer_words) - _CITE_WORDS + 1)
    )


def went_astray(text: str, offered: Sequence[str]) -> bool:
    """Whether a complete item so far (before the last comma) is already not an offered handle."""
    done = text.split(",")[:-1]
    return any(check_handles([item], offered)[1] is not None for item in map(_unquote, done) if item) or any(
        _unquote(item) is None for item in done
    )
