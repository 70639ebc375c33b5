"""The short conversation the session and store tests replay, and their logits tolerance."""

from __future__ import annotations

TOL = 1e-4

HISTORY = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "The secret code is 4417. Remember the package tracking number ZX-99."},
    {"role": "assistant", "content": "Noted: code 4417 and tracking number ZX-99."},
    {"role": "user", "content": "What is the weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": "call_1", "name": "weather", "args": {"city": "Paris"}}],
    },
    {
        "role": "tool",
        "content": "search results: sunny skies, lorem ipsum dolor sit amet",
        "tool_call_id": "call_1",
    },
    {"role": "user", "content": "Thanks. And the code?"},
]
