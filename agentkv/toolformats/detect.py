"""Which tool-call format and reasoning tags a chat template speaks, read from its text.

Like llama.cpp's chat layer, detection looks for what the template writes around a
call; a template that writes none gets Hermes, described in the system prompt.
"""

from __future__ import annotations

from agentkv.toolformats.base import ToolFormat
from agentkv.toolformats.hermes import HERMES, QWEN
from agentkv.toolformats.llama3 import LLAMA3_JSON
from agentkv.toolformats.mistral import MISTRAL
from agentkv.toolformats.reasoning import THINK, ReasoningTags
from agentkv.toolformats.tagged import GRANITE, PHI4

__all__ = ["detect_reasoning", "detect_tool_format"]

_MARKS: tuple[tuple[tuple[str, ...], ToolFormat], ...] = (
    (("[TOOL_CALLS]",), MISTRAL),
    (("<|tool_call|>", "<|/tool_call|>"), PHI4),
    (("<|tool_call|>",), GRANITE),
    (("<tool_call>\\n", "<tool_call>\n"), QWEN),
    (("<tool_call>",), HERMES),
    (('"parameters": ', "<|start_header_id|>"), LLAMA3_JSON),
)
"""Marks (all must appear; for Qwen either spelling) and the format they mean, first match wins."""


def detect_tool_format(template: str | None) -> ToolFormat:
    """The format `template` renders calls in; Hermes when it renders none."""
    text = template or ""
    for marks, fmt in _MARKS:
        if fmt is QWEN:
            if any(mark in text for mark in marks):
                return fmt
        elif all(mark in text for mark in marks):
            return fmt
    return HERMES


def detect_reasoning(template: str | None) -> ReasoningTags | None:
    """The reasoning tags `template` knows (`<think>`), or None."""
    text = template or ""
    return THINK if THINK.close in text or THINK.open in text else None
