"""Grammars for what an answer may be: a tool call, text that cannot start one, or JSON.

Every builder is a pure function of its input and returns Lark text (llguidance's
dialect), so the grammar of a tool set is the same string call after call and the
compiled form can be cached by it. Tool calls use the `<tool_call>` protocol that
`agentkv.chat` renders and `agentkv_langchain.tools` parses:
`<tool_call>{"name": "<tool>", "arguments": {...}}</tool_call>`.

The arguments follow the tool's JSON schema with the separators `json.dumps` writes
(the form the model reads in its prompt), and an object schema that lists its
properties takes no other keys unless it says so (`strict_schema`): a small model
otherwise copies the schema's own keywords into its arguments.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping, Sequence
from typing import Any

import llguidance

from agentkv.chat import TOOL_CALL_CLOSE, TOOL_CALL_OPEN

PSEUDO_CALLS = ("<tool", "<function", '{"name"', '{ "name"')
"""Text a plain answer may not contain: the openings of the call syntaxes small models imitate
(`<tool` covers `<tool_call>` and a tag cut short by the end of the answer)."""
JSON_FORMAT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""llguidance JSON options: `json.dumps`'s separators and no free whitespace (no newline loops)."""
CALL_SEPARATOR = "\n"
"""What separates parallel calls."""

_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
_SCHEMA_ONES = ("items", "additionalItems", "not", "if", "then", "else", "contains", "propertyNames")


class GrammarError(ValueError):
    """A schema or grammar the grammar library cannot express (the message names where)."""


