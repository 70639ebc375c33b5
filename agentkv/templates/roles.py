"""Messages as a chat template can take them: folded the family's way where it lacks a role.

Some templates have no system role (Gemma), none for tool results (Gemma, Phi-3.5),
demand strict user/assistant alternation (Gemma, Mistral), or render a system message
somewhere that moves as the conversation grows (Mistral: before the last user turn).
`fold` rewrites the message dicts deterministically, as the families' own docs do: the
first system message into the first user turn, later ones as user turns, tool results
as user turns in the tool format's wording, consecutive same-role turns merged. The
same messages always fold the same way, so a conversation that grows renders its
earlier turns the same way, and the cache that holds them stays valid.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from agentkv.chat import ChatMessage
from agentkv.toolformats import ToolFormat

__all__ = ["ID_LENGTH", "RoleRules", "fold", "template_dicts", "template_id"]

ID_LENGTH = 9
"""Call ids handed to templates: 9 letters and digits (Mistral's templates refuse others)."""
TURN_JOINER = "\n\n"
"""Between two texts folded into one turn."""


@dataclass(frozen=True)
class RoleRules:
    """What a chat template renders itself (found by `agentkv.templates.probe`)."""

    system: bool = True
    """A first system message, rendered in place (append-only)."""
    notes: bool = True
    """A later system message (a note), rendered in place without changing what comes before."""
    tool: bool = True
    """Tool results (role "tool")."""
    tool_calls: bool = True
    """An assistant message's `tool_calls`."""
    tools: bool = True
    """The tool list (`tools=`), in a place that does not move as the conversation grows."""
    alternation: bool = False
    """Strict user/assistant alternation: consecutive user (or assistant) turns are merged."""


def template_id(call_id: str) -> str:
    """A call id as templates get it: kept when it is 9 letters or digits, else derived from it, stably."""
    if len(call_id) == ID_LENGTH and call_id.isalnum():
        return call_id
    return hashlib.sha1(call_id.encode("utf-8")).hexdigest()[:ID_LENGTH]


def template_dicts(
    messages: Sequence[ChatMessage], rules: RoleRules, fmt: ToolFormat
) -> list[dict[str, Any]]:
    """The dicts a template renders for `messages` (calls rendered by `fmt` where the template cannot)."""
    out: list[dict[str, Any]] = []
    for message in messages:
        entry: dict[str, Any] = {"role": message.role, "content": message.content}
        if message.tool_calls and rules.tool_calls:
            entry["tool_calls"] = [
                {
                    "id": template_id(c.id),
                    "type": "function",
                    "function": {"name": c.name, "arguments": dict(c.args)},
                }
                for c in message.tool_calls
            ]
        elif message.tool_calls:
            calls = fmt.render_calls([(c.name, c.args, c.id) for c in message.tool_calls])
            entry["content"] = f"{message.content}\n{calls}" if message.content else calls
        if message.reasoning is not None:
            entry["reasoning_content"] = message.reasoning
        if message.tool_call_id is not None:
            entry["tool_call_id"] = template_id(message.tool_call_id)
        if message.name is not None:
            entry["name"] = message.name
        out.append(entry)
    return fold(out, rules, fmt)


def fold(dicts: Sequence[Mapping[str, Any]], rules: RoleRules, fmt: ToolFormat) -> list[dict[str, Any]]:
    """`dicts` with the roles the template lacks folded in (see the module docstring)."""
    out: list[dict[str, Any]] = []
    pending_system: list[str] = []
    seen_user = False
    turn = ""  # the role of the last turn strict alternation counts (calls and results are not turns)
    for raw in dicts:
        entry = dict(raw)
        role = entry["role"]
        if role == "tool" and not rules.tool:
            entry = {"role": "user", "content": fmt.render_result(str(entry.get("content", "")))}
            role = "user"
        if role == "system" and not (rules.system if not seen_user else rules.system and rules.notes):
            if not seen_user:
                pending_system.append(str(entry.get("content", "")))
                continue
            previous = out[-1] if out else None
            if rules.alternation and previous is not None and previous["role"] == "tool":
                # A note after a tool result: part of that turn (a new user turn would break alternation).
                texts = [t for t in (str(previous.get("content", "")), str(entry.get("content", ""))) if t]
                previous["content"] = TURN_JOINER.join(texts)
                continue
            entry = {"role": "user", "content": entry.get("content", "")}
            role = "user"
        result = out[-1] if out and out[-1]["role"] == "tool" else None
        if rules.alternation and role == "user" and turn == "user" and result is not None:
            # A user turn right after a tool result, no answer between: part of that result's turn.
            texts = [t for t in (str(result.get("content", "")), str(entry.get("content", ""))) if t]
            result["content"] = TURN_JOINER.join(texts)
            continue
        if role in ("user", "assistant") and not entry.get("tool_calls"):
            turn = role
        if role == "user" and pending_system:
            texts = [t for t in (*pending_system, str(entry.get("content", ""))) if t]
            entry["content"] = TURN_JOINER.join(texts)
            pending_system = []
        seen_user = seen_user or role == "user"
        previous = out[-1] if out else None
        if (
            rules.alternation
            and previous is not None
            and previous["role"] == role
            and role in ("user", "assistant")
            and not previous.get("tool_calls")
            and not entry.get("tool_calls")
        ):
            texts = [t for t in (str(previous.get("content", "")), str(entry.get("content", ""))) if t]
            previous["content"] = TURN_JOINER.join(texts)
            continue
        out.append(entry)
    return out
