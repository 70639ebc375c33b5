"""Config as text: YAML with line numbers, byte sizes, and errors a person can act on.

Every problem names its YAML path, what was wrong and what is allowed (with a
did-you-mean for near misses), e.g. `agentkv.budget.device_tokens: must be > 0,
got -5 (line 3)`. `agentkv.config` builds its models; this module turns
pydantic's errors and YAML's into those lines.
"""

from __future__ import annotations

import difflib
import re
import typing
from collections.abc import Callable, Mapping
from decimal import Decimal, InvalidOperation
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ValidationError

Loc = tuple[str | int, ...]
"""A path in the config: keys and list indices."""


class ConfigProblems(ValueError):
    """Several problems found by one validator, each at its own path below the field.

    Pydantic reports a validator's error at the field it validates; rules and
    keep-ratio tables hold many independent entries, and the user needs to know which
    one is wrong. `_format_errors` expands this into one line per problem.
    """

    def __init__(self, problems: list[tuple[Loc, str]]) -> None:
        super().__init__("; ".join(f"{'.'.join(map(str, p)) or '.'}: {m}" for p, m in problems))
        self.problems = problems


def load_yaml(text: str, source: str) -> tuple[Any, dict[Loc, int]]:
    """Parse YAML safely; also map each mapping-key path to its 1-based line for errors."""
    loader: yaml.SafeLoader | None = None
    try:
        loader = yaml.SafeLoader(text)
        node = loader.get_single_node()
        # Before constructing: construction folds merge keys (`<<`) into the mapping.
        duplicate = duplicate_key(node, (), source, set()) if node is not None else None
        data = loader.construct_document(node) if node is not None else None
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"{source}, line {mark.line + 1}, column {mark.column + 1}" if mark else source
        problem = " ".join(str(p) for p in (e.context, e.problem) if p) or str(e)
        msg = f"{where}: invalid YAML: {problem}"
        raise ValueError(msg) from None
    except yaml.YAMLError as e:  # e.g. ReaderError: a control character in the text
        msg = f"{source}: invalid YAML: {' '.join(str(e).split())}"
        raise ValueError(msg) from None
    except (ValueError, OverflowError) as e:  # constructors: impossible dates, huge ints
        msg = f"{source}: invalid YAML value: {e}"
        raise ValueError(msg) from None
    except RecursionError:
        msg = f"{source}: invalid YAML: nested too deeply"
        raise ValueError(msg) from None
    finally:
        if loader is not None:
            loader.dispose()
    if duplicate is not None:
        raise ValueError(duplicate)
    lines: dict[Loc, int] = {}
    if node is not None:
        collect_lines(node, (), lines, depth=0)
    return data, lines


def duplicate_key(node: yaml.Node, path: Loc, source: str, seen: set[int]) -> str | None:
    """The error for the first mapping that repeats a key, or None; PyYAML would keep the last silently.

    Merge keys (`<<: *defaults`) may be overridden, as YAML allows; aliases are walked once.
    The message reads `<source>, line N: invalid YAML: duplicate key 'k' in a.b (first at line M)`.
    """
    if id(node) in seen:
        return None
    seen.add(id(node))
    if isinstance(node, yaml.SequenceNode):
        return next((p for item in node.value if (p := duplicate_key(item, path, source, seen))), None)
    if not isinstance(node, yaml.MappingNode):
        return None
    first: dict[tuple[str, str], yaml.Node] = {}
    for key, value in node.value:
        name = str(key.value) if isinstance(key, yaml.ScalarNode) else None
        if name is not None and key.tag != "tag:yaml.org,2002:merge":
            earlier = first.setdefault((key.tag, name), key)
            if earlier is not key:
                where = f"in {'.'.join(map(str, path))}" if path else "at the top level"
                return (
                    f"{source}, line {key.start_mark.line + 1}: invalid YAML: duplicate key {name!r} {where} "
                    f"(first at line {earlier.start_mark.line + 1})"
                )
        problem = duplicate_key(value, (*path, name or "?"), source, seen)
        if problem is not None:
            return problem
    return None


