"""Tool-call formats whose calls are JSON objects `{"name": ..., "<args key>": {...}}`.

One class covers the families that differ only in the text around the objects:
Hermes / Qwen wrap each call in `<tool_call>` tags, Llama 3.x writes the bare object
with `"parameters"`, Mistral a `[TOOL_CALLS]` list with a 9-character call id, Granite
a `<|tool_call|>` list, Phi-4-mini one `<|tool_call|>` block per call. The rendering,
the grammar and the parser are built from the same fields, so they cannot disagree.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from typing_extensions import override

from agentkv.toolformats.base import (
    BadCall,
    ParsedAnswer,
    ParsedCall,
    ToolFormat,
    args_rule,
    dumps,
    literal,
    tool_functions,
)
from agentkv.toolformats.repair import load_object, read_value, strip_fence

__all__ = ["JsonCallFormat"]

_NAME_RE = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_ARG_KEYS = ("arguments", "args", "parameters")
ID_LENGTH = 9
"""Mistral's call ids: 9 letters or digits (its template refuses others)."""


@dataclass(frozen=True, repr=False)
class JsonCallFormat(ToolFormat):
    """Calls as JSON objects; see the module docstring for the families it covers."""

    name: str
    open: str = ""
    """Text before all calls of an answer (`[TOOL_CALLS][`)."""
    close: str = ""
    """Text after all calls (`]`)."""
    call_open: str = ""
    """Text before each call (`<tool_call>`)."""
    call_close: str = ""
    """Text after each call (`</tool_call>`)."""
    separator: str = "\n"
    """Between two calls."""
    args_key: str = "arguments"
    call_id: bool = False
    """Each call carries an `"id"` of `ID_LENGTH` letters and digits after its arguments."""
    single: bool = False
    """The family makes one call per answer (Llama 3.x)."""
    header: str = (
        "You can call tools (functions) to help you answer. The tools, one JSON schema per line:\n<tools>\n"
    )
    footer: str = "\n</tools>\n"
    """`describe` is `header`, the JSON schemas joined by `tools_joiner`, then `footer` (how to call)."""
    tools_joiner: str = "\n"
    result_prefix: str = ""
    result_suffix: str = ""
    extra_triggers: tuple[str, ...] = ()
    """Other text a call may start with when reading (Llama's `<|python_tag|>`)."""

    @property
    @override
    def trigger(self) -> str:  # type: ignore[override]
        return self.open or self.call_open

    @property
    @override
    def call_tail(self) -> str:
        return self.call_close + self.close

    # -- describing and rendering ---------------------------------------------------------------

    @override
    def describe(self, tools: Sequence[Mapping[str, Any]]) -> str:
        lines = self.tools_joiner.join(json.dumps(dict(schema), ensure_ascii=False) for schema in tools)
        return f"{self.header}{lines}{self.footer}"

    @override
    def render_calls(self, calls: Sequence[tuple[str, Mapping[str, Any], str]]) -> str:
        bodies = [self._body(name, args, call_id) for name, args, call_id in calls]
        inner = self.separator.join(f"{self.call_open}{body}{self.call_close}" for body in bodies)
        return f"{self.open}{inner}{self.close}"

    def _body(self, name: str, args: Mapping[str, Any], call_id: str) -> str:
        body = f'{{"name": {dumps(name)}, "{self.args_key}": {dumps(dict(args))}'
        if self.call_id:
            body += f', "id": {dumps(short_id(call_id))}'
        return body + "}"

    @override
    def opening(self, name: str | None) -> str:
        head = f"{self.open}{self.call_open}"
        if name is None:
            return head + '{"name": "'
        return f'{head}{{"name": {dumps(name)}, "{self.args_key}": '

    # -- constraining ---------------------------------------------------------------------------

    @override
    def calls_tail(
        self, tools: Sequence[Mapping[str, Any]], parallel: bool, specials: Mapping[str, int]
    ) -> list[str]:
        if not tools:
            msg = f"{self.name} grammar: no tools"
            raise ValueError(msg)
        names: list[str] = []
        rules: list[str] = []
        id_part = ' ", \\"id\\": \\"" CALL_ID "\\""' if self.call_id else ""
        for i, (name, parameters) in enumerate(tool_functions(tools)):
            head = literal(f'{{"name": {dumps(name)}, "{self.args_key}": ', specials)
            rules.append(f'body_{i}: {head} args_{i}{id_part} "}}"')
            rules.append(args_rule(i, parameters))
            names.append(f"body_{i}")
        close_call = literal(self.call_close, specials) if self.call_close else ""
        open_call = literal(self.call_open, specials) if self.call_open else ""
        close_all = literal(self.close, specials) if self.close else ""
        sep = literal(self.separator, specials) if self.separator else ""
        # The trigger is the calls' opening (`open`, else the first call's `call_open`).
        first = f"body {close_call}".strip() if not self.open else f"{open_call} body {close_call}".strip()
        later = f"{sep} {open_call} body {close_call}".split()
        more = f" ({' '.join(later)})*" if parallel and not self.single else ""
        lines = [f"tail: {first}{more} {close_all}".rstrip(), f"body: {' | '.join(names)}", *rules]
        if self.call_id:
            lines.append(f"CALL_ID: /[a-zA-Z0-9]{{{ID_LENGTH}}}/")
        return lines

    # -- reading --------------------------------------------------------------------------------

    @override
    def parse(self, text: str) -> ParsedAnswer:
        """Content and calls: every call region read in turn, and the text outside them.

        The content is the text before the first call right-stripped, then each later
        piece stripped, joined by newlines.
        """
        calls: list[ParsedCall] = []
        invalid: list[BadCall] = []
        pieces: list[str] = []
        position = 0
        while (start := self._next_call(text, position)) is not None:
            pieces.append(text[position:start])
            at = start
            for tag in (*self.extra_triggers, self.open):
                if tag and text.startswith(tag, at):
                    at += len(tag)
                    break
            end = self._read_calls(text, at, calls, invalid)
            position = max(end, at + 1)
        if not pieces:
            return ParsedAnswer(text)
        pieces.append(text[position:])
        kept = [pieces[0].rstrip()] + [piece.strip() for piece in pieces[1:]]
        return ParsedAnswer("\n".join(p for p in kept if p), tuple(calls), tuple(invalid))

    def _next_call(self, text: str, position: int) -> int | None:
        """Where the next call region starts at or after `position` (None: no more)."""
        tags = [t for t in (self.trigger, *self.extra_triggers) if t]
        found = [at for at in (text.find(t, position) for t in tags) if at >= 0]
        if not self.trigger and position == 0:  # a bare object: the call is the answer
            stripped = text.lstrip()
            if stripped.startswith("{") and _NAME_RE.match(stripped[1:].lstrip()):
                found.append(len(text) - len(stripped))
        return min(found) if found else None

    def _read_calls(self, text: str, at: int, calls: list[ParsedCall], invalid: list[BadCall]) -> int:
        """Read calls from `at`; return where the call text ends."""
        while True:
            while at < len(text) and (text[at].isspace() or text[at] in ",;"):
                at += 1
            if self.call_open and text.startswith(self.call_open, at):
                at += len(self.call_open)
            if self.open.endswith("[") and text.startswith("[", at):
                at += 1  # a list opened twice by a model that repeats it
            value, end = read_value(text, at)
            if isinstance(value, list):
                for item in value:
                    self._read_one(item, json.dumps(item), calls, invalid)
            elif value is not None:
                self._read_one(value, text[at:end], calls, invalid)
            else:
                raw, end = self._raw_block(text, at)
                if raw:
                    self._read_raw(raw, calls, invalid)
                return end
            at = end
            close = self.call_close.strip()
            if close:  # a block ends at its closing tag (what a model wrote before it is junk)
                found, again = text.find(close, at), text.find(self.trigger, at)
                if found >= 0 and (again < 0 or found < again):
                    at = found + len(close)
            probe = at
            while probe < len(text) and (text[probe].isspace() or text[probe] in ",;"):
                probe += 1
            nxt = text[probe:]
            if self.close and nxt.startswith(self.close):
                return probe + len(self.close)
            if (self.call_open and nxt.startswith(self.call_open)) or (
                nxt.startswith("{") and not self.call_open
            ):
                at = probe
                continue
            return at

    def _raw_block(self, text: str, at: int) -> tuple[str, int]:
        """A call that is not valid JSON: up to the next closing tag, or the end."""
        close = self.call_close.strip()
        found = text.find(close, at) if close else -1
        again = text.find(self.trigger, at) if self.trigger else -1
        ends = [i for i in (found, again) if i >= 0]
        end = min(ends) if ends else len(text)
        raw = text[at:end]
        return raw, end + len(close) if found >= 0 and end == found else end

    def _read_raw(self, raw: str, calls: list[ParsedCall], invalid: list[BadCall]) -> None:
        cleaned = strip_fence(raw.strip())
        obj, error = load_object(cleaned)
        if obj is not None:
            self._read_one(obj, cleaned, calls, invalid)
            return
        match = _NAME_RE.search(cleaned)
        name = json.loads(f'"{match.group(1)}"') if match else None
        invalid.append(BadCall(name=name, raw=cleaned, error=error or "not a call"))

    def _read_one(self, obj: Any, raw: str, calls: list[ParsedCall], invalid: list[BadCall]) -> None:
        if not isinstance(obj, dict):
            invalid.append(BadCall(None, raw, f"expected a JSON object, got {type(obj).__name__}"))
            return
        if isinstance(obj.get("function"), dict):  # OpenAI shape
            obj = {**obj["function"], **({"id": obj["id"]} if "id" in obj else {})}
        name = obj.get("name")
        args: Any = next((obj[key] for key in _ARG_KEYS if key in obj), {})
        error = None
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as e:
                args, error = None, f"arguments: not valid JSON: {e}"
        if not isinstance(name, str) or not name:
            invalid.append(BadCall(None, raw, f'"name": expected a non-empty string, got {name!r}'))
        elif not isinstance(args, dict):
            invalid.append(BadCall(name, raw, error or f'"{self.args_key}": expected a JSON object'))
        elif self.call_id and isinstance(obj.get("id"), str) and obj["id"]:
            calls.append(ParsedCall(name, args, obj["id"]))
        else:
            calls.append(ParsedCall(name, args))


def short_id(call_id: str) -> str:
    """`call_id` as 9 letters and digits (kept when it already is; else derived from it, stably)."""
    if len(call_id) == ID_LENGTH and call_id.isalnum():
        return call_id
    import hashlib

    return hashlib.sha1(call_id.encode("utf-8")).hexdigest()[:ID_LENGTH]
