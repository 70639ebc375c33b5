"""Llama 3.x JSON calls: the answer is `{"name": ..., "parameters": {...}}` (one call).

Llama 3.1 / 3.2 / 3.3 templates render a call exactly so and a tool result in the
`ipython` role; built-in tools start with `<|python_tag|>`, which the parser accepts.
"""

from __future__ import annotations

from agentkv.toolformats.json_calls import JsonCallFormat

__all__ = ["LLAMA3_JSON", "PYTHON_TAG"]

PYTHON_TAG = "<|python_tag|>"

LLAMA3_JSON = JsonCallFormat(
    name="llama3_json",
    args_key="parameters",
    single=True,
    separator="; ",
    header=(
        "Given the following functions, please respond with a JSON for a function call with its proper "
        "arguments that best answers the given prompt.\n\n"
    ),
    footer=(
        "\n\nRespond in the format "
        '{"name": function name, "parameters": dictionary of argument name and its value}. '
        "Do not use variables."
    ),
    extra_triggers=(PYTHON_TAG,),
)
