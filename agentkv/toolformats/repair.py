"""Reading JSON that small models write: fences, trailing junk, a few missing closing braces."""

from __future__ import annotations

import json
from typing import Any

__all__ = ["MAX_CLOSERS", "load_object", "object_end", "read_value", "strip_fence"]

MAX_CLOSERS = 3
"""How many missing closing braces a truncated call may lack and still be repaired."""


def read_value(text: str, at: int) -> tuple[Any, int]:
    """The complete JSON object or list starting at `at` and where it ends; `(None, at)` if none."""
    if at >= len(text) or text[at] not in "{[":
        return None, at
    try:
        value, end = json.JSONDecoder().raw_decode(text, at)
    except json.JSONDecodeError:
        return None, at
    return value, end


def object_end(text: str, start: int) -> int | None:
    """Where the JSON object that starts at `start` (after whitespace) ends; None if it is not complete."""
    at = start
    while at < len(text) and text[at].isspace():
        at += 1
    value, end = read_value(text, at)
    return end if isinstance(value, dict) else None


def strip_fence(raw: str) -> str:
    """Unwrap a Markdown code fence around the JSON (some models write one)."""
    if raw.startswith("```"):
        raw = raw[3:]
        raw = raw[4:] if raw.startswith("json") else raw
        raw = raw[: raw.rfind("```")] if raw.rstrip().endswith("```") else raw
    return raw.strip()


def load_object(raw: str) -> tuple[dict[str, Any] | None, str | None]:
    """The first JSON object in `raw`, repairing trailing junk and up to `MAX_CLOSERS` missing `}`."""
    decoder = json.JSONDecoder()
    first_error: str | None = None
    for closers in range(MAX_CLOSERS + 1):
        try:
            obj, _ = decoder.raw_decode(raw + "}" * closers)
        except json.JSONDecodeError as e:
            first_error = first_error or f"not valid JSON: {e}"
            continue
        if isinstance(obj, dict):
            return obj, None
        return None, f"expected a JSON object, got {type(obj).__name__}"
    return None, first_error
