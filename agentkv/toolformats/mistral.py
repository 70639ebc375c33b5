"""Mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}, "id": "<9 characters>"}, ...]`.

Mistral's templates render a call with its id and refuse ids that are not 9 letters or
digits; the grammar lets the model write the id, and the parser keeps it as the call's
id, so the tool result names it and the next rendering matches the cache.
"""

from __future__ import annotations

from agentkv.toolformats.json_calls import JsonCallFormat

__all__ = ["MISTRAL"]

MISTRAL = JsonCallFormat(
    name="mistral",
    open="[TOOL_CALLS][",
    close="]",
    separator=", ",
    call_id=True,
    header="[AVAILABLE_TOOLS][",
    tools_joiner=", ",
    footer="][/AVAILABLE_TOOLS]",
)
