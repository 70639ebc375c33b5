"""The short conversation the session and store tests replay, their logits tolerance, a forced answer."""

from __future__ import annotations

from collections.abc import Callable

import torch

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


def forcing(ids: list[int]) -> Callable[[list[int], torch.Tensor], torch.Tensor]:
    """A logits processor that makes the answer `ids`, one token per step."""

    def force(generated: list[int], logits: torch.Tensor) -> torch.Tensor:
        forced = torch.full_like(logits, float("-inf"))
        forced[ids[min(len(generated), len(ids) - 1)]] = 0.0
        return forced

    return force