def collect_lines(node: yaml.Node, path: Loc, lines: dict[Loc, int], depth: int) -> None:
    """Record the line of every mapping key under `node` (config paths are shallow)."""
    if not isinstance(node, yaml.MappingNode) or depth > 8:  # config paths are shallow
        return
    for key, value in node.value:
        if isinstance(key, yaml.ScalarNode):
            sub = (*path, str(key.value))
            lines.setdefault(sub, key.start_mark.line + 1)
            collect_lines(value, sub, lines, depth + 1)


def line_near(lines: Mapping[Loc, int], path: Loc) -> int | None:
    """The line of `path`, else of where it was written in a shorthand, else of its nearest parent.

    A policy's parameters are validated at `policy.params.<key>` but may be written as
    `policy.<key>`, and `policy: snapkvv` has no `policy.name` line of its own: the
    error then points at the line that holds the value.
    """
    candidates = [path]
    if "params" in path:
        at = path.index("params")
        candidates.append((*path[:at], *path[at + 1 :]))
    candidates += [path[:end] for end in range(len(path) - 1, 0, -1)]
    for candidate in candidates:
        if candidate in lines:
            return lines[candidate]
    return None


def format_errors(
    error: ValidationError, prefix: str, line_of: Callable[[Loc], int | None] | None, root: type[BaseModel]
) -> list[str]:
    """One line per problem: `<prefix>.<path>: <what was wrong; what is allowed> (line N)`."""
    out: list[str] = []
    for err in error.errors():
        loc: Loc = tuple(err["loc"])
        ctx = err.get("ctx") or {}
        cause = ctx.get("error")
        problems = cause.problems if isinstance(cause, ConfigProblems) else [((), describe(err, loc, root))]
        for sub, message in problems:
            full = (*loc, *sub)
            line = line_of(full) if line_of else None
            where = f" (line {line})" if line else ""
            text = f"{'.'.join([prefix, *map(str, full)])}: {message}{where}"
            if text not in out:
                out.append(text)
    return out


TYPE_MESSAGES: tuple[tuple[str, str], ...] = (
    ("int_", "must be an integer"),
    ("float_", "must be a number"),
    ("finite_number", "must be a finite number"),
    ("bool_", "must be true or false"),
    ("string_too_short", "must not be empty"),
    ("string_", "must be a string"),
)
"""What a value of the wrong type must be, by pydantic error kind prefix (the first that matches)."""


def describe(err: Any, loc: Loc, root: type[BaseModel]) -> str:
    """One readable problem for one pydantic error: what was wrong, what is allowed."""
    kind: str = err["type"]
    ctx: dict[str, Any] = err.get("ctx") or {}
    got = show_value(err.get("input"))
    bounds = {
        "greater_than": ("gt", ">"),
        "greater_than_equal": ("ge", ">="),
        "less_than": ("lt", "<"),
        "less_than_equal": ("le", "<="),
    }
    if kind in bounds:
        key, op = bounds[kind]
        return f"must be {op} {number(ctx.get(key))}, got {got}"
    if kind == "extra_forbidden":
        model = model_at(root, loc[:-1])
        removed: Mapping[str, str] = getattr(model, "removed_keys", {})
        if str(loc[-1]) in removed:
            return f"removed: {removed[str(loc[-1])]}"
        allowed = tuple(model.model_fields) if model else ()
        return unknown_value("key", str(loc[-1]), allowed, in_path=True)
    if kind == "invalid_key":
        return f"keys must be strings, got {got}"
    if kind == "value_error":
        return str(ctx.get("error", err["msg"]))
    if kind == "literal_error":
        values = literal_values(root, loc)
        listed = ", ".join(map(str, values)) if values else str(ctx.get("expected"))
        return f"unknown value {got}; allowed: {listed}"
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        return f"must be a mapping, got {kind_of(err.get('input'))}"
    if kind == "recursion_loop":
        return "refers to itself (a YAML alias cycle)"
    expected = next((text for prefix, text in TYPE_MESSAGES if kind.startswith(prefix)), None)
    return f"{expected or err['msg']}, got {got}"


def model_at(root: type[BaseModel], loc: Loc) -> type[BaseModel] | None:
    """The config model reached by following `loc` from `root`, if any."""
    model: type[BaseModel] = root
    for part in loc:
        field = model.model_fields.get(str(part))
        if field is None or not (
            isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)
        ):
            return None
        model = field.annotation
    return model


