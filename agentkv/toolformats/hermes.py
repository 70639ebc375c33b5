"""Hermes / Qwen: each call in `<tool_call>` tags (Hermes 2 Pro, Qwen 2.5 / 3, the fallback).

`hermes` is the protocol agentkv describes in the system prompt for a template without
tool support (`<tool_call>{...}</tool_call>`, one block per line); `qwen` is the same
protocol as Qwen's templates render it, with a newline inside each tag.
"""

from __future__ import annotations

from agentkv.chat import TOOL_CALL_CLOSE, TOOL_CALL_OPEN
from agentkv.toolformats.json_calls import JsonCallFormat

__all__ = ["HERMES", "QWEN", "TOOL_CALL_CLOSE", "TOOL_CALL_OPEN"]

HERMES = JsonCallFormat(
    name="hermes",
    call_open=TOOL_CALL_OPEN,
    call_close=TOOL_CALL_CLOSE,
    separator="\n",
    header=(
        "You can call tools (functions) to help you answer. The tools, one JSON schema per line:\n<tools>\n"
    ),
    footer=(
        "\n</tools>\n"
        "To call a tool, reply with its name and its arguments as JSON inside tool_call tags, "
        "one block per call:\n"
        f'{TOOL_CALL_OPEN}{{"name": "<tool name>", "arguments": {{"<argument name>": <argument value>}}}}'
        f"{TOOL_CALL_CLOSE}\n"
        "The result comes back in the next message. If no tool is needed, answer directly."
    ),
    result_prefix="<tool_response>\n",
    result_suffix="\n</tool_response>",
)

QWEN = JsonCallFormat(
    name="qwen",
    call_open=f"{TOOL_CALL_OPEN}\n",
    call_close=f"\n{TOOL_CALL_CLOSE}",
    separator="\n",
    header=(
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    ),
    footer=(
        "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
        "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    ),
    result_prefix="<tool_response>\n",
    result_suffix="\n</tool_response>",
    extra_triggers=(TOOL_CALL_OPEN,),
)
