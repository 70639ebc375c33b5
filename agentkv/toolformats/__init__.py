"""Tool-call formats: each family's protocol for describing, writing, constraining and reading calls.

`FORMATS` names every format; `tool_format(name)` picks one (the name a user writes in
`ChatAgentKV(tool_format=...)` or the YAML's `agentkv.chat.tool_format`);
`detect_tool_format(template)` reads the one a chat template speaks. Reasoning blocks
(`<think>`) are split off answers by `split_reasoning`.
"""

from agentkv.toolformats.base import BadCall, CallMode, ParsedAnswer, ParsedCall, ToolFormat, new_call_id
from agentkv.toolformats.detect import detect_reasoning, detect_tool_format
from agentkv.toolformats.hermes import HERMES, QWEN, TOOL_CALL_CLOSE, TOOL_CALL_OPEN
from agentkv.toolformats.json_calls import JsonCallFormat
from agentkv.toolformats.llama3 import LLAMA3_JSON
from agentkv.toolformats.mistral import MISTRAL
from agentkv.toolformats.pythonic import PYTHONIC, PythonicFormat
from agentkv.toolformats.reasoning import THINK, ReasoningTags, split_reasoning
from agentkv.toolformats.tagged import GRANITE, PHI4

FORMATS: dict[str, ToolFormat] = {
    fmt.name: fmt for fmt in (HERMES, QWEN, LLAMA3_JSON, MISTRAL, GRANITE, PHI4, PYTHONIC)
}
"""Every format by the name a user gives."""


def tool_format(name: str) -> ToolFormat:
    """The format called `name`; ValueError listing the names when there is none."""
    fmt = FORMATS.get(name)
    if fmt is None:
        msg = f"tool_format: unknown format {name!r}; allowed: {', '.join(FORMATS)}"
        raise ValueError(msg)
    return fmt


__all__ = [
    "FORMATS",
    "GRANITE",
    "HERMES",
    "LLAMA3_JSON",
    "MISTRAL",
    "PHI4",
    "PYTHONIC",
    "QWEN",
    "THINK",
    "TOOL_CALL_CLOSE",
    "TOOL_CALL_OPEN",
    "BadCall",
    "CallMode",
    "JsonCallFormat",
    "ParsedAnswer",
    "ParsedCall",
    "PythonicFormat",
    "ReasoningTags",
    "ToolFormat",
    "detect_reasoning",
    "detect_tool_format",
    "new_call_id",
    "split_reasoning",
    "tool_format",
]