def strict_schema(schema: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of `schema` where each object that lists `properties` allows no other keys.

    JSON schema allows unlisted keys unless `additionalProperties` says otherwise;
    function-calling schemas (pydantic's, LangChain's) leave it out but mean "these
    keys". An explicit `additionalProperties` is kept as it is.
    """
    out = copy.deepcopy(dict(schema))
    _close_objects(out)
    return out


def _close_objects(node: Any) -> None:
    if not isinstance(node, dict):
        return
    if isinstance(node.get("properties"), Mapping) and "additionalProperties" not in node:
        node["additionalProperties"] = False
    for key in _SCHEMA_LISTS:
        for child in node.get(key) or ():
            _close_objects(child)
    for key in _SCHEMA_MAPS:
        value = node.get(key)
        if isinstance(value, Mapping):
            for child in value.values():
                _close_objects(child)
    for key in _SCHEMA_ONES:
        _close_objects(node.get(key))
    _close_objects(node.get("additionalProperties"))


def json_rule(schema: Mapping[str, Any]) -> str:
    """The Lark body `%json {...}` for `schema` (strict, with `JSON_FORMAT`)."""
    closed = strict_schema(schema)
    closed["x-guidance"] = {**JSON_FORMAT, **(closed.get("x-guidance") or {})}
    return "%json " + json.dumps(closed, ensure_ascii=False)


def json_grammar(schema: Mapping[str, Any] | None = None) -> str:
    """JSON that validates against `schema` (None: any JSON object)."""
    return f"start: {json_rule(schema if schema is not None else {'type': 'object'})}\n"


def _literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def lark_literal(text: str, specials: Mapping[str, int]) -> str:
    """Lark that matches `text`, with each special token in it as a token reference `<[id]>`.

    The grammar library matches a special token only by its id, never by its spelling;
    `specials` maps the tokenizer's special tokens (their text) to their ids.
    """
    parts: list[str] = []
    rest = text
    while rest:
        found = [(rest.find(token), token) for token in specials if token and token in rest]
        if not found:
            parts.append(_literal(rest))
            break
        at, token = min(found, key=lambda hit: (hit[0], -len(hit[1])))
        if at:
            parts.append(_literal(rest[:at]))
        parts.append(f"<[{specials[token]}]>")
        rest = rest[at + len(token) :]
    return " ".join(parts) if parts else '""'


def text_terminal(name: str, bans: Sequence[str]) -> str:
    """A Lark terminal for any text that contains none of `bans`."""
    alternatives = "|".join(regex_escape(b) for b in bans)
    return f"{name}: /(?s:.*)/ & ~/(?s:.*({alternatives}).*)/"


def prelude_rule(trigger: str, bans: Sequence[str]) -> str:
    """The Lark rule `prelude`: text up to the first `trigger` (included) that holds none of `bans`.

    A ban the trigger starts with (`<tool` for `<tool_call>`) may appear only as the
    trigger's own start: the text before a call is held to a text answer's bans, and
    once the text ends in such a ban the grammar's only way on is the rest of the
    trigger. Left free (`<tool` then anything), that state has no short ending a
    budget check could find, and the call's opening would be refused for the budget.
    """
    tag = regex_escape(trigger)
    rule = f"prelude[lazy]: /(?s:.*){tag}/"
    others = "|".join(regex_escape(b) for b in bans if not trigger.startswith(b))
    if others:
        rule += f" & ~/(?s:.*({others}).*)/"
    early = "|".join(regex_escape(b) for b in bans if trigger.startswith(b) and b != trigger)
    if early:
        rule += f" & ~/(?s:.*({early}).*{tag})/"
    return rule


def regex_escape(text: str) -> str:
    """`text` as a literal inside a Lark `/regex/` (newlines and tabs written as escapes)."""
    special = set("\\.^$|?*+()[]{}/")
    escaped = "".join(f"\\{c}" if c in special else c for c in text)
    return escaped.replace("\n", "\\n").replace("\t", "\\t")


def _call_rules(tools: Sequence[Mapping[str, Any]]) -> tuple[str, list[str]]:
    """`(the rule "body" choosing one tool's call after the open tag, the rules it uses)`."""
    names: list[str] = []
    rules: list[str] = []
    for i, tool in enumerate(tools):
        function = tool.get("function", tool)
        name = str(function.get("name", ""))
        parameters = function.get("parameters") or {"type": "object", "properties": {}}
        head = _literal(f'{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": ')
        rules.append(f'call_{i}: {head} args_{i} "}}"')
        rules.append(f"args_{i}: {json_rule(parameters)}")
        names.append(f"call_{i}")
    body = f"body: ({' | '.join(names)}) {_literal(TOOL_CALL_CLOSE)}"
    return body, rules


def tool_call_grammar(tools: Sequence[Mapping[str, Any]], *, parallel: bool = False) -> str:
    """A call to one of `tools` (the model picks which), or several when `parallel`.

    Args:
        tools: OpenAI-format tool schemas (`{"type": "function", "function": {...}}`).
        parallel: allow more calls after the first, one per line.
    """
    if not tools:
        msg = "tool_call_grammar: no tools"
        raise GrammarError(msg)
    body, rules = _call_rules(tools)
    more = f" ({_literal(CALL_SEPARATOR)} call)*" if parallel else ""
    return "\n".join([f"start: call{more}", f"call: {_literal(TOOL_CALL_OPEN)} body", body, *rules]) + "\n"


def text_grammar() -> str:
    """Text that cannot start a call in any syntax in `PSEUDO_CALLS`."""
    return f"start: TEXT\n{text_terminal('TEXT', PSEUDO_CALLS)}\n"


def text_or_call_grammar(tools: Sequence[Mapping[str, Any]], *, parallel: bool = False) -> str:
    """Text (as `text_grammar`), or text followed by calls to `tools` that follow their schemas.

    The text before a call ends at the first `<tool_call>` tag (a lazy lexeme), and
    from there the call is constrained as in `tool_call_grammar`.
    """
    body, rules = _call_rules(tools)
    more = f" ({_literal(CALL_SEPARATOR)} call)*" if parallel else ""
    lines = [
        f"start: TEXT | prelude body{more}",
        prelude_rule(TOOL_CALL_OPEN, PSEUDO_CALLS),
        f"call: {_literal(TOOL_CALL_OPEN)} body",
        body,
        *rules,
        text_terminal("TEXT", PSEUDO_CALLS),
    ]
    return "\n".join(lines) + "\n"


def grammar_error(lark: str) -> str | None:
    """Why llguidance cannot build `lark` (its first lines), or None when it can."""
    grammar = llguidance.LLMatcher.grammar_from_lark(lark)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if not is_error:
        return None
    lines = messages[0].strip().splitlines()
    return " ".join(line.strip() for line in lines if not line.lstrip().startswith(("1 |", "^")))


def check_grammar(lark: str, where: str) -> str:
    """The llguidance grammar for `lark`, checked; `GrammarError` naming `where` if it cannot be built."""
    error = grammar_error(lark)
    if error is not None:
        msg = f"{where}: the grammar library cannot build this grammar: {error}"
        raise GrammarError(msg)
    return llguidance.LLMatcher.grammar_from_lark(lark)


def check_schema(schema: Mapping[str, Any], where: str) -> None:
    """Raise `GrammarError` when `schema` cannot become a grammar, naming `where` and the path inside it."""
    if not isinstance(schema, Mapping):
        msg = f"{where}: expected a JSON schema object, got {type(schema).__name__}"
        raise GrammarError(msg)
    error = grammar_error(json_grammar(schema))
    if error is None:
        return
    path = _failing_path(schema, "")
    msg = f"{where}{path}: the grammar library cannot express this schema: {error}"
    raise GrammarError(msg)


def _failing_path(schema: Mapping[str, Any], path: str) -> str:
    """The deepest sub-schema of `schema` that fails on its own (ones with `$ref` are not split off)."""
    children: list[tuple[str, Any]] = []
    for key in _SCHEMA_MAPS[:1]:
        for name, child in (schema.get(key) or {}).items():
            children.append((f"{path}.{key}.{name}", child))
    for key in _SCHEMA_LISTS:
        for i, child in enumerate(schema.get(key) or ()):
            children.append((f"{path}.{key}[{i}]", child))
    for key in _SCHEMA_ONES:
        children.append((f"{path}.{key}", schema.get(key)))
    for child_path, child in children:
        if not isinstance(child, Mapping) or "$ref" in json.dumps(child):
            continue
        if grammar_error(json_grammar(child)) is not None:
            return _failing_path(child, child_path)
    return path
