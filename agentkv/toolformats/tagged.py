"""`<|tool_call|>` calls: Granite 3.x (a JSON list after the tag) and Phi-4-mini (one block per call)."""

from __future__ import annotations

from agentkv.toolformats.json_calls import JsonCallFormat

__all__ = ["GRANITE", "PHI4"]

GRANITE = JsonCallFormat(
    name="granite",
    open="<|tool_call|>[",
    close="]",
    separator=", ",
    header="You are a helpful assistant with access to the following tools, one JSON schema per line:\n",
    footer=(
        "\nWhen a tool is required to answer the user's query, respond only with <|tool_call|> "
        "followed by a JSON list of tools used."
    ),
)

PHI4 = JsonCallFormat(
    name="phi4",
    call_open="<|tool_call|>",
    call_close="<|/tool_call|>",
    separator="",
    header="You are a helpful assistant with some tools:\n",
    footer=(
        "\nTo use a tool, respond in this format: "
        '<|tool_call|>{"name": "foo", "arguments": {"a": 1}}<|/tool_call|>'
    ),
)
