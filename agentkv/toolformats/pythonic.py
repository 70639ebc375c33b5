"""Pythonic calls: `[get_weather(city="Paris"), get_time(zone="CET")]` (Llama 3.2 / 4 can write them).

Arguments are keyword arguments whose values are JSON literals (`true`, `null` and
Python's `True`, `None` are both read). The grammar writes a tool's required arguments
in schema order, then its optional ones, each optional, in order.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from typing_extensions import override

from agentkv.grammar.grammars import json_rule
from agentkv.toolformats.base import BadCall, ParsedAnswer, ParsedCall, ToolFormat, dumps, tool_functions

__all__ = ["PYTHONIC", "PythonicFormat"]

_CALLS_RE = re.compile(r"\[\s*[A-Za-z_][\w.]*\s*\(")
_JSON_NAMES = {"true": True, "false": False, "null": None}


@dataclass(frozen=True, repr=False)
class PythonicFormat(ToolFormat):
    """Calls as a Python list of function calls with keyword arguments."""

    name: str = "pythonic"
    trigger: str = "["
    whole_answer: bool = True
    name_end: str = "("

    @override
    def describe(self, tools: Sequence[Mapping[str, Any]]) -> str:
        lines = "\n".join(json.dumps(dict(schema), ensure_ascii=False) for schema in tools)
        return (
            "You can call these functions, described as JSON schemas, one per line:\n"
            f"{lines}\n"
            "To call functions, reply with only a Python list of calls with keyword arguments, "
            'e.g. [func_name1(param1="value1", param2=2), func_name2(param=true)].'
        )

    @override
    def render_calls(self, calls: Sequence[tuple[str, Mapping[str, Any], str]]) -> str:
        rendered = [
            f"{name}({', '.join(f'{k}={dumps(v)}' for k, v in args.items())})" for name, args, _ in calls
        ]
        return f"[{', '.join(rendered)}]"

    @override
    def opening(self, name: str | None) -> str:
        return "[" if name is None else f"[{name}("

    @override
    def text_bans(self, tools: Sequence[Mapping[str, Any]]) -> tuple[str, ...]:
        names = tuple(f"[{name}(" for name, _ in tool_functions(tools))
        return (*super().text_bans(tools)[:-1], *names)

    @override
    def calls_tail(
        self, tools: Sequence[Mapping[str, Any]], parallel: bool, specials: Mapping[str, int]
    ) -> list[str]:
        del specials
        rules: list[str] = []
        bodies: list[str] = []
        for i, (name, parameters) in enumerate(tool_functions(tools)):
            properties: Mapping[str, Any] = parameters.get("properties") or {}
            required = [k for k in parameters.get("required") or [] if k in properties]
            optional = [k for k in properties if k not in required]
            items = []
            for j, key in enumerate([*required, *optional]):
                rules.append(f"arg_{i}_{j}: {json.dumps(f'{key}=')} {json_rule(properties[key])}")
                items.append((f"arg_{i}_{j}", key in required))
            rules.append(f'body_{i}: {json.dumps(name + "(")} {_arguments(items)} ")"')
            bodies.append(f"body_{i}")
        more = ' (", " body)*' if parallel else ""
        return [f'tail: body{more} "]"', f"body: {' | '.join(bodies)}", *rules]

    @override
    def parse(self, text: str) -> ParsedAnswer:
        match = _CALLS_RE.search(text)
        if match is None:
            return ParsedAnswer(text)
        start = match.start()
        end = _list_end(text, start)
        raw = text[start:end]
        calls: list[ParsedCall] = []
        invalid: list[BadCall] = []
        try:
            tree = ast.parse(raw if raw.rstrip().endswith("]") else raw + "]", mode="eval").body
        except SyntaxError as e:
            invalid.append(BadCall(_first_name(raw), raw, f"not a Python call list: {e.msg}"))
            tree = None
        if tree is not None:
            nodes = tree.elts if isinstance(tree, ast.List) else [tree]
            for node in nodes:
                _read_call(node, calls, invalid)
        content = "\n".join(piece for piece in (text[:start].rstrip(), text[end:].strip()) if piece)
        return ParsedAnswer(content, tuple(calls), tuple(invalid))


def _arguments(items: list[tuple[str, bool]]) -> str:
    """Lark for comma-separated items in order, where optional ones may be left out."""
    if not items:
        return ""
    required = [name for name, needed in items if needed]
    if required:
        out = ' ", " '.join(required)
        for name, needed in items:
            if not needed:
                out += f' (", " {name})?'
        return out
    # All optional: any in-order subset, separated by commas.
    names = [name for name, _ in items]
    alternatives = []
    for k, first in enumerate(names):
        tail = "".join(f' (", " {later})?' for later in names[k + 1 :])
        alternatives.append(f"{first}{tail}")
    return f"({' | '.join(alternatives)})?"


def _list_end(text: str, start: int) -> int:
    depth = 0
    in_string: str | None = None
    escaped = False
    for at in range(start, len(text)):
        char = text[at]
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == in_string:
                in_string = None
        elif char in "\"'":
            in_string = char
        elif char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
            if depth == 0:
                return at + 1
    return len(text)


def _first_name(raw: str) -> str | None:
    match = re.match(r"\[\s*([A-Za-z_][\w.]*)", raw)
    return match.group(1) if match else None


def _literal(node: ast.expr) -> Any:
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, ast.List):
        return [_literal(item) for item in node.elts]
    if isinstance(node, ast.Dict):
        return {
            _literal(k): _literal(v) for k, v in zip(node.keys, node.values, strict=True) if k is not None
        }
    return ast.literal_eval(node)


def _read_call(node: ast.expr, calls: list[ParsedCall], invalid: list[BadCall]) -> None:
    raw = ast.unparse(node)
    if not isinstance(node, ast.Call) or not isinstance(node.func, (ast.Name, ast.Attribute)):
        invalid.append(BadCall(None, raw, "expected a function call"))
        return
    name = ast.unparse(node.func)
    if node.args:
        invalid.append(BadCall(name, raw, "positional arguments: expected keyword arguments only"))
        return
    try:
        args = {kw.arg: _literal(kw.value) for kw in node.keywords if kw.arg is not None}
    except (ValueError, TypeError, SyntaxError) as e:
        invalid.append(BadCall(name, raw, f"arguments: not literals: {e}"))
        return
    calls.append(ParsedCall(name, args))


PYTHONIC = PythonicFormat()
