"""Finishing a constrained answer inside its token budget.

A grammar says what may come next, not how soon the answer can end: a model that
writes a long string value would be cut by `max_new_tokens` in the middle of its
JSON. Near the end of the budget the processor therefore estimates how many tokens
the shortest way out takes (closing the open strings, the fewest required keys
with the smallest values, the closing brackets) by playing it out on a copy of the
grammar state, and when the budget left is down to that, it restricts the model to
those closing tokens. `CLOSING_WINDOW` bounds how early the estimate runs.

Closing in time is not enough when one token can move the way out far away: with
ten tokens left, opening one more array item of objects turns a seven-token way
out into twenty. So in the same window each picked token is checked against the
budget left (`GrammarProcessor.accept`), and a budget under the grammar's shortest
answer is refused before decoding (`AnswerTooLong`).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch

CLOSING_WINDOW = 64
"""The estimate runs only in the last this many tokens of the budget."""
REJECTIONS = 4
"""Picked tokens refused at one position before only the closing tokens remain (which always fit)."""
RECHECK_AFTER = 8
"""Tokens to wait before estimating again when closing tokens found no way out."""
CLOSERS = frozenset('"}]')
STOP_RANK = 100.0
"""The rank of the end-of-turn tokens: the best way to finish is to be finished."""
SEPARATORS = (",", ", ")
"""Tokens that end a value when a required key or item still has to follow (below the closers)."""
_PREFERRED = ('""', "[]", "{}", "0", ' ""', " []", " {}")
"""Whole tokens that end a value at once (an empty string, array or object, a zero; after `": `
the value's tokens may carry the space)."""

QUOTE_BONUS = 20.0
"""How much a token opening with `"` gains inside a string (and a quarter of it lost elsewhere)."""


class AnswerTooLong(ValueError):
    """The grammar's shortest answer needs more than `max_new_tokens` (raised before decoding)."""

    def __init__(self, needed: int, budget: int) -> None:
        self.needed = needed
        """Tokens the shortest answer found takes (its end of turn included)."""
        self.budget = budget
        msg = (
            f"max_new_tokens={budget} cannot hold this grammar's shortest answer ({needed} tokens): "
            f"raise max_new_tokens to at least {needed}, or make the schema smaller "
            "(fewer required keys or minItems)"
        )
        super().__init__(msg)


@dataclass(frozen=True)
class BudgetCut:
    """Where the budget first kept the model from the token it preferred.

    A token refused by `GrammarProcessor.accept` (no ending fits after it), or outranked
    by a closing token while finishing: the answer still ends inside the grammar, but
    not as the model would have written it (a tool call's opening turned away, a string
    value ended early).
    """

    position: int
    """Tokens produced before it."""
    token: int
    needed: int | None
    """The `max_new_tokens` that would have let it through (None: no ending found after it)."""

    def message(self, budget: int, text: str) -> str:
        """What to tell the user: `text` is the token's text."""
        head = (
            f"max_new_tokens={budget} ended this answer early: at token {self.position} "
            f"the model's next token {text!r}"
        )
        if self.needed is None:
            return f"{head} has no ending the budget could hold"
        return (
            f"{head} needs max_new_tokens >= {self.needed} to finish "
            "(a tool call or a value was cut short); raise max_new_tokens"
        )


_RANKS: dict[int, tuple[Any, torch.Tensor]] = {}
_QUOTES: dict[int, torch.Tensor] = {}
"""Per rank tensor (by id): 1.0 for closing tokens that open with `"`."""
_LENGTHS: dict[int, torch.Tensor] = {}
"""Per rank tensor (by id): each token's text length (the longest allowed token goes furthest)."""
_LOCK = threading.Lock()


def closing_rank(tokenizer: Any, stop_ids: frozenset[int] | set[int]) -> torch.Tensor:
    """How much each token id helps close an answer, `[V]` float (0 = not a closer), cached.

    Stop tokens rank highest, then tokens made only of `"`, `}` and `]` (longer first),
    then a separator (a required key may still follow), then `_PREFERRED` values.
    """
    with _LOCK:
        held = _RANKS.get(id(tokenizer))
        if held is not None and held[0] is tokenizer:
            return held[1]
        size = len(tokenizer)
        rank = torch.zeros(size)
        quotes = torch.zeros(size)
        lengths = torch.zeros(size)
        for i in range(size):
            text = tokenizer.decode([i])
            lengths[i] = len(text)
            if text and set(text) <= CLOSERS:
                rank[i] = 10.0 + len(text)
                quotes[i] = float(text.startswith('"'))
            elif text in SEPARATORS:
                rank[i] = 6.0
            elif text in _PREFERRED:
                rank[i] = 5.0
        for i in stop_ids:
            if i < size:
                rank[i] = STOP_RANK
        _RANKS[id(tokenizer)] = (tokenizer, rank)
        _QUOTES[id(rank)] = quotes
        _LENGTHS[id(rank)] = lengths
        return rank


def closing_choice(allowed: torch.Tensor, rank: torch.Tensor) -> torch.Tensor:
    """The one allowed token that best closes the answer, `[V]` bool; all allowed ones when none ranks.

    Inside a string (most of the vocabulary is allowed) a token opening with `"` ends
    it; elsewhere a `"` would open a new key or value, so brackets come first.
    """
    n = min(allowed.numel(), rank.numel())
    scores = torch.where(allowed[:n], rank[:n], torch.tensor(-1.0))  # [n]
    if scores.max() <= 0:
        return allowed
    quotes = _QUOTES.get(id(rank))
    if quotes is not None:
        in_string = int(allowed.sum()) > allowed.numel() // 4
        bonus = quotes[:n] * (QUOTE_BONUS if in_string else -QUOTE_BONUS / 4)
        scores = scores + torch.where(allowed[:n], bonus, torch.tensor(0.0))  # a forbidden quote stays out
    out = torch.zeros_like(allowed)
    out[int(torch.argmax(scores))] = True
    return out


def token_lengths(rank: torch.Tensor) -> torch.Tensor:
    """Each token's text length, `[V]` float, for the tokenizer `rank` was built for (`closing_rank`)."""
    lengths = _LENGTHS.get(id(rank))
    return lengths if lengths is not None else torch.ones_like(rank)
