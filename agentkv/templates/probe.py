"""What a chat template renders itself, found by rendering small probe conversations.

Each rule is tested by what comes out, not by reading the template's source: a role
is supported when rendering it raises nothing, its text appears, and the rendering
of a conversation stays a prefix of the rendering of that conversation grown by a
turn (so a cached prefix stays valid). See `RoleRules`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from agentkv.templates.roles import RoleRules

__all__ = ["probe_rules"]

logger = logging.getLogger("agentkv.templates")

Render = Callable[[Sequence[Mapping[str, Any]], Sequence[Mapping[str, Any]] | None], str]
"""`render(dicts, tools)`: the template's text for raw message dicts (no folding)."""

_SYSTEM = "Probe system text."
_USER = "Probe user text."
_USER2 = "Probe second question."
_ANSWER = "Probe answer text."
_NOTE = "Probe note."
_RESULT = "Probe tool result."
_TOOL = "probe_tool_fn"
_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": _TOOL,
            "description": "A probe.",
            "parameters": {"type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]},
        },
    }
]
_CALL = {
    "role": "assistant",
    "content": "",
    "tool_calls": [
        {"id": "a1b2c3d4e", "type": "function", "function": {"name": _TOOL, "arguments": {"x": "1"}}}
    ],
}
_RESULT_MSG = {"role": "tool", "content": _RESULT, "tool_call_id": "a1b2c3d4e", "name": _TOOL}


def _try(render: Render, dicts: Sequence[Mapping[str, Any]], tools: Any = None) -> str | None:
    try:
        return render(dicts, tools)
    except Exception:  # noqa: BLE001 - a template refuses a conversation by raising anything
        return None


def _stays(
    render: Render,
    short: Sequence[Mapping[str, Any]],
    longer: Sequence[Mapping[str, Any]],
    mark: str,
    tools: Any = None,
) -> bool:
    """Whether `short`'s rendering, up to the end of `mark`, starts `longer`'s rendering too.

    Only the text up to `mark` is compared: a template may render the last message its
    own way (Qwen3's empty reasoning block), which says nothing about the role probed.
    """
    head, whole = _try(render, short, tools), _try(render, longer, tools)
    if head is None or whole is None or mark not in head:
        return False
    return whole.startswith(head[: head.rindex(mark) + len(mark)])


def probe_rules(render: Render) -> RoleRules:
    """The `RoleRules` of the template behind `render`."""
    user = {"role": "user", "content": _USER}
    answer = {"role": "assistant", "content": _ANSWER}
    user2 = {"role": "user", "content": _USER2}
    system = {"role": "system", "content": _SYSTEM}
    with_system = _try(render, [system, user])
    system_ok = (
        with_system is not None
        and _SYSTEM in with_system
        and _stays(render, [system, user], [system, user, answer, user2], _USER)
    )
    note = {"role": "system", "content": _NOTE}
    notes_ok = system_ok and _stays(
        render, [system, user, answer], [system, user, answer, note, user2], _ANSWER
    )
    rendered_call = _try(render, [user, _CALL])
    calls_ok = rendered_call is not None and _TOOL in rendered_call
    call = _CALL if calls_ok else {"role": "assistant", "content": "call"}
    rendered_result = _try(render, [user, call, _RESULT_MSG])
    tool_ok = (
        rendered_result is not None
        and _RESULT in rendered_result
        and _stays(render, [user, call, _RESULT_MSG], [user, call, _RESULT_MSG, answer], _RESULT)
    )
    described = _try(render, [user], _TOOLS)
    tools_ok = (
        described is not None
        and _TOOL in described
        and _stays(render, [user], [user, answer, user2], _USER, _TOOLS)
    )
    alternation = _try(render, [user, user2]) is None and _try(render, [user, answer, user2]) is not None
    rules = RoleRules(
        system=system_ok,
        notes=notes_ok,
        tool=tool_ok,
        tool_calls=calls_ok,
        tools=tools_ok,
        alternation=alternation,
    )
    logger.debug("chat template rules: %s", rules)
    return rules