def literal_values(root: type[BaseModel], loc: Loc) -> tuple[object, ...]:
    """The values a `Literal` field at `loc` allows, for listing them plainly."""
    model = model_at(root, loc[:-1])
    field = model.model_fields.get(str(loc[-1])) if model and loc else None
    if field is None:
        return ()
    values: list[object] = []
    stack = [field.annotation]
    while stack:
        annotation = stack.pop(0)
        if typing.get_origin(annotation) is Literal:
            values.extend(typing.get_args(annotation))
        else:
            stack.extend(typing.get_args(annotation))
    return tuple(values)


def unknown_value(what: str, value: object, allowed: tuple[str, ...], in_path: bool = False) -> str:
    """`unknown <what> 'x' (did you mean 'y'?); allowed: a, b, c`.

    When the value is a mapping key it already ends the error's path, so `in_path`
    leaves it out of the message.
    """
    hint = ""
    if isinstance(value, str):
        close = difflib.get_close_matches(value, allowed, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
    shown = "" if in_path else f" {show_value(value)}"
    return f"unknown {what}{shown}{hint}; allowed: {', '.join(allowed) or '(none)'}"


def number(value: object) -> str:
    """`1` rather than `1.0` for a float bound: pydantic widens bounds to the field's type."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def show_value(value: object) -> str:
    """A value as an error message shows it: short, and never the whole of a big mapping."""
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, list | tuple | set):
        return f"a list {truncate(repr(value), 40)}"
    try:
        text = repr(value)
    except ValueError:  # ints over Python's str-conversion digit limit
        text = f"<{type(value).__name__}>"
    return truncate(text, 60)


def kind_of(value: object) -> str:
    """What a value is, for "must be a mapping, got ..."."""
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, list | tuple | set):
        return f"a list {truncate(repr(value), 40)}"
    if value is None:
        return "null"
    return f"{type(value).__name__} {show_value(value)}"


def truncate(text: str, limit: int) -> str:
    """`text`, cut to `limit` characters with an ellipsis."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


_BYTE_UNITS: dict[str, int] = {
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_BYTES_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*$")
_BYTES_FORMS = (
    "accepted: an integer >= 0 (bytes), or a number with a unit: "
    "B, kB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024), "
    "e.g. 1024, '512kB', '64MiB', '1.5 GB'"
)


def parse_bytes(value: object) -> int:
    """Read a byte count from YAML: an int, or a string such as `"64MiB"` or `"1.5 GB"`.

    Budgets are easier to read and review as `64MiB` than as `67108864`, and both
    binary and decimal units are common, so both are accepted and spelled out.

    Args:
        value: An int >= 0, a float that is a whole number, or a string: digits with an
            optional fraction and an optional unit (case-insensitive), e.g. `"1024"`,
            `"512kB"`, `"64MiB"`, `"1.5 GB"`. Decimal units (kB, MB, GB, TB) are
            powers of 1000, binary units (KiB, MiB, GiB, TiB) powers of 1024.

    Returns:
        The number of bytes.

    Raises:
        ValueError: The value is negative, not a whole number of bytes, or not in one of
            the accepted forms (the message lists them).
    """
    if isinstance(value, bool):
        raise ValueError(f"cannot read {value!r} as a byte size; {_BYTES_FORMS}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"byte size must be >= 0, got {value}; {_BYTES_FORMS}")
        return value
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")) or not value.is_integer() or value < 0:
            raise ValueError(f"cannot read {value!r} as a byte size; {_BYTES_FORMS}")
        return int(value)
    if not isinstance(value, str):
        raise ValueError(f"cannot read {show_value(value)} as a byte size; {_BYTES_FORMS}")
    match = _BYTES_RE.match(value)
    unit = match.group(2).lower() if match else ""
    if match is None or (unit and unit not in _BYTE_UNITS):
        raise ValueError(f"cannot read {show_value(value)} as a byte size; {_BYTES_FORMS}")
    try:
        amount = Decimal(match.group(1)) * _BYTE_UNITS[unit or "b"]
    except InvalidOperation as e:  # pragma: no cover - the regex only lets decimals through
        raise ValueError(f"cannot read {show_value(value)} as a byte size; {_BYTES_FORMS}") from e
    if amount != amount.to_integral_value():
        raise ValueError(f"{show_value(value)} is not a whole number of bytes ({amount}); {_BYTES_FORMS}")
    return int(amount)
