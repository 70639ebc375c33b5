"""Finishing a constrained answer inside its token budget.

A grammar says what may come next, not how soon the answer can end: a model that
writes a long string value would be cut by `max_new_tokens` in the middle of its
JSON. Near the end of the budget the processor therefore estimates how many tokens
the shortest way out takes (closing the open strings, the fewest required keys
with the smallest values, the closing brackets) by playing it out on a copy of the
grammar state, and when the budget left is down to that, it restricts the model to
those closing tokens. `CLOSING_WINDOW` bounds how early the estimate runs.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

CLOSING_WINDOW = 64
"""The estimate runs only in the last this many tokens of the budget."""
CLOSERS = frozenset('"}]')
STOP_RANK = 100.0
"""The rank of the end-of-turn tokens: the best way to finish is to be finished."""
_PREFERRED = ('""', "[]", "{}", "0")
"""Whole tokens that end a value at once (an empty string, array or object, a zero)."""

_RANKS: dict[int, tuple[Any, torch.Tensor]] = {}
_LOCK = threading.Lock()


def closing_rank(tokenizer: Any, stop_ids: frozenset[int] | set[int]) -> torch.Tensor:
    """How much each token id helps close an answer, `[V]` float (0 = not a closer), cached.

    Stop tokens rank highest, then tokens made only of `"`, `}` and `]` (longer first),
    then `_PREFERRED` values.
    """
    with _LOCK:
        held = _RANKS.get(id(tokenizer))
        if held is not None and held[0] is tokenizer:
            return held[1]
        size = len(tokenizer)
        rank = torch.zeros(size)
        for i in range(size):
            text = tokenizer.decode([i])
            if text and set(text) <= CLOSERS:
                rank[i] = 10.0 + len(text)
            elif text in _PREFERRED:
                rank[i] = 5.0
        for i in stop_ids:
            if i < size:
                rank[i] = STOP_RANK
        _RANKS[id(tokenizer)] = (tokenizer, rank)
        return rank


def closing_choice(allowed: torch.Tensor, rank: torch.Tensor) -> torch.Tensor:
    """The allowed tokens of the best closing rank, `[V]` bool; all allowed ones when none ranks."""
    n = min(allowed.numel(), rank.numel())
    scores = torch.where(allowed[:n], rank[:n], torch.tensor(-1.0))
    best = scores.max()
    if best <= 0:
        return allowed
    out = torch.zeros_like(allowed)
    out[:n] = scores == best
    return out
